"""Standard topology attributes (pcieRoot, numaNode from sysfs; the mock machines' own /sys), and
publishing only what prepare can make real: a GPU whose MIG mode switch waits for a reset offers
what its current mode allows, says why, and the plugin follows a changed mode without a restart."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

import pytest

from driver.common.flags import SettingsError
from driver.common.sysfs import PciTopology, SysfsError, numa_node, pci_topology, pcie_root
from driver.inventory.devices import (
    NOT_OFFERED_ATTRIBUTE,
    NUMA_NODE_ATTRIBUTE,
    PCIE_ROOT_ATTRIBUTE,
    Attribute,
    DeviceTaint,
)
from driver.inventory.discovery import discover_gpus
from driver.inventory.offers import check_offers, node_inventory, shortfall
from driver.inventory.sharing import SharingConfig
from driver.inventory.slices import build_slices
from driver.node.mig_mode_watch import MigModeWatch
from driver.node.publisher import SlicePublisher
from driver.nvml.session import NvmlSession
from testbed.fakes import InMemoryKubeApi, node_object
from tests.support.allocation import DRIVER, allocator, claim, devices, exactly, place

BUS_ID = "0000:3b:00.0"


def pci_device(sysfs: Path, bus_id: str, real_path: str, numa: str | None = "1") -> None:
    """A PCI device as the kernel shows it: its directory under devices/, a relative link to it."""
    directory = sysfs / real_path
    directory.mkdir(parents=True)
    if numa is not None:
        (directory / "numa_node").write_text(f"{numa}\n")
    link = sysfs / "bus" / "pci" / "devices" / bus_id
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(directory, link.parent))


def test_sysfs_gives_the_root_complex_above_bridges_and_the_numa_node(tmp_path: Path):
    pci_device(tmp_path, BUS_ID, f"devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3c:08.0/{BUS_ID}")
    assert pci_topology(BUS_ID, tmp_path) == PciTopology("pci0000:3a", 1)


def test_no_numa_affinity_and_unreadable_sysfs_leave_the_attributes_out(tmp_path: Path, caplog):
    pci_device(tmp_path, BUS_ID, f"devices/pci0000:00/0000:00:01.0/{BUS_ID}", numa="-1")
    assert numa_node(BUS_ID, tmp_path) is None
    with pytest.raises(SysfsError, match=r"cannot read the PCI device link .*0000:99:00.0"):
        pcie_root("0000:99:00.0", tmp_path)
    with caplog.at_level(logging.WARNING):
        assert pci_topology("0000:99:00.0", tmp_path) == PciTopology(None, None)
    assert "0000:99:00.0" in caplog.text


def test_a_link_outside_devices_pci_is_refused(tmp_path: Path):
    pci_device(tmp_path, BUS_ID, f"devices/platform/soc/{BUS_ID}")
    with pytest.raises(SysfsError, match="not to devices/pci<domain>:<bus>"):
        pcie_root(BUS_ID, tmp_path)
    (tmp_path / "bus" / "pci" / "devices" / BUS_ID / "numa_node").write_text("x\n")
    with pytest.raises(SysfsError, match="does not hold a number"):
        numa_node(BUS_ID, tmp_path)


def test_dgx_h100_gpus_pair_under_root_complexes_on_two_numa_nodes():
    gpus = discover_gpus(NvmlSession.open("mock:dgx-h100"))
    assert [g.numa_node for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    roots = [g.pcie_root for g in gpus]
    assert roots[0] == roots[1] != roots[2] == roots[3] != roots[4]
    assert len(set(roots)) == 4 and all(r is not None and r.startswith("pci0000:") for r in roots)
    # Every device of a GPU carries its GPU's values.
    inventory = node_inventory(gpus, SharingConfig())
    for device in inventory.devices:
        gpu = gpus[int(device.name.split("-")[1])]
        assert device.attributes[PCIE_ROOT_ATTRIBUTE] == Attribute("string", gpu.pcie_root)
        assert device.attributes[NUMA_NODE_ATTRIBUTE] == Attribute("int", gpu.numa_node)


def test_match_attribute_on_pcie_root_puts_two_gpus_under_one_root():
    inventory = node_inventory(discover_gpus(NvmlSession.open("mock:dgx-h100")), SharingConfig())
    cluster = allocator(build_slices(DRIVER, "n1", inventory, 1, None))
    index_1 = f'device.attributes["{DRIVER}"].index == 1'
    assert devices(place(cluster, claim("one", exactly("gpu.fgpu.dev", selector=index_1)))) == ["gpu-1"]
    two = [exactly("gpu.fgpu.dev", name=n) for n in ("a", "b")]
    # Unconstrained, the allocator takes gpu-0 and gpu-2 (under different roots); gpu-0's partner
    # under its root is taken, so the constraint needs the next pair.
    assert sorted(devices(cluster.allocate(claim("loose", *two)))) == ["gpu-0", "gpu-2"]
    same_root = [{"matchAttribute": PCIE_ROOT_ATTRIBUTE}]
    assert sorted(devices(place(cluster, claim("pair", *two, constraints=same_root)))) == ["gpu-2", "gpu-3"]


def kinds(inventory) -> dict[int, set[str]]:
    by_gpu: dict[int, set[str]] = {}
    for device in inventory.devices:
        by_gpu.setdefault(int(device.name.split("-")[1]), set()).add(device.attributes["type"].value)
    return by_gpu


def test_an_a100_offers_what_its_mig_mode_allows_and_says_why():
    session = NvmlSession.open("mock:dgx-a100-40gb")
    gpus = discover_gpus(session)
    assert kinds(node_inventory(gpus, SharingConfig()))[0] == {"gpu", "mps", "timeslice"}
    reason = shortfall(gpus[0], SharingConfig())
    assert reason == (
        "GPU 0 (NVIDIA A100-SXM4-40GB) offers no mig: MIG mode is off and switching it on needs a GPU reset "
        "on this GPU (nvidia-smi -i 0 -mig 1, then reset the GPU)"
    )
    assert shortfall(gpus[0], SharingConfig(default=frozenset({"whole", "mps"}))) is None  # MIG not asked for
    # Its devices say so in the slice, within an attribute's 64 characters, for `fgpu status`.
    notes = {d.attributes[NOT_OFFERED_ATTRIBUTE].value for d in node_inventory(gpus, SharingConfig()).devices}
    assert notes == {"mig: MIG mode off, switching needs a GPU reset"}
    asked_less = node_inventory(gpus, SharingConfig(default=frozenset({"whole", "mps"})))
    assert not [d for d in asked_less.devices if NOT_OFFERED_ATTRIBUTE in d.attributes]
    switched = [replace(gpu, mig_enabled=True) for gpu in gpus]
    [note] = {d.attributes[NOT_OFFERED_ATTRIBUTE].value for d in node_inventory(switched, SharingConfig()).devices}
    assert note == "mps,timeslice,whole: MIG mode on, switching needs a GPU reset" and len(note) <= 64
    # An H100 switches MIG mode at once: prepare does it, so it offers everything.
    h100 = discover_gpus(NvmlSession.open("mock:dgx-h100"))[0]
    assert shortfall(h100, SharingConfig()) is None
    assert kinds(node_inventory([h100], SharingConfig()))[0] == {"gpu", "mig", "mps", "timeslice"}


def test_the_plugin_follows_an_a100_switched_to_mig_and_reset(caplog):
    session = NvmlSession.open("mock:dgx-a100-40gb")
    gpus = discover_gpus(session)
    api = InMemoryKubeApi()
    api.nodes["n1"] = node_object("n1")
    sharing = SharingConfig()
    publisher = SlicePublisher(api, DRIVER, "n1", node_inventory(gpus, sharing))
    publisher.reconcile()
    watch = MigModeWatch(session, gpus, sharing, publisher.set_inventory)

    def published_kinds() -> set[str]:
        return {
            d["attributes"]["type"]["string"]
            for s in api.slices.values()
            for d in s["spec"].get("devices", [])
            if d["attributes"]["index"]["int"] == 3
        }

    generation = next(iter(api.slices.values()))["spec"]["pool"]["generation"]
    watch.check()  # nothing changed: nothing written
    assert next(iter(api.slices.values()))["spec"]["pool"]["generation"] == generation
    assert published_kinds() == {"gpu", "mps", "timeslice"}

    handle = session.handle(3)
    session.nvml.nvmlDeviceSetMigMode(handle, 1)  # pending until the reset: nothing changes yet
    watch.check()
    assert published_kinds() == {"gpu", "mps", "timeslice"}
    session.nvml.reset_gpu(3)
    with caplog.at_level(logging.INFO, logger="driver.node.mig_mode_watch"):
        watch.check()
    assert published_kinds() == {"mig"}
    assert "GPU 3: MIG mode is on now; GPU 3 (NVIDIA A100-SXM4-40GB) offers no mps, timeslice, whole" in caplog.text
    assert next(iter(api.slices.values()))["spec"]["pool"]["generation"] > generation


def test_a_new_inventory_keeps_the_taints_in_force():
    gpus = discover_gpus(NvmlSession.open("mock:dgx-a100-40gb"))
    api = InMemoryKubeApi()
    api.nodes["n1"] = node_object("n1")
    publisher = SlicePublisher(api, DRIVER, "n1", node_inventory(gpus, SharingConfig()))
    taint = DeviceTaint("gpu.fgpu.dev/xid", "79", "NoSchedule", "2026-01-01T00:00:00Z")
    publisher.set_taints({"gpu-0": (taint,)})
    publisher.set_inventory(node_inventory(gpus, SharingConfig(default=frozenset({"whole"}))))
    published = {d["name"]: d.get("taints") for s in api.slices.values() for d in s["spec"].get("devices", [])}
    assert set(published) == {f"gpu-{i}" for i in range(8)}
    assert published["gpu-0"] == [
        {"key": "gpu.fgpu.dev/xid", "value": "79", "effect": "NoSchedule", "timeAdded": "2026-01-01T00:00:00Z"}
    ]


def test_shares_inside_mig_partitions_are_offerable_per_gpu_and_alone():
    """mig-mps and mig-timeslice count as what a MIG-capable GPU can offer: asked per GPU (the
    sharing config's own example) or as the only kinds, they are published, not refused."""
    gpus = discover_gpus(NvmlSession.open("mock:dgx-h100"))
    per_gpu = SharingConfig(per_gpu={1: frozenset({"mps", "mig-mps"})}, mig_share_profiles=frozenset({"3g.40gb"}))
    check_offers(gpus, per_gpu)
    assert {"mps", "mig-mps"} <= kinds(node_inventory(gpus, per_gpu))[1]
    alone = SharingConfig(default=frozenset({"mig-timeslice"}))
    check_offers(gpus, alone)
    assert kinds(node_inventory(gpus, alone))[0] == {"mig-timeslice"}
    l4 = discover_gpus(NvmlSession.open("mock:l4x4"))
    with pytest.raises(SettingsError, match=r"asks GPU 0 \(NVIDIA L4\) for mig-mps, which it cannot offer"):
        check_offers(l4, SharingConfig(per_gpu={0: frozenset({"mig-mps"})}))
