"""Workload operators' gangs (driver/scheduling/framework_gangs.py) placed by the controller as a
PodGroup's (groups.py): pods with the labels JobSet, LeaderWorkerSet and KubeRay put on theirs,
each taking an opt-in claim from a template. A gang that cannot fit holds nothing and keeps every
gate; no gate is lifted before every member is placed; with room, all go at once."""

from __future__ import annotations

from typing import Any

import pytest

from driver.controller.victims import candidates
from testbed.controller_api import InMemoryControllerApi
from tests.support.controller_cluster import (
    assert_no_device_given_twice,
    claims_in,
    devices_of,
    fake_cluster,
    gated_pod,
    gates,
    opt_in_claim,
    sync,
)

GATED = ["gpu.fgpu.dev/allocation"]


def jobset(i: int) -> tuple[dict[str, str], dict[str, str]]:
    labels = {"jobset.sigs.k8s.io/jobset-name": "train", "jobset.sigs.k8s.io/global-replicas": "4",
              "jobset.sigs.k8s.io/job-index": str(i), "jobset.sigs.k8s.io/restart-attempt": "0"}  # fmt: skip
    return labels, {}


def trainjob(i: int) -> tuple[dict[str, str], dict[str, str]]:
    """A TrainJob's nodes: one Job of 4 pods, its size from the runtime template's label."""
    labels, _ = jobset(0)
    return {**labels, "jobset.sigs.k8s.io/global-replicas": "1", "gpu.fgpu.dev/gang-size": "4"}, {}


def lws(i: int) -> tuple[dict[str, str], dict[str, str]]:
    labels = {"leaderworkerset.sigs.k8s.io/name": "serve", "leaderworkerset.sigs.k8s.io/group-index": "0",
              "leaderworkerset.sigs.k8s.io/group-key": "abc123",
              "leaderworkerset.sigs.k8s.io/worker-index": str(i)}  # fmt: skip
    return labels, {"leaderworkerset.sigs.k8s.io/size": "4"}


def ray(i: int) -> tuple[dict[str, str], dict[str, str]]:
    kind = "head" if i == 0 else "worker"
    return {"ray.io/cluster": "rc", "ray.io/node-type": kind, "gpu.fgpu.dev/gang-size": "4"}, {}


FRAMEWORKS = {"jobset": (jobset, "jobset:train"), "trainjob": (trainjob, "jobset:train"),
              "lws": (lws, "lws:serve/0"), "ray": (ray, "ray:rc")}  # fmt: skip


def member(api: InMemoryControllerApi, name: str, meta: tuple[dict[str, str], dict[str, str]], gpus: int) -> None:
    """A gated pod of an operator with its claim made from a template and named in its status."""
    pod = gated_pod(name, "")
    pod["metadata"]["labels"], pod["metadata"]["annotations"] = meta
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "two-gpus"}]
    pod = api.put("pods", pod)
    claim = opt_in_claim(f"{name}-gpu-x1", gpus)
    claim["metadata"]["ownerReferences"] = [{"kind": "Pod", "name": name, "uid": pod["metadata"]["uid"]}]
    api.put("claims", claim)
    pod["status"] = {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": f"{name}-gpu-x1"}]}
    api.put("pods", pod)


def claim_events(api: InMemoryControllerApi, reason: str) -> dict[str, str]:
    """Claim name -> the message of its last Event of this reason."""
    return {
        e["involvedObject"]["name"]: e["message"]
        for e in api.events
        if e["reason"] == reason and e["involvedObject"]["kind"] == "ResourceClaim"
    }


def members(api: InMemoryControllerApi) -> dict[str, dict[str, Any]]:
    return {n: c for n, c in claims_in(api).items() if n.startswith("p")}


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_an_operators_gang_that_cannot_fit_holds_nothing_then_goes_whole(framework, h100_slices, replicas):
    labels_of, gang = FRAMEWORKS[framework]
    api = fake_cluster(h100_slices)
    api.put("claims", opt_in_claim("blocker", 2))  # 8 GPUs: 6 left, room for 3 members of 4
    for i in range(4):
        member(api, f"p{i}", labels_of(i), 2)
    controller = replicas(api)
    controller.run_pass()
    assert all(devices_of(c) == [] for c in members(api).values())
    assert all(gates(api, f"p{i}") == GATED for i in range(4))
    on_claims = claim_events(api, "FailedAllocation")
    assert sorted(on_claims) == [f"p{i}-gpu-x1" for i in range(4)]
    unplaced = f"pod group ml/{gang} (gang of 4 pods): gang cannot be placed whole"
    assert all(m.startswith(unplaced) for m in on_claims.values())

    del api.store["claims"]["ml/blocker"]  # capacity frees
    sync(controller, "claims")
    controller.run_pass()
    assert all(len(devices_of(c)) == 2 for c in members(api).values())
    assert all(gates(api, f"p{i}") == [] for i in range(4))
    assert_no_device_given_twice(api)


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_no_gate_is_lifted_before_every_member_is_there_and_placed(framework, h100_slices, replicas):
    labels_of, gang = FRAMEWORKS[framework]
    api = fake_cluster(h100_slices)
    for i in range(3):  # the operator has made 3 of its 4 pods so far
        member(api, f"p{i}", labels_of(i), 1)
    controller = replicas(api)
    controller.run_pass()
    assert not api.status_writes
    assert all(gates(api, f"p{i}") == GATED for i in range(3))
    waiting = list(claim_events(api, "WaitingForGang").values())
    assert waiting and all(m.endswith(f"pod group ml/{gang} waits for 1 more pod(s) of 4") for m in waiting)

    member(api, "p3", labels_of(3), 1)
    sync(controller)
    controller.run_pass()
    assert sorted(api.status_writes) == [f"p{i}-gpu-x1" for i in range(4)]
    assert all(gates(api, f"p{i}") == [] for i in range(4))


def test_an_unreadable_size_places_nothing(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    for i in range(2):
        labels, _ = lws(i)
        member(api, f"p{i}", (labels, {"leaderworkerset.sigs.k8s.io/size": "two"}), 1)
    controller = replicas(api)
    controller.run_pass()
    assert not api.status_writes and gates(api, "p0") == GATED
    assert any("gang size is not a whole number" in e["message"] for e in api.events)


def test_ray_pods_without_a_gang_size_are_placed_one_by_one(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    member(api, "p0", ({"ray.io/cluster": "rc"}, {}), 2)
    member(api, "p1", ({"ray.io/cluster": "rc"}, {}), 99)  # fits nowhere; its partner goes all the same
    controller = replicas(api)
    controller.run_pass()
    assert api.status_writes == ["p0-gpu-x1"] and gates(api, "p0") == []


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_making_room_never_takes_a_gang_member_alone(framework):
    """A movable pod of a running gang is not a candidate to make room (victims.py): moving it alone
    would split its gang; a movable pod in no gang is."""
    labels_of, _ = FRAMEWORKS[framework]

    def running(name: str, meta: tuple[dict[str, str], dict[str, str]]) -> tuple[dict[str, Any], dict[str, Any]]:
        labels, annotations = meta
        annotations = {**annotations, "gpu.fgpu.dev/movable": "true"}
        owner = [{"kind": "ReplicaSet", "name": "x", "uid": "u", "controller": True}]
        pod = {"metadata": {"name": name, "namespace": "ml", "uid": name, "labels": labels,
                            "annotations": annotations, "ownerReferences": owner},
               "spec": {"nodeName": "n1"}, "status": {"phase": "Running"}}  # fmt: skip
        claim = opt_in_claim(f"{name}-gpu", 1)
        claim["metadata"]["uid"] = f"{name}-gpu"
        request = {"request": "r", "driver": "gpu.fgpu.dev", "pool": "n1", "device": "gpu-0"}
        node = {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]}
        claim["status"] = {"allocation": {"devices": {"results": [request]}, "nodeSelector": node}}
        return pod, claim

    member, member_claim = running("member", labels_of(1))
    loner, loner_claim = running("loner", ({}, {}))
    pods_of = {"ml/member-gpu": [member], "ml/loner-gpu": [loner]}
    found = candidates([member_claim, loner_claim], pods_of, pending_priority=0, preempt=False)
    assert [c.holder.claim.name for c in found] == ["loner-gpu"]
