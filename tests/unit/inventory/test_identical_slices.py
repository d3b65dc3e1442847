"""Identical slices per machine type (issue 40, item 3), what every autoscaler requires of a node type:
two nodes of one machine profile publish the same devices, attributes, capacities, counters and pool
structure, names aside, for every offer; and runtime state (MIG mode) does not change what a node of
the type publishes, or where it must (Ampere), the node says so.

Two nodes are two physical machines of one type: the second is the bundled profile under another
name, so that the mock gives its GPUs other UUIDs, as real GPUs have (the mock derives a GPU's UUID
from the profile's name and the GPU's index: every node of one profile would share them otherwise).
The only attributes that differ are then the GPUs' serial facts, driver.inventory.templates'
NODE_FACT_ATTRIBUTES, which a template leaves out."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pynvml
import pytest
import yaml

from driver.cli.main import main
from driver.inventory.discovery import discover_gpus, with_current_mig_mode
from driver.inventory.offers import node_inventory
from driver.inventory.sharing import ALL_KINDS, DEFAULT_KINDS, SharingConfig
from driver.inventory.templates import NODE_FACT_ATTRIBUTES
from driver.nvml.machine import MACHINES_DIR, bundled_machines, load_machine
from driver.nvml.mock import MockNvml
from driver.nvml.session import MOCK_STATE_ENV, NvmlSession

# The default, each kind alone, the kinds that go together, everything; and the feature gates that
# take kinds away (ConsumableCapacity=false: no shares; PartitionableDevices=false: one kind a GPU).
OFFERS: list[list[str]] = [
    [],
    *(["--offer", kind] for kind in sorted(ALL_KINDS)),
    ["--offer", "whole,mps"],
    ["--offer", "mps,timeslice"],
    ["--offer", "whole,mig"],
    ["--offer", ",".join(sorted(ALL_KINDS))],
    ["--offer", ",".join(sorted(ALL_KINDS)), "--mig-share-profiles", "1g.10gb,3g.40gb"],
    ["--feature-gates", "ConsumableCapacity=false"],
    ["--feature-gates", "PartitionableDevices=false", "--offer", "whole"],
]


@pytest.fixture(autouse=True)
def _no_mock_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MOCK_STATE_ENV, raising=False)  # a fresh machine each time, as a new node has


def another_machine_of_the_type(tmp_path: Path, machine: str) -> str:
    raw = yaml.safe_load((MACHINES_DIR / f"{machine}.yaml").read_text())
    raw["name"] = f"{machine}-another"
    path = tmp_path / f"{machine}-another.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def discover(capsys: pytest.CaptureFixture[str], nvml: str, node: str, flags: list[str]) -> tuple[int, str, list[Any]]:
    """`fgpu discover` as users run it: exit code, stderr, the slices."""
    code = main(["discover", "--nvml", nvml, "--node-name", node, "-o", "json", *flags])
    out, err = capsys.readouterr()
    return code, err, json.loads(out)["items"] if code == 0 else []


def without_names(slices: list[Any], node: str) -> list[Any]:
    """The slices less what names the node (slice names, the spec hash over them, nodeName, the
    pool's name) and less the GPUs' serial facts."""
    specs = []
    for item in slices:
        assert item["metadata"]["name"].startswith(f"{node}-")
        spec = copy.deepcopy(item["spec"])
        assert spec.pop("nodeName") == node and spec["pool"]["name"] == node
        spec["pool"]["name"] = "<node>"
        for device in spec.get("devices", []):
            device["attributes"] = {k: v for k, v in device["attributes"].items() if k not in NODE_FACT_ATTRIBUTES}
        specs.append(spec)
    return specs


def differing_attributes(a: list[Any], b: list[Any]) -> set[str]:
    devices_a = [d for s in a for d in s["spec"].get("devices", [])]
    devices_b = [d for s in b for d in s["spec"].get("devices", [])]
    return {
        name
        for x, y in zip(devices_a, devices_b, strict=True)
        for name in x["attributes"].keys() | y["attributes"].keys()
        if x["attributes"].get(name) != y["attributes"].get(name)
    }


@pytest.mark.parametrize("flags", OFFERS, ids=lambda flags: " ".join(flags) or "default")
@pytest.mark.parametrize("machine", bundled_machines())
def test_two_nodes_of_a_machine_type_publish_identical_slices_names_aside(
    machine: str, flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    code_a, err_a, node_a = discover(capsys, f"mock:{machine}", "node-a", flags)
    code_b, err_b, node_b = discover(capsys, f"mock:{another_machine_of_the_type(tmp_path, machine)}", "node-b", flags)
    assert (code_a, err_a) == (code_b, err_b)  # both refuse an offer alike (exit 2, one line), or both publish
    if code_a != 0:
        assert code_a == 2 and err_a.startswith("fgpu: ")
        return
    assert without_names(node_a, "node-a") == without_names(node_b, "node-b")
    # What differs are the serial facts, on every device that carries one: per node, never templated.
    published_facts = {name for s in node_a for d in s["spec"].get("devices", []) for name in d["attributes"]}
    assert differing_attributes(node_a, node_b) == NODE_FACT_ATTRIBUTES & published_facts


MIG_MACHINES = [m for m in bundled_machines() if load_machine(m).gpu.mig_capable]
SWITCH_WITHOUT_RESET = [m for m in MIG_MACHINES if load_machine(m).gpu.mig_toggle_without_reset]
SWITCH_AT_RESET = [m for m in MIG_MACHINES if not load_machine(m).gpu.mig_toggle_without_reset]


def switch_mig_on(session: NvmlSession, index: int) -> None:
    """What an admin does: `nvidia-smi -i N -mig 1`, and where the switch waits for it (Ampere), a
    GPU reset (NvmlSession.set_mig_mode, prepare's, would leave nothing pending there)."""
    status = session.nvml.nvmlDeviceSetMigMode(session.handle(index), pynvml.NVML_DEVICE_MIG_ENABLE)
    if status != pynvml.NVML_SUCCESS:
        session.nvml.reset_gpu(index)


@pytest.mark.parametrize("kinds", [DEFAULT_KINDS, ALL_KINDS], ids=["default", "all"])
@pytest.mark.parametrize("machine", SWITCH_WITHOUT_RESET)
def test_mig_mode_does_not_change_what_a_node_publishes(machine: str, kinds: frozenset):
    """Hopper and newer switch MIG mode at once, so prepare switches it as devices need: a node
    publishes the same devices in either mode, while it runs (the plugin's MIG mode watch) and when
    it starts with MIG on (a node that ran MIG workloads before a restart)."""
    sharing = SharingConfig(default=kinds)
    session = NvmlSession(MockNvml(load_machine(machine)))
    gpus = discover_gpus(session)
    published = node_inventory(gpus, sharing)
    switch_mig_on(session, 0)
    assert node_inventory(with_current_mig_mode(session, gpus), sharing) == published
    assert node_inventory(discover_gpus(session), sharing) == published


@pytest.mark.parametrize("machine", SWITCH_AT_RESET)
def test_on_ampere_mig_mode_changes_the_devices_and_the_node_says_so(machine: str):
    """Ampere switches MIG mode only at a GPU reset, so prepare cannot switch it and a GPU offers what
    its mode allows (driver/inventory/offers.py): a GPU an admin switched to MIG publishes its MIG
    devices instead of whole, MPS and time-sliced ones. Nothing else changes: the other GPUs, the
    counter sets, the device names of a kind; no taint: the node says so in the GPU's devices'
    `notOffered` attribute (and its log). A template therefore promises the MIG mode a node of the
    type starts with (off, as Ampere GPUs ship); a node pool that runs Ampere in MIG mode must start
    every GPU in it, and is a node type of its own (docs/autoscaling.md)."""
    sharing = SharingConfig(default=DEFAULT_KINDS)
    session = NvmlSession(MockNvml(load_machine(machine)))
    gpus = discover_gpus(session)
    before = node_inventory(gpus, sharing)
    switch_mig_on(session, 0)
    after = node_inventory(with_current_mig_mode(session, gpus), sharing)

    def gpu0(inventory):
        return {d.name: d for d in inventory.devices if d.attributes["index"].value == 0}

    assert [d for d in after.devices if d.name not in gpu0(after)] == [
        d for d in before.devices if d.name not in gpu0(before)
    ]
    assert after.counter_sets == before.counter_sets
    assert sorted(gpu0(before)) == ["gpu-0", "gpu-0-mps", "gpu-0-ts"]
    assert gpu0(after) and all(d.attributes["type"].value == "mig" for d in gpu0(after).values())
    assert {d.attributes["notOffered"].value for d in gpu0(before).values()} == {
        "mig: MIG mode off, switching needs a GPU reset"
    }
    assert {d.attributes["notOffered"].value for d in gpu0(after).values()} == {
        "mps,timeslice,whole: MIG mode on, switching needs a GPU reset"
    }
    assert not any(d.taints for d in after.devices)
