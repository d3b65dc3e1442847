"""Scheduling gates: lifted as soon as a unit is written, and only once a gang is whole."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from driver.kube.errors import KubeUnavailableError
from tests.support.controller_cluster import (
    claims_in,
    fake_cluster,
    gated_pod,
    gates,
    opt_in_claim,
)


def test_gang_pods_wait_for_the_whole_gang(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    gang = {"gpu.fgpu.dev/gang": "g", "gpu.fgpu.dev/gang-size": "2"}
    first = opt_in_claim("w0", 2, **gang)
    first["status"] = {"allocation": {"devices": {"results": []}}}  # allocated earlier, its partner is not
    api.put("claims", first)
    api.put("claims", opt_in_claim("w1", 99, **gang))  # w1 cannot fit
    api.put("pods", gated_pod("p0", "w0"))
    replicas(api).run_pass()
    assert gates(api, "p0") == ["gpu.fgpu.dev/allocation"]  # w0 is allocated, its gang is not whole
    assert api.status_writes == ["w0"]  # and w0 was taken back
    assert "allocation" not in claims_in(api)["w0"]["status"]


def test_pods_go_as_soon_as_their_unit_is_written(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    for name in ("a", "b"):
        api.put("claims", opt_in_claim(name, 1))
        api.put("pods", gated_pod(f"pod-{name}", name))
    api.failing_status_writes = {2}  # b's write fails: the pass ends early, a's pod went already
    replicas(api).run_pass()
    assert gates(api, "pod-a") == []
    assert gates(api, "pod-b") == ["gpu.fgpu.dev/allocation"]


KUEUE_GATE = {"name": "kueue.x-k8s.io/admission"}


def held_by_kueue(pod: dict) -> dict:
    pod["spec"]["schedulingGates"].append(dict(KUEUE_GATE))
    return pod


def test_a_claim_whose_pod_another_gate_holds_waits_for_that_gate(h100_slices, replicas):
    # Kueue holds the pod until its workload is admitted (by quota): devices allocated now would
    # be held outside the quota for a pod kube-scheduler will not bind. Once Kueue lifts its gate,
    # the next pass allocates and lifts fgpu's.
    api = fake_cluster(h100_slices)
    api.put("claims", opt_in_claim("a", 4))
    api.put("pods", held_by_kueue(gated_pod("pod-a", "a")))
    controller = replicas(api)
    controller.run_pass()
    assert api.status_writes == [] and "allocation" not in (claims_in(api)["a"].get("status") or {})
    assert gates(api, "pod-a") == ["gpu.fgpu.dev/allocation", "kueue.x-k8s.io/admission"]
    admitted = api.store["pods"]["ml/pod-a"]
    admitted["spec"]["schedulingGates"] = [g for g in admitted["spec"]["schedulingGates"] if g != KUEUE_GATE]
    api.put("pods", admitted)
    controller.informers["pods"].relist()
    controller.run_pass()
    assert api.status_writes == ["a"] and gates(api, "pod-a") == []


def test_a_claim_made_from_a_held_pods_template_waits_too(h100_slices, replicas):
    # A claim from a template names no pod; the pod that owns it does.
    api = fake_cluster(h100_slices)
    claim = opt_in_claim("pod-a-gpu", 1)
    claim["metadata"]["ownerReferences"] = [{"kind": "Pod", "name": "pod-a", "uid": "uid-pod-a"}]
    api.put("claims", claim)
    pod = held_by_kueue(gated_pod("pod-a", "pod-a-gpu"))
    pod["metadata"]["uid"] = "uid-pod-a"
    del pod["spec"]["resourceClaims"][0]["resourceClaimName"]  # its status does not name it yet
    pod["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] = "gpu"
    api.put("pods", pod)
    replicas(api).run_pass()
    assert api.status_writes == []


def test_lifting_fgpus_gate_leaves_the_others(h100_slices, replicas):
    # A pod whose claim was allocated before another gate came into play (or by another replica):
    # fgpu lifts its own gate only; kube-scheduler still waits for the other.
    api = fake_cluster(h100_slices)
    controller = replicas(api)
    api.put("claims", opt_in_claim("b", 1))
    api.put("pods", held_by_kueue(gated_pod("pod-b", "b")))
    controller.informers["pods"].relist()
    claim = claims_in(api)["b"]
    claim["status"] = {"allocation": {"devices": {"results": []}}}  # allocated earlier
    api.put("claims", claim)
    controller.informers["claims"].relist()
    controller.gates.lift_all()
    assert gates(api, "pod-b") == ["kueue.x-k8s.io/admission"]


def template_claim_and_pod(name: str, count: int) -> tuple[dict, dict]:
    """A claim kube-controller-manager made from the pod's template: owned by it, named in its status."""
    claim = opt_in_claim(f"{name}-gpu", count)
    claim["metadata"]["ownerReferences"] = [{"kind": "Pod", "name": name, "uid": f"uid-{name}", "controller": True}]
    pod = gated_pod(name, f"{name}-gpu")
    pod["metadata"]["uid"] = f"uid-{name}"
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "gpu"}]
    pod["status"] = {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": f"{name}-gpu"}]}
    return claim, pod


def test_a_template_claims_pod_goes_as_soon_as_the_claim_is_written(h100_slices, replicas):
    # The pod is found from the claim's owner, not from the index of every gated pod; b's write
    # fails, so the pass ends before it lifts the gates of every pod whose claims are allocated.
    api = fake_cluster(h100_slices)
    for name in ("a", "b"):
        claim, pod = template_claim_and_pod(name, 1)
        api.put("claims", claim)
        api.put("pods", pod)
    api.failing_status_writes = {2}
    replicas(api).run_pass()
    assert gates(api, "a") == []
    assert gates(api, "b") == ["gpu.fgpu.dev/allocation"]


def test_a_template_claim_whose_pod_is_not_there_is_not_placed(h100_slices, replicas):
    # kube-controller-manager takes the allocation back when the pod goes, then deletes the claim:
    # placed again, it would hold devices for nothing and its write would fail once it is gone.
    api = fake_cluster(h100_slices)
    claim, pod = template_claim_and_pod("a", 1)
    api.put("claims", claim)
    controller = replicas(api)
    controller.run_pass()  # its pod gone (or not seen yet)
    going = {**pod, "metadata": {**pod["metadata"], "deletionTimestamp": "2026-12-07T05:00:00Z"}}
    api.put("pods", going)
    controller.informers["pods"].relist()
    controller.run_pass()  # its pod being deleted
    api.put("pods", {**pod, "metadata": {**pod["metadata"], "uid": "uid-another-a"}})
    controller.informers["pods"].relist()
    controller.run_pass()  # a new pod of the same name: not its owner
    assert api.status_writes == []
    api.put("pods", pod)
    controller.informers["pods"].relist()
    controller.run_pass()
    assert api.status_writes == ["a-gpu"] and gates(api, "a") == []


def _allocated_on(name: str, node: str | None) -> dict:
    claim = opt_in_claim(name, 1)
    by_name = {"key": "metadata.name", "operator": "In", "values": [node]}
    selector = {"nodeSelector": {"nodeSelectorTerms": [{"matchFields": [by_name]}]}} if node else {}
    claim["status"] = {"allocation": {"devices": {"results": []}, **selector}}  # written by an earlier pass
    return claim


def _raising(error: Exception) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        raise error

    return call


def test_a_lift_that_fails_unexpectedly_is_logged_and_tried_again(h100_slices, replicas, caplog):
    # The lifts of a pass run on the writers: an error that is not the API's refusal must not
    # vanish with its future, leaving the pod gated and nothing said.
    api = fake_cluster(h100_slices)
    api.put("claims", _allocated_on("a", None))
    api.put("pods", gated_pod("pod-a", "a"))
    controller = replicas(api)
    api.set_scheduling_gates = _raising(ValueError("truncated response"))
    controller.run_pass()
    failed = [r for r in caplog.records if r.levelname == "ERROR" and "ml/pod-a" in r.getMessage()]
    assert failed and "truncated response" in str(failed[0].exc_info[1])
    del api.set_scheduling_gates  # the fake API's own again
    controller.run_pass()
    assert gates(api, "pod-a") == []


def test_a_pod_is_nominated_to_its_claims_node_before_its_gate_goes(h100_slices, replicas):
    # kube-scheduler reads no node out of an allocation: unhinted, it filters every node of the
    # cluster to find the one the allocation admits; a nominated node it tries first.
    api = fake_cluster(h100_slices, nodes=2)
    api.put("claims", opt_in_claim("a", 1))
    api.put("pods", gated_pod("pod-a", "a"))
    replicas(api).run_pass()
    node = claims_in(api)["a"]["status"]["allocation"]["devices"]["results"][0]["pool"]
    assert api.nominated == [("pod-a", node)]
    pod = api.store["pods"]["ml/pod-a"]
    assert pod["status"]["nominatedNodeName"] == node and gates(api, "pod-a") == []


def test_a_pod_is_not_nominated_where_its_claims_name_no_one_node_or_it_is_already(h100_slices, replicas):
    api = fake_cluster(h100_slices, nodes=2)
    api.put("claims", _allocated_on("anywhere", None))  # devices reachable from any node
    api.put("pods", gated_pod("pod-anywhere", "anywhere"))
    api.put("claims", _allocated_on("on-n1", "n1"))
    api.put("claims", _allocated_on("on-n2", "n2"))
    split = gated_pod("pod-split", "on-n1")  # claims on two nodes: it fits nowhere, kube-scheduler says so
    split["spec"]["resourceClaims"].append({"name": "gpu2", "resourceClaimName": "on-n2"})
    api.put("pods", split)
    api.put("claims", _allocated_on("on-n1-again", "n1"))
    nominated = gated_pod("pod-nominated", "on-n1-again")
    nominated["status"] = {"nominatedNodeName": "n1"}
    api.put("pods", nominated)
    replicas(api).run_pass()
    assert api.nominated == []
    assert [gates(api, p) for p in ("pod-anywhere", "pod-split", "pod-nominated")] == [[], [], []]


def test_a_nomination_refused_leaves_the_pod_gated_for_the_next_pass(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    api.put("claims", _allocated_on("a", "n1"))
    api.put("pods", gated_pod("pod-a", "a"))
    controller = replicas(api)
    api.nominate_node = _raising(KubeUnavailableError("API server unreachable"))
    controller.run_pass()
    assert gates(api, "pod-a") == ["gpu.fgpu.dev/allocation"]
    del api.nominate_node
    controller.run_pass()
    assert api.nominated == [("pod-a", "n1")] and gates(api, "pod-a") == []
