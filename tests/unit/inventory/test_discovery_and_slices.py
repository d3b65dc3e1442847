import json
import subprocess
import sys

import pytest

from driver.common.quantity import format_quantity
from driver.inventory.devices import Attribute, Inventory, PublishedDevice
from driver.inventory.discovery import cuda_version, discover_gpus, pci_bus_id, semver
from driver.inventory.offers import node_inventory
from driver.inventory.sharing import SharingConfig
from driver.inventory.slices import MAX_DEVICES_PER_SLICE, build_slices, node_owner
from driver.nvml.machine import bundled_machines
from driver.nvml.session import NvmlSession, NvmlUnavailableError


@pytest.mark.parametrize("machine", bundled_machines())
def test_every_bundled_machine_discovers_complete_devices(machine):
    session = NvmlSession.open(f"mock:{machine}")
    gpus = discover_gpus(session)
    devices = node_inventory(gpus, SharingConfig(default=frozenset({"whole"}))).devices
    assert [d.name for d in devices] == [f"gpu-{i}" for i in range(len(gpus))]
    for device, gpu in zip(devices, gpus, strict=True):
        assert device.attributes["uuid"] == Attribute("string", gpu.uuid)
        assert device.attributes["type"] == Attribute("string", "gpu")
        assert device.attributes["migCapable"].value == (machine != "l4x4")
        assert device.capacity["memory"] == gpu.memory_bytes > 0
        assert device.capacity["multiprocessors"] == gpu.multiprocessors > 0
        assert len(device.attributes) + len(device.capacity) <= 32
    assert len({g.uuid for g in gpus}) == len(gpus)
    assert len({g.pci_bus_id for g in gpus}) == len(gpus)


def test_h100_attributes_are_versions_and_pci_ids():
    gpu = discover_gpus(NvmlSession.open("mock:dgx-h100"))[0]
    assert gpu.cuda_compute_capability == "9.0.0"
    assert gpu.driver_version == "580.95.5"
    assert gpu.cuda_driver_version == "13.0.0"
    assert gpu.pci_bus_id == "0000:18:00.0"
    assert gpu.architecture == "Hopper"


def test_version_conversions():
    assert semver("580.95.05") == "580.95.5"
    assert semver("550.54") == "550.54.0"
    assert cuda_version(12080) == "12.8.0"
    assert pci_bus_id("00000000:AB:00.0") == "0000:ab:00.0"


def test_unknown_nvml_spec_is_a_clear_error():
    with pytest.raises(NvmlUnavailableError, match="--nvml must be"):
        NvmlSession.open("fake")


def test_quantities_are_canonical():
    assert format_quantity(81559 * 2**20) == "81559Mi"
    assert format_quantity(80 * 2**30) == "80Gi"
    assert format_quantity(132) == "132"
    assert format_quantity(0) == "0"


def test_slices_split_within_the_device_limit_and_share_a_generation():
    devices = [PublishedDevice(name=f"d-{i}", capacity={"memory": 1}) for i in range(2 * MAX_DEVICES_PER_SLICE + 5)]
    owner = node_owner({"metadata": {"name": "n1", "uid": "u1"}})
    slices = build_slices("gpu.fgpu.dev", "n1", Inventory(devices, []), generation=4, owner=owner)
    assert [len(s["spec"]["devices"]) for s in slices] == [128, 128, 5]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {3}
    assert {s["spec"]["pool"]["generation"] for s in slices} == {4}
    assert len({s["metadata"]["name"] for s in slices}) == 3
    assert all(s["metadata"]["ownerReferences"] == [owner] for s in slices)
    names = [d["name"] for s in slices for d in s["spec"]["devices"]]
    assert names == [d.name for d in devices]


def test_discover_cli_is_deterministic():
    command = [sys.executable, "-m", "driver.cli", "discover", "--nvml", "mock:dgx-h100", "--node-name", "n1", "-o"]
    first = subprocess.run([*command, "json"], capture_output=True, text=True, check=True).stdout
    second = subprocess.run([*command, "json"], capture_output=True, text=True, check=True).stdout
    assert first == second
    document = json.loads(first)
    assert document["items"][0]["spec"]["nodeName"] == "n1"
    assert [len(s["spec"].get("devices", [])) for s in document["items"]] == [0, 64, 64, 64, 32]
    assert len(document["items"][0]["spec"]["sharedCounters"]) == 8
    yaml_out = subprocess.run([*command, "yaml"], capture_output=True, text=True, check=True).stdout
    assert "kind: ResourceSlice" in yaml_out


def test_discover_cli_reports_bad_machine():
    run = subprocess.run(
        [sys.executable, "-m", "driver.cli", "discover", "--nvml", "mock:nope", "--node-name", "n1"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2
    assert "unknown mock machine 'nope'" in run.stderr
