"""Prepare-time exclusivity (issue 38, findings 7 and 8): a device another claim holds is refused
at prepare with one line for the claim's owner, unprepare never destroys what another claim holds,
and a GPU's time-slice interval comes from the device class only and goes back to Default after
its last time-sliced claim, also after a crash."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from driver.claims.refs import ClaimRef
from driver.node.recovery import recover
from testbed.fakes import InMemoryKubeApi, allocated_claim, result
from testbed.node_env import NodeEnv

MIG = "gpu-2-mig-1g10gb-1"


def claim(api: InMemoryKubeApi, name: str, *results: dict[str, Any], config: list | None = None) -> ClaimRef:
    api.claims[("default", name)] = allocated_claim("default", name, f"uid-{name}", list(results), config)
    return ClaimRef("default", name, f"uid-{name}")


def share(device: str, name: str) -> dict[str, Any]:
    return {**result(device), "shareID": f"share-{name}", "consumedCapacity": {"memory": "4Gi"}}


def interval(value: str, source: str) -> dict[str, Any]:
    sharing = {"strategy": "TimeSlicing", "timeSlicing": {"interval": value}}
    parameters = {"apiVersion": "gpu.fgpu.dev/v1alpha1", "kind": "ShareConfig", "sharing": sharing}
    return {"source": source, "requests": [], "opaque": {"driver": "gpu.fgpu.dev", "parameters": parameters}}


def timeslice(tmp_path: Path, env: NodeEnv, index: int) -> int:
    """The GPU's interval as the fake nvidia-smi keeps it (NVML cannot read it back)."""
    path = tmp_path / "fake-smi.json"
    state = json.loads(path.read_text()) if path.exists() else {}
    return state.get(env.gpus[index].uuid, {}).get("timeslice", 0)


def test_a_mig_device_allocated_twice_is_refused_and_the_holders_instance_survives(node):
    api, env = node
    first, second = claim(api, "a", result(MIG)), claim(api, "b", result(MIG))
    assert env.preparer.prepare([first])[first.uid].error == ""
    [instance] = env.session.gpu_instances(2)

    error = env.preparer.prepare([second])[second.uid].error
    assert error.startswith(f"claim {second}: device {MIG} is held by another claim on this node")
    assert "\n" not in error and "uid-a" not in error  # one line, naming no other tenant's claim
    assert set(env.claims.all()) == {first.uid} and not env.cdi.spec_path(second.uid).exists()
    assert env.preparer.unprepare([second]) == {second.uid: ""}  # kubelet's cleanup of the failed claim
    assert env.session.gpu_instances(2) == [instance]

    assert env.preparer.unprepare([first]) == {first.uid: ""} and env.session.gpu_instances(2) == []
    assert env.preparer.prepare([second])[second.uid].error == ""  # kubelet's retry, once it is free


def test_a_claim_still_being_prepared_holds_its_devices(node, monkeypatch):
    """A whole GPU is recorded only once prepared: meanwhile the claim being prepared holds it."""
    api, env = node
    first, second = claim(api, "a", result("gpu-0")), claim(api, "b", result("gpu-0"))
    write = env.cdi.write
    meanwhile: dict[str, str] = {}

    def write_then_race(uid: str, devices) -> None:
        if uid == first.uid:  # the first claim made its devices and is not recorded yet
            meanwhile["error"] = env.preparer.prepare([second])[second.uid].error
        write(uid, devices)

    monkeypatch.setattr(env.cdi, "write", write_then_race)
    assert env.preparer.prepare([first])[first.uid].error == ""
    assert "device gpu-0 is held by another claim" in meanwhile["error"]
    assert set(env.claims.all()) == {first.uid}

    refs = [claim(api, name, result(MIG)) for name in ("c", "d", "e")]  # one batch, in parallel
    errors = sorted(outcome.error for outcome in env.preparer.prepare(refs).values())
    assert errors[0] == "" and all("is held by another claim" in e for e in errors[1:])


@pytest.mark.parametrize(
    ("held", "wanted", "said"),
    [
        (result("gpu-0"), result("gpu-0"), "device gpu-0 is held"),
        (result("gpu-0"), share("gpu-0-mps", "b"), "device gpu-0-mps overlaps gpu-0, which is held"),
        (result("gpu-2-mig-3g40gb-4"), result("gpu-2-mig-1g10gb-5"), "overlaps gpu-2-mig-3g40gb-4, which is held"),
        (share("gpu-4-ts", "a"), share("gpu-4-mps", "b"), "overlaps gpu-4-ts, which is held"),
    ],
)
def test_what_overlaps_a_held_device_is_refused(node, held, wanted, said):
    api, env = node
    first, second = claim(api, "a", held), claim(api, "b", wanted)
    assert env.preparer.prepare([first])[first.uid].error == ""
    assert said in env.preparer.prepare([second])[second.uid].error
    assert set(env.claims.all()) == {first.uid}


def test_shares_admin_access_and_other_placements_are_not_refused(node):
    api, env = node
    monitor = {**result("gpu-0"), "adminAccess": True}
    refs = [
        claim(api, "whole", result("gpu-0")),
        claim(api, "monitor", monitor),  # holds nothing
        claim(api, "mps-a", share("gpu-1-mps", "a")),
        claim(api, "mps-b", share("gpu-1-mps", "b")),  # shares of one device
        claim(api, "mig-a", result("gpu-2-mig-1g10gb-0")),
        claim(api, "mig-b", result("gpu-2-mig-1g10gb-1")),  # the next placement
    ]
    assert [outcome.error for outcome in env.preparer.prepare(refs).values()] == [""] * len(refs)


def test_unprepare_keeps_a_mig_instance_another_claim_holds(node):
    """Two records of one MIG device, as a plugin before prepare-time exclusivity left them."""
    api, env = node
    first = claim(api, "a", result(MIG))
    assert env.preparer.prepare([first])[first.uid].error == ""
    record = env.claims.get(first.uid)
    assert record is not None
    env.claims.commit(prepared=[replace(record, uid="uid-b", name="b")])
    [instance] = env.session.gpu_instances(2)

    assert env.preparer.unprepare([ClaimRef("default", "b", "uid-b")]) == {"uid-b": ""}
    assert env.session.gpu_instances(2) == [instance]
    assert env.preparer.unprepare([first]) == {first.uid: ""} and env.session.gpu_instances(2) == []


def test_a_claims_own_config_cannot_change_the_gpus_interval(node, tmp_path: Path):
    api, env = node
    own = claim(api, "own", share("gpu-3-ts", "own"), config=[interval("Long", "FromClaim")])
    error = env.preparer.prepare([own])[own.uid].error
    assert "sharing.timeSlicing.interval Long differs from the device class's Default" in error
    assert env.claims.all() == {} and timeslice(tmp_path, env, 3) == 0

    # Repeating the class's interval is fine.
    same = claim(
        api, "same", share("gpu-3-ts", "same"), config=[interval("Long", "FromClass"), interval("Long", "FromClaim")]
    )
    assert env.preparer.prepare([same])[same.uid].error == "" and timeslice(tmp_path, env, 3) == 3


def test_time_sliced_shares_of_a_gpu_keep_the_first_ones_interval_until_the_last_goes(node, tmp_path: Path):
    """Two device classes of the same devices with different intervals: the last writer no longer wins."""
    api, env = node
    short = claim(api, "short", share("gpu-3-ts", "short"), config=[interval("Short", "FromClass")])
    long = claim(api, "long", share("gpu-3-ts", "long"), config=[interval("Long", "FromClass")])
    assert env.preparer.prepare([short])[short.uid].error == "" and timeslice(tmp_path, env, 3) == 1

    error = env.preparer.prepare([long])[long.uid].error
    assert "device gpu-3-ts is time-sliced at Short by the claims that hold it" in error
    assert "asks for Long" in error and timeslice(tmp_path, env, 3) == 1
    assert env.preparer.unprepare([long]) == {long.uid: ""} and timeslice(tmp_path, env, 3) == 1

    assert env.preparer.unprepare([short]) == {short.uid: ""} and timeslice(tmp_path, env, 3) == 0  # Default
    assert env.preparer.prepare([long])[long.uid].error == "" and timeslice(tmp_path, env, 3) == 3


@pytest.mark.parametrize("state", ["PrepareStarted", "UnprepareStarted"])
def test_a_crash_mid_claim_leaves_the_interval_back_at_default(node, tmp_path: Path, state):
    """The journal covers the interval: start-up recovery undoes the claim and resets it."""
    api, env = node
    ref = claim(api, "long", share("gpu-3-ts", "long"), config=[interval("Long", "FromClass")])
    assert env.preparer.prepare([ref])[ref.uid].error == "" and timeslice(tmp_path, env, 3) == 3
    record = env.claims.get(ref.uid)
    assert record is not None
    env.claims.commit(prepared=[replace(record, state=state, owner="a-plugin-that-died")])
    recover(env.preparer)
    assert env.claims.all() == {} and timeslice(tmp_path, env, 3) == 0
