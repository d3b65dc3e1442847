"""PodGroups (scheduling.k8s.io/v1beta1) with a gang policy: placed whole once minCount pods have
their claims, waiting for a PodGroup not there yet, completed or taken back after an
interruption; an API the cluster does not serve."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from driver.controller.ledger import FENCE_ANNOTATION
from driver.kube.errors import NotFoundError, RefusedError
from driver.kube.informer import Informer
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


def podgroup(name: str, min_count: int | None) -> dict[str, Any]:
    policy = {"basic": {}} if min_count is None else {"gang": {"minCount": min_count}}
    return {"metadata": {"name": name, "namespace": "ml"}, "spec": {"schedulingPolicy": policy}}


def group_member(api: InMemoryControllerApi, name: str, group: str, gpus: int, claim_made: bool = True) -> None:
    """A gated pod of the group whose claim comes from a template: the claim (owned by the pod) and,
    once made, named in the pod's status, as kube-controller-manager does."""
    pod = gated_pod(name, "")
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "two-gpus"}]
    pod["spec"]["schedulingGroup"] = {"podGroupName": group}
    pod = api.put("pods", pod)
    if not claim_made:
        return
    claim = opt_in_claim(f"{name}-gpu-x1", gpus)
    claim["metadata"]["ownerReferences"] = [{"kind": "Pod", "name": name, "uid": pod["metadata"]["uid"]}]
    api.put("claims", claim)
    pod["status"] = {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": f"{name}-gpu-x1"}]}
    api.put("pods", pod)


def group_cluster(slices: str, size: int, pods: int, gpus: int = 2) -> InMemoryControllerApi:
    api = fake_cluster(slices)
    api.put("podgroups", podgroup("train", size))
    for i in range(pods):
        group_member(api, f"p{i}", "train", gpus)
    return api


def member_claims(api: InMemoryControllerApi) -> dict[str, dict[str, Any]]:
    return {n: c for n, c in claims_in(api).items() if n.startswith("p")}


def test_a_podgroup_gang_is_placed_whole_or_not_at_all(h100_slices, replicas):
    api = group_cluster(h100_slices, 4, 4)
    api.put("claims", opt_in_claim("blocker", 2))  # 8 GPUs: 6 left, room for 3 members of 4
    controller = replicas(api)
    controller.run_pass()
    assert len(devices_of(claims_in(api)["blocker"])) == 2
    assert all(devices_of(c) == [] for c in member_claims(api).values())
    assert all(gates(api, f"p{i}") == ["gpu.fgpu.dev/allocation"] for i in range(4))
    failed = [e for e in api.events if e["reason"] == "FailedAllocation"]
    assert {e["involvedObject"]["kind"] for e in failed} == {"ResourceClaim", "Pod", "PodGroup"}
    assert len([e for e in failed if e["involvedObject"]["kind"] == "ResourceClaim"]) == 4
    (on_group,) = [e for e in failed if e["involvedObject"]["kind"] == "PodGroup"]
    assert on_group["message"].startswith("pod group ml/train (gang of 4 pods): gang cannot be placed whole")
    assert on_group["involvedObject"]["apiVersion"] == "scheduling.k8s.io/v1beta1"

    del api.store["claims"]["ml/blocker"]  # capacity frees
    sync(controller, "claims")
    controller.run_pass()
    assert all(len(devices_of(c)) == 2 for c in member_claims(api).values())
    assert all(gates(api, f"p{i}") == [] for i in range(4))
    assert_no_device_given_twice(api)


def test_a_podgroup_gang_waits_for_min_count_pods_with_their_claims_made(h100_slices, replicas):
    api = group_cluster(h100_slices, 4, 3)
    group_member(api, "p3", "train", 2, claim_made=False)  # its template's claim is not made yet
    controller = replicas(api)
    controller.run_pass()
    assert not api.status_writes  # nor is any member's claim placed alone
    waiting = [e for e in api.events if e["reason"] == "WaitingForGang"]
    assert waiting and all(e["message"].endswith("pod group ml/train waits for 1 more pod(s) of 4") for e in waiting)
    assert "PodGroup" in {e["involvedObject"]["kind"] for e in waiting}

    # The claim is made (owned by its pod) before the pod's status names it: still waiting.
    pod = api.get("pods", "ml/p3")
    claim = opt_in_claim("p3-gpu-x1", 2)
    claim["metadata"]["ownerReferences"] = [{"kind": "Pod", "name": "p3", "uid": pod["metadata"]["uid"]}]
    api.put("claims", claim)
    sync(controller)
    controller.run_pass()
    assert not api.status_writes

    pod["status"] = {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "p3-gpu-x1"}]}
    api.put("pods", pod)
    sync(controller)
    controller.run_pass()
    assert sorted(api.status_writes) == [f"p{i}-gpu-x1" for i in range(4)]
    assert all(gates(api, f"p{i}") == [] for i in range(4))


def test_pods_of_a_podgroup_not_yet_there_wait_and_a_basic_group_is_no_gang(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    group_member(api, "p0", "train", 2)  # no PodGroup train: kube-scheduler keeps its pods waiting too
    api.put("podgroups", podgroup("serve", None))
    group_member(api, "q0", "serve", 2)
    group_member(api, "q1", "serve", 99)  # cannot fit; its partner goes all the same
    controller = replicas(api)
    controller.run_pass()
    assert api.status_writes == ["q0-gpu-x1"]
    assert gates(api, "q0") == [] and gates(api, "p0") == ["gpu.fgpu.dev/allocation"]
    (waiting,) = [e for e in api.events if e["involvedObject"]["name"] == "p0-gpu-x1"]
    assert "no PodGroup ml/train" in waiting["message"]
    api.put("podgroups", podgroup("train", 1))
    sync(controller)
    controller.run_pass()
    assert sorted(api.status_writes) == ["p0-gpu-x1", "q0-gpu-x1"]
    assert gates(api, "p0") == []


def test_a_podgroup_gang_interrupted_is_completed_with_the_same_fencing(h100_slices, replicas):
    api = group_cluster(h100_slices, 3, 3)
    api.failing_status_writes = {3}  # two members written, the third write fails
    controller = replicas(api)
    controller.run_pass()
    assert sorted(len(devices_of(c)) for c in member_claims(api).values()) == [0, 2, 2]
    assert all(gates(api, f"p{i}") == ["gpu.fgpu.dev/allocation"] for i in range(3))
    (missing,) = [n for n, c in member_claims(api).items() if not devices_of(c)]
    controller.run_pass()
    assert all(len(devices_of(c)) == 2 for c in member_claims(api).values())
    assert api.status_writes[3:] == [missing]  # only the missing member was placed again
    kept = [c for n, c in member_claims(api).items() if n != missing]
    assert all(FENCE_ANNOTATION in c["metadata"]["annotations"] for c in kept)  # fenced before it
    assert all(gates(api, f"p{i}") == [] for i in range(3))
    assert_no_device_given_twice(api)


def test_a_podgroup_left_in_part_is_taken_back_unless_a_pod_was_let_go(h100_slices, replicas):
    for let_go in (False, True):
        api = group_cluster(h100_slices, 2, 2)
        written = api.get("claims", "ml/p0-gpu-x1")
        written["status"] = {"allocation": {"devices": {"results": []}}}
        api.put("claims", written)  # allocated earlier; its partner cannot fit
        partner = api.get("claims", "ml/p1-gpu-x1")
        partner["spec"]["devices"]["requests"][0]["exactly"]["count"] = 99
        api.put("claims", partner)
        if let_go:
            pod = api.get("pods", "ml/p0")
            api.put("pods", {**pod, "spec": {**pod["spec"], "schedulingGates": []}})
        replicas(api).run_pass()
        assert ("allocation" in claims_in(api)["p0-gpu-x1"]["status"]) is let_go


def test_a_claim_with_gang_labels_follows_them_and_its_pod_still_waits_for_its_group(h100_slices, replicas):
    api = group_cluster(h100_slices, 2, 1)
    api.put("claims", opt_in_claim("w0", 1, **{"gpu.fgpu.dev/gang": "g", "gpu.fgpu.dev/gang-size": "1"}))
    pod = gated_pod("w", "w0")
    pod["spec"]["schedulingGroup"] = {"podGroupName": "train"}
    api.put("pods", pod)  # the group's second pod; its claim is a labelled gang of 1
    controller = replicas(api)
    controller.run_pass()
    # w0 is written as a gang of its own by a writer thread while the pass goes on to the group:
    # the group is placed in this pass if the write was done by then, else in the next; either
    # way no pod of the group goes before the whole group is allocated.
    if api.status_writes == ["w0"]:
        assert gates(api, "w") == ["gpu.fgpu.dev/allocation"]
        controller.run_pass()
    assert api.status_writes == ["w0", "p0-gpu-x1"]
    assert gates(api, "w") == gates(api, "p0") == []  # released together: the group is whole


class Absent(InMemoryControllerApi):
    """An API server that does not serve (or let us read) what is listed."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def list_pages(self, kind: str, *args: Any, **kwargs: Any) -> Iterator[tuple[list[Any], str]]:
        raise self.error


def test_an_api_the_cluster_does_not_serve_is_synced_as_empty():
    for error in (NotFoundError("the server could not find the requested resource"), RefusedError("forbidden", 403)):
        informer = Informer(Absent(error), "podgroups", threading.Event(), optional=True)
        informer.start()
        try:
            assert informer.synced.wait(5) and informer.items() == [] and informer.absent == str(error)
        finally:
            informer.stop()


# --- making room: evicting movable and lower-priority pods, reservations ---------------------
