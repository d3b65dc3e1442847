"""MIG, MPS and time-sliced shares prepared by the driver over mock NVML and the fake tools."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from testbed.fakes import InMemoryKubeApi, result
from testbed.node_env import build_node, fake_tools_env
from tests.support.shares import CONFIG, claim, opaque, share, spec


def test_mig_placements_are_created_and_destroyed(node):
    api, env = node
    ref = claim(api, "mig", [result("gpu-2-mig-3g40gb-4", request="a"), result("gpu-2-mig-1g10gb-1", request="b")])
    outcome = env.preparer.prepare([ref])[ref.uid]
    assert outcome.error == ""
    instances = {(r.profile_id, r.start): r for r in env.session.gpu_instances(2)}
    assert set(instances) == {(9, 4), (19, 1)}
    prepared = {d.device: d for d in outcome.devices}
    assert prepared["gpu-2-mig-3g40gb-4"].mig_uuid == instances[(9, 4)].compute_instances[0][1]
    nodes = {d["name"]: [n["path"] for n in d["containerEdits"]["deviceNodes"]] for d in spec(env, ref.uid)["devices"]}
    big = nodes["uid-mig-gpu-2-mig-3g40gb-4"]
    assert big[0] == "/dev/nvidia2" and all(p.startswith("/dev/nvidia-caps/nvidia-cap") for p in big[1:])
    assert len(set(big[1:]) | set(nodes["uid-mig-gpu-2-mig-1g10gb-1"][1:])) == 4  # distinct capabilities
    assert env.preparer.unprepare([ref]) == {ref.uid: ""}
    assert env.session.gpu_instances(2) == []


def test_mig_on_an_a100_with_mig_off_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for key, value in fake_tools_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    api = InMemoryKubeApi()
    env = build_node(tmp_path, api, machine="dgx-a100-40gb")
    ref = claim(api, "mig", [result("gpu-0-mig-1g5gb-0")])
    error = env.preparer.prepare([ref])[ref.uid].error
    assert "needs a GPU reset" in error and "uid-mig" in error
    assert env.session.nvml.nvmlDeviceGetMigMode(env.session.handle(0)) == [0, 0]  # nothing left pending
    assert env.claims.all() == {}


def test_time_slicing_interval_follows_the_shares(node, tmp_path: Path):
    api, env = node
    config = [
        opaque(
            {
                "apiVersion": CONFIG,
                "kind": "ShareConfig",
                "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}},
            },
            source="FromClass",
        )
    ]
    ref = claim(api, "ts", [share("gpu-3-ts", memory="4Gi")], config=config)
    assert env.preparer.prepare([ref])[ref.uid].error == ""
    state = json.loads((tmp_path / "fake-smi.json").read_text())
    assert state[env.gpus[3].uuid]["timeslice"] == 3
    env.preparer.unprepare([ref])
    assert json.loads((tmp_path / "fake-smi.json").read_text())[env.gpus[3].uuid]["timeslice"] == 0


@pytest.mark.parametrize(
    ("parameters", "reason"),
    [
        (
            {"apiVersion": CONFIG, "kind": "ShareConfig", "sharing": {"strategy": "MPS", "mps": {"threads": 5}}},
            "unknown field sharing.mps.threads",
        ),
        (
            {
                "apiVersion": CONFIG,
                "kind": "ShareConfig",
                "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 150}},
            },
            "activeThreadPercentage must be 1..100",
        ),
        (
            {
                "apiVersion": CONFIG,
                "kind": "ShareConfig",
                "sharing": {"strategy": "MPS", "mps": {"pinnedMemoryLimit": "64Gi"}},
            },
            "exceeds the allocated memory",
        ),
        ({"apiVersion": "gpu.fgpu.dev/v9", "kind": "ShareConfig"}, "apiVersion must be"),
        ({"apiVersion": CONFIG, "kind": "ShareConfig", "sharing": {"strategy": "TimeSlicing"}}, "asks for TimeSlicing"),
    ],
)
def test_bad_config_is_a_per_claim_error_naming_the_field(node, parameters, reason):
    api, env = node
    ref = claim(api, "bad", [share("gpu-4-mps", memory="8Gi", compute="20")], config=[opaque(parameters)])
    error = env.preparer.prepare([ref])[ref.uid].error
    assert reason in error and "uid-bad" in error
    assert env.claims.all() == {}
    assert not env.mps.running(env.gpus[4].uuid)


def test_claims_on_different_gpus_run_in_parallel_and_one_gpu_is_serialised(node, monkeypatch):
    api, env = node
    create = env.session.create_mig_instance
    both_gpus_inside = threading.Barrier(2, timeout=10)
    inside: dict[int, int] = {}
    overlaps: list[int] = []
    guard = threading.Lock()

    def observed_create(index: int, *args):
        with guard:
            inside[index] = inside.get(index, 0) + 1
            if inside[index] > 1:
                overlaps.append(index)
        try:
            if index in (0, 1):
                both_gpus_inside.wait()  # breaks (error) unless GPU 0 and GPU 1 are worked on at once
            time.sleep(0.05)
            return create(index, *args)
        finally:
            with guard:
                inside[index] -= 1

    monkeypatch.setattr(env.session, "create_mig_instance", observed_create)
    refs = [
        claim(api, "on-gpu-0", [result("gpu-0-mig-1g10gb-0")]),
        claim(api, "on-gpu-1", [result("gpu-1-mig-1g10gb-0")]),
        claim(api, "on-gpu-2-a", [result("gpu-2-mig-1g10gb-0")]),
        claim(api, "on-gpu-2-b", [result("gpu-2-mig-1g10gb-1")]),
    ]
    results = env.preparer.prepare(refs)
    assert [r.error for r in results.values()] == [""] * 4
    assert overlaps == []  # two claims on GPU 2 never changed it at the same time


def test_time_sliced_shares_inside_a_mig_partition(node):
    api, env = node
    device = "gpu-2-mig-3g40gb-0-ts"
    first = claim(api, "a", [share(device, memory="4Gi")])
    second = claim(api, "b", [share(device, memory="8Gi")])
    assert env.preparer.prepare([first, second]) == {
        first.uid: env.preparer.prepare([first])[first.uid],
        second.uid: env.preparer.prepare([second])[second.uid],
    }
    [instance] = env.session.gpu_instances(2)
    nodes = {
        tuple(n["path"] for n in spec(env, r.uid)["devices"][0]["containerEdits"]["deviceNodes"])
        for r in (first, second)
    }
    assert len(nodes) == 1  # both containers get the same MIG device
    assert env.preparer.unprepare([first]) == {first.uid: ""} and env.session.gpu_instances(2) == [instance]
    assert env.preparer.unprepare([second]) == {second.uid: ""} and env.session.gpu_instances(2) == []
    interval = opaque(
        {
            "apiVersion": CONFIG,
            "kind": "ShareConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}},
        },
        source="FromClass",  # a class of mig-timeslice devices that sets one
    )
    ref = claim(api, "long", [share(device, memory="4Gi")], config=[interval])
    error = env.preparer.prepare([ref])[ref.uid].error
    assert "interval cannot be set (it is the GPU's)" in error and env.session.gpu_instances(2) == []
