"""The controller places a claim only where the pods that use it can run (driver/scheduling/nodefit.py,
driver/controller/fit.py), on the real control plane: node-a, which first-fit prefers, is made
unfit for the pod in one way at a time, and the claim must go to node-b by the controller's own
decision (kube-scheduler never re-allocated it: its field manager is not on the claim's status).
Where no node fits, the pod gets kube-scheduler's summary of the reasons as an Event. Where
kube-scheduler refuses the controller's node for a reason the controller does not evaluate (pod
anti-affinity), the refusal is counted and told, and the pod runs on the other node."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import kubernetes
import pytest

from testbed.cluster.kubelet_standin import KubeletStandIn
from testbed.workloads import wait_for
from tests.support.controller import by_kube_scheduler, events_on, gang_claim, gated_pod
from tests.support.metrics import scrape, value

pytestmark = pytest.mark.cluster
NS = "default"
OPT_IN = {"gpu.fgpu.dev/allocator": "fgpu"}


def claim(name: str) -> dict[str, Any]:
    request = {"name": "gpu", "exactly": {"deviceClassName": "gpu.fgpu.dev"}}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "labels": OPT_IN},
        "spec": {"devices": {"requests": [request]}},
    }


def pod(name: str, claim_name: str, requests: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    body = gated_pod(name, claim_name)
    body["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "100m", "memory": "64Mi", **(requests or {})}
    body["spec"].update(spec)
    return body


def filler(node: str, **requests: str) -> dict[str, Any]:
    """A pod bound to the node (no kubelet runs it): what it requests is taken there."""
    name = f"filler-{uuid.uuid4().hex[:6]}"
    container = {"name": "main", "image": "registry.invalid/x:1", "resources": {"requests": requests}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"nodeName": node, "containers": [container]},
    }


def allocated_node(resource_api, name: str) -> str | None:
    found = resource_api.read_namespaced_resource_claim(name, NS)
    if found.status is None or found.status.allocation is None:
        return None
    return found.status.allocation.devices.results[0].pool


def running_on(kubelets: dict[str, KubeletStandIn], core_api, name: str, node: str) -> None:
    """Bound by kube-scheduler to the node and prepared there by its kubelet stand-in."""
    bound = wait_for(lambda: core_api.read_namespaced_pod(name, NS), timeout=30)
    assert wait_for(lambda: core_api.read_namespaced_pod(name, NS).spec.node_name, timeout=30) == node
    wait_for(lambda: bound.metadata.uid in kubelets[node].prepared, timeout=30)


def remove(core_api, resource_api, pods: list[str], claim_name: str) -> None:
    for name in pods:
        core_api.delete_namespaced_pod(name, NS)
    wait_for(lambda: not any(p.metadata.name in pods for p in core_api.list_namespaced_pod(NS).items), timeout=60)
    resource_api.delete_namespaced_resource_claim(claim_name, NS)


TAINT = {"key": "dedicated", "value": "x", "effect": "NoSchedule"}
NO_EXECUTE = {"key": "dedicated", "value": "x", "effect": "NoExecute"}
NOT_READY = {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}
ONLY_B = {"key": "metadata.name", "operator": "In", "values": ["node-b"]}


def required(term: dict[str, Any]) -> dict[str, Any]:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


# case -> what makes node-a unfit (a node patch, a status patch, filler pods bound there), and the
# pod's requests and further spec
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], list[dict[str, str]], dict[str, str], dict[str, Any]]] = {
    "cpu": ({}, {}, [{"cpu": "60"}], {"cpu": "8"}, {}),
    "memory": ({}, {}, [{"memory": "500Gi"}], {"memory": "20Gi"}, {}),
    "pod count": ({}, {"allocatable": {"cpu": "64", "memory": "512Gi", "pods": "1"}}, [{"cpu": "1"}], {}, {}),
    "taint": ({"taints": [TAINT]}, {}, [], {}, {}),
    "NoExecute taint": ({"taints": [NO_EXECUTE]}, {}, [], {}, {"tolerations": [{**TAINT, "operator": "Equal"}]}),
    "nodeSelector": ({}, {}, [], {}, {"nodeSelector": {"kubernetes.io/hostname": "node-b"}}),
    "node affinity": ({}, {}, [], {}, {"affinity": required({"matchFields": [ONLY_B]})}),
    "cordoned": ({"unschedulable": True}, {}, [], {}, {}),
    # What the node lifecycle controller does to a node that stops being Ready.
    "not ready": ({"taints": [NOT_READY]}, {"conditions": [{"type": "Ready", "status": "False"}]}, [], {}, {}),
}


@pytest.fixture
def node_a(core_api) -> Iterator[Callable[[dict[str, Any], dict[str, Any], list[dict[str, str]]], None]]:
    """Makes node-a unfit; puts it back (spec, status, filler pods) afterwards."""
    before = core_api.read_node("node-a")
    fillers: list[str] = []

    def unfit(spec: dict[str, Any], status: dict[str, Any], fill: list[dict[str, str]]) -> None:
        if spec:
            core_api.patch_node("node-a", {"spec": spec})
        if status:
            core_api.patch_node_status("node-a", {"status": status})
        for requests in fill:
            fillers.append(core_api.create_namespaced_pod(NS, filler("node-a", **requests)).metadata.name)

    yield unfit
    for name in fillers:
        core_api.delete_namespaced_pod(name, NS, grace_period_seconds=0)
    spec = {"taints": before.spec.taints and [t.to_dict() for t in before.spec.taints], "unschedulable": None}
    core_api.patch_node("node-a", {"spec": spec})
    status = kubernetes.client.ApiClient().sanitize_for_serialization(before.status)
    core_api.patch_node_status(
        "node-a", {"status": {"allocatable": status["allocatable"], "conditions": status["conditions"]}}
    )


@pytest.mark.parametrize("case", list(CASES))
def test_a_claim_goes_where_its_pod_fits(case: str, controlled_nodes, node_a, resource_api, core_api):
    node_spec, node_status, fill, requests, pod_spec = CASES[case]
    node_a(node_spec, node_status, fill)
    name = f"fit-{uuid.uuid4().hex[:6]}"
    core_api.create_namespaced_pod(NS, pod(name, name, requests, **pod_spec))
    resource_api.create_namespaced_resource_claim(NS, claim(name))
    try:
        assert wait_for(lambda: allocated_node(resource_api, name), timeout=30) == "node-b"
        running_on(controlled_nodes.kubelets, core_api, name, "node-b")
        assert not by_kube_scheduler(resource_api, name), "kube-scheduler re-allocated the claim"
    finally:
        remove(core_api, resource_api, [name], name)


def test_a_claim_shared_by_two_pods_goes_where_both_fit(controlled_nodes, resource_api, core_api):
    """The claim comes after its pods (a claim placed while only some of its pods exist is placed
    for those)."""
    name = f"shared-{uuid.uuid4().hex[:6]}"
    pods = [f"{name}-1", f"{name}-2"]
    core_api.create_namespaced_pod(NS, pod(pods[0], name))
    core_api.create_namespaced_pod(NS, pod(pods[1], name, nodeSelector={"kubernetes.io/hostname": "node-b"}))
    resource_api.create_namespaced_resource_claim(NS, claim(name))
    try:
        assert wait_for(lambda: allocated_node(resource_api, name), timeout=30) == "node-b"
        for pod_name in pods:
            running_on(controlled_nodes.kubelets, core_api, pod_name, "node-b")
        assert not by_kube_scheduler(resource_api, name)
    finally:
        remove(core_api, resource_api, pods, name)


def test_where_nothing_fits_the_pod_is_told_why_in_kube_schedulers_words(
    controlled_nodes, node_a, resource_api, core_api
):
    node_a({"taints": [TAINT]}, {}, [])
    name = f"nofit-{uuid.uuid4().hex[:6]}"
    core_api.create_namespaced_pod(NS, pod(name, name, {"cpu": "100"}))
    resource_api.create_namespaced_resource_claim(NS, claim(name))
    try:

        def told() -> list[Any]:
            events = core_api.list_namespaced_event(NS, field_selector=f"involvedObject.name={name}").items
            return [e for e in events if e.involved_object.kind == "Pod" and e.reason == "FailedAllocation"]

        (event, *_) = wait_for(told, timeout=30)
        reasons = "1 Insufficient cpu, 1 node(s) had untolerated taint {dedicated: x}"
        assert event.message == f"claim {name}: 0/2 nodes are available: {reasons}."
        assert allocated_node(resource_api, name) is None
        assert core_api.read_namespaced_pod(name, NS).spec.scheduling_gates
    finally:
        remove(core_api, resource_api, [name], name)


# --- what the controller does not evaluate: kube-scheduler refuses its node ----------------------------

BLOCKER = {"app": "blocker"}
AWAY_FROM_BLOCKER = {
    "podAntiAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": BLOCKER}, "topologyKey": "kubernetes.io/hostname"}
        ]
    }
}


@pytest.fixture
def blocker_on_a(core_api) -> Iterator[None]:
    """A pod on node-a that the test's pod must not share a node with (required pod anti-affinity,
    which the controller does not evaluate: it prefers node-a all the same)."""
    body = filler("node-a", cpu="100m")
    body["metadata"]["labels"] = BLOCKER
    name = core_api.create_namespaced_pod(NS, body).metadata.name
    yield
    core_api.delete_namespaced_pod(name, NS, grace_period_seconds=0)


def refusals_counted(port: int) -> float:
    return value(scrape(port), "fgpu_controller_replaced_by_scheduler_total", reason="inter-pod-affinity") or 0.0


def told_of_refusal(core_api, pod_name: str) -> None:
    (event, *_) = wait_for(lambda: events_on(core_api, "Pod", pod_name, "NodeRefusedByScheduler"), timeout=30)
    assert "kube-scheduler refused node node-a for the pod" in event.message
    assert "anti-affinity" in event.message, event.message


def test_a_node_kube_scheduler_refuses_is_given_back_and_the_claim_placed_without_it(
    controlled_nodes, blocker_on_a, resource_api, core_api
):
    """The controller places the claim on node-a and releases the pod; kube-scheduler refuses
    node-a (anti-affinity) and deallocates the claim; the controller counts it, tells the pod, and
    places the claim again without node-a (or kube-scheduler does first: the pod is released)."""
    name = f"refused-{uuid.uuid4().hex[:6]}"
    counted = refusals_counted(controlled_nodes.metrics_port)
    core_api.create_namespaced_pod(NS, pod(name, name, affinity=AWAY_FROM_BLOCKER))
    resource_api.create_namespaced_resource_claim(NS, claim(name))
    try:
        running_on(controlled_nodes.kubelets, core_api, name, "node-b")
        assert allocated_node(resource_api, name) == "node-b"
        told_of_refusal(core_api, name)
        wait_for(lambda: refusals_counted(controlled_nodes.metrics_port) == counted + 1, timeout=30)
    finally:
        remove(core_api, resource_api, [name], name)


def test_a_gang_member_kube_scheduler_refuses_is_placed_again_and_the_gang_stays_whole(
    controlled_nodes, blocker_on_a, resource_api, core_api
):
    """A gang of two placed on node-a; kube-scheduler refuses node-a for one member's pod: that
    member goes to node-b, the other keeps its devices and its pod on node-a (nothing taken back)."""
    gang = f"g-{uuid.uuid4().hex[:6]}"
    names = [f"{gang}-0", f"{gang}-1"]
    counted = refusals_counted(controlled_nodes.metrics_port)
    core_api.create_namespaced_pod(NS, pod(names[0], names[0]))
    core_api.create_namespaced_pod(NS, pod(names[1], names[1], affinity=AWAY_FROM_BLOCKER))
    for name in names:
        resource_api.create_namespaced_resource_claim(NS, gang_claim(name, gang, 2, 1))
    try:
        running_on(controlled_nodes.kubelets, core_api, names[0], "node-a")
        running_on(controlled_nodes.kubelets, core_api, names[1], "node-b")
        assert [allocated_node(resource_api, name) for name in names] == ["node-a", "node-b"]
        told_of_refusal(core_api, names[1])
        wait_for(lambda: refusals_counted(controlled_nodes.metrics_port) == counted + 1, timeout=30)
        assert not by_kube_scheduler(resource_api, names[0]), "the kept member was re-allocated"
    finally:
        for name in names:
            remove(core_api, resource_api, [name], name)
