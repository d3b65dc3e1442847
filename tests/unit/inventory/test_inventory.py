from pathlib import Path

import pytest

from driver.inventory.discovery import discover_gpus
from driver.inventory.offers import node_inventory
from driver.inventory.sharing import ALL_KINDS, SharingConfig, SharingConfigError, load_sharing_config
from driver.inventory.slices import MAX_DEVICES_WITH_COUNTERS, build_slices
from driver.nvml.geometry import MEMORY_SLICES
from driver.nvml.session import NvmlSession


def inventory(machine: str = "dgx-h100", sharing: SharingConfig | None = None):
    return node_inventory(discover_gpus(NvmlSession.open(f"mock:{machine}")), sharing or SharingConfig())


def by_name(inv):
    return {d.name: d for d in inv.devices}


def test_every_gpu_offers_whole_mig_placements_and_shares():
    devices = by_name(inventory())
    assert len(devices) == 8 * (1 + 25 + 2)  # 25 MIG profile x placement pairs on A100/H100/H200/B200
    mig = devices["gpu-0-mig-1g10gb-3"]
    assert mig.attributes["profile"].value == "1g.10gb"
    assert mig.attributes["parentUUID"].value == devices["gpu-0"].attributes["uuid"].value
    assert (mig.attributes["placementStart"].value, mig.attributes["placementSize"].value) == (3, 1)
    assert mig.consumes == {"gpu-0-counters": {"memory-slice-3": 1}}
    assert devices["gpu-0-mig-3g40gb-4"].consumes == {"gpu-0-counters": {f"memory-slice-{k}": 1 for k in range(4, 8)}}
    assert devices["gpu-0-mig-1g10gbme-0"].consumes["gpu-0-counters"] == {"memory-slice-0": 1, "media-extensions": 1}
    everything = {f"memory-slice-{k}": 1 for k in range(MEMORY_SLICES)} | {"media-extensions": 1}
    for name in ("gpu-0", "gpu-0-mps", "gpu-0-ts", "gpu-0-mig-7g80gb-0"):
        assert devices[name].consumes == {"gpu-0-counters": everything}, name
    assert devices["gpu-0-mps"].allow_multiple_allocations
    assert devices["gpu-0-mps"].capacity["compute"] == 100
    assert devices["gpu-0-mps"].request_policies["memory"].step == 256 * 2**20
    assert not devices["gpu-0"].allow_multiple_allocations


def test_non_mig_gpu_has_a_single_counter_and_no_mig_devices():
    inv = inventory("l4x4")
    assert not [d for d in inv.devices if "-mig-" in d.name]
    assert inv.counter_sets[0].counters == {"gpu": 1}
    assert by_name(inv)["gpu-0-mps"].consumes == {"gpu-0-counters": {"gpu": 1}}


def test_per_gpu_offers(tmp_path: Path):
    config = tmp_path / "sharing.yaml"
    config.write_text("offer: [whole]\ngpus:\n- {index: 1, offer: [mig]}\n- {index: 2, offer: [mps, timeslice]}\n")
    names = set(by_name(inventory(sharing=load_sharing_config("whole,mig,mps,timeslice", config))))
    assert "gpu-0" in names and "gpu-0-mps" not in names
    assert "gpu-1" not in names and "gpu-1-mig-7g80gb-0" in names
    assert {"gpu-2-mps", "gpu-2-ts"} <= names and "gpu-2" not in names


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("offer: [wholes]\n", "unknown kind"),
        ("gpus: [{index: 0}]\n", r"gpus\[0\] must be"),
        ("extra: 1\n", "unknown field"),
    ],
)
def test_bad_sharing_config_is_a_clear_error(tmp_path: Path, text: str, message: str):
    config = tmp_path / "sharing.yaml"
    config.write_text(text)
    with pytest.raises(SharingConfigError, match=message):
        load_sharing_config(",".join(sorted(ALL_KINDS)), config)


def test_slices_keep_counters_apart_and_devices_within_64():
    slices = build_slices("gpu.fgpu.dev", "n1", inventory(), generation=1, owner=None)
    counters = [s for s in slices if "sharedCounters" in s["spec"]]
    devices = [s for s in slices if "devices" in s["spec"]]
    assert len(counters) == 1 and len(counters[0]["spec"]["sharedCounters"]) == 8
    assert all("devices" not in s["spec"] for s in counters)
    assert all(len(s["spec"]["devices"]) <= MAX_DEVICES_WITH_COUNTERS for s in devices)
    assert sum(len(s["spec"]["devices"]) for s in devices) == 8 * 28
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {len(slices)}
    for device in (d for s in devices for d in s["spec"]["devices"]):
        assert len(device.get("attributes", {})) + len(device.get("capacity", {})) <= 32
        assert len(device.get("consumesCounters", [])) <= 2


@pytest.mark.parametrize("machine", ["dgx-a100-40gb", "dgx-h100", "hgx-h200", "dgx-b200", "l4x4"])
def test_request_policies_are_valid_for_the_api(machine: str):
    for device in inventory(machine).devices:
        for name, policy in device.request_policies.items():
            top = policy.maximum if policy.maximum is not None else device.capacity[name]
            assert (top - policy.minimum) % policy.step == 0, (device.name, name)
            assert (device.capacity[name] - policy.minimum) % policy.step == 0, (device.name, name)
            assert policy.minimum <= policy.default <= top


def test_mig_share_profiles_from_the_flag_the_file_and_per_gpu(tmp_path: Path):
    config = tmp_path / "sharing.yaml"
    config.write_text(
        "migShareProfiles: [1g.10gb]\n"
        "gpus: [{index: 2, offer: [mig-mps, mig-timeslice], migShareProfiles: [3g.40gb, 7g.80gb]}]\n"
    )
    sharing = load_sharing_config("whole,mig-mps", config, mig_share_profiles="2g.20gb")
    assert sharing.mig_share_profiles == {"1g.10gb"}  # the file's top level wins over the flag
    assert sharing.shares_mig_profile(0, "1g.10gb") and not sharing.shares_mig_profile(0, "3g.40gb")
    assert sharing.shares_mig_profile(2, "7g.80gb") and not sharing.shares_mig_profile(2, "1g.10gb")
    names = set(by_name(inventory(sharing=sharing)))
    assert {
        "gpu-0-mig-1g10gb-6-mps",
        "gpu-2-mig-3g40gb-4-mps",
        "gpu-2-mig-3g40gb-4-ts",
        "gpu-2-mig-7g80gb-0-ts",
    } <= names
    assert "gpu-0-mig-1g10gb-6" not in names and "gpu-0-mig-1g10gb-6-ts" not in names  # not offered on GPU 0
    assert not any(n.startswith("gpu-2-mig-1g10gb") for n in names)
    every = load_sharing_config("mig-mps", None)
    assert every.mig_share_profiles is None and every.shares_mig_profile(5, "4g.40gb")
