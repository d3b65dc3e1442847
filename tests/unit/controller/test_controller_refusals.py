"""kube-scheduler giving back a claim the controller placed (driver/controller/refusals.py): what is
noticed, what is forgotten, how its reasons are counted, and the refused node ruled out."""

from __future__ import annotations

from typing import Any

import pytest

from driver.allocator.model import Claim
from driver.controller.refusals import given_back, pods_by_claim, refusal_reason, scheduler_says
from driver.scheduling.nodefit import REFUSED, NodeFacts, NodeRoom, PodNeeds
from driver.scheduling.opt_in import OPT_IN_LABEL, SCHEDULING_GATE


def allocation(node: str) -> dict[str, Any]:
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
    results = [{"driver": "gpu.fgpu.dev", "pool": node, "device": "gpu-0"}]
    return {"devices": {"results": results}, "nodeSelector": {"nodeSelectorTerms": [term]}}


def claim(name: str, allocated: str = "") -> dict[str, Any]:
    status = {"allocation": allocation(allocated)} if allocated else {}
    meta = {"name": name, "namespace": "ns", "uid": f"uid-{name}", "labels": {OPT_IN_LABEL: "fgpu"}}
    return {"metadata": meta, "status": status}


def pod(name: str, claim_name: str, gated: bool = False, node: str = "") -> dict[str, Any]:
    spec: dict[str, Any] = {"resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}]}
    if gated:
        spec["schedulingGates"] = [{"name": SCHEDULING_GATE}]
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": name, "namespace": "ns"}, "spec": spec, "status": {"phase": "Pending"}}


def run(placed: dict[str, str], claims: list[dict[str, Any]], pods: list[dict[str, Any]]):
    by_uid = {c["metadata"]["uid"]: c for c in claims}
    return given_back(placed, by_uid, pods_by_claim(pods), now=1.0)


@pytest.mark.parametrize("now_on", ["", "node-b"])  # kube-scheduler may re-allocate before a pass sees it
def test_a_released_claim_that_lost_its_allocation_was_given_back(now_on: str):
    refusals, done = run({"uid-c": "node-a"}, [claim("c", allocated=now_on)], [pod("p", "c", node=now_on)])
    assert [(r.claim, r.node, r.pods) for r in refusals] == [("ns/c", "node-a", ("ns/p",))]
    assert done == ["uid-c"]


@pytest.mark.parametrize(
    "claims, pods, forgotten",
    [
        ([claim("c")], [pod("p", "c", gated=True)], False),  # not released: taken back by us, a gang waits
        ([claim("c")], [], False),  # no pod uses it: nothing of kube-scheduler's
        ([claim("c", "node-a")], [pod("p", "c")], False),  # still allocated, pod not bound yet
        ([claim("c", "node-a")], [pod("p", "c", node="node-a")], True),  # bound: nothing can give it back
        ([], [pod("p", "c")], True),  # the claim is gone
    ],
)
def test_what_is_not_a_refusal(claims, pods, forgotten):
    refusals, done = run({"uid-c": "node-a"}, claims, pods)
    assert refusals == []
    assert done == (["uid-c"] if forgotten else [])


def test_every_pod_of_a_shared_claim_is_named_and_finished_ones_are_not():
    finished = pod("old", "c") | {"status": {"phase": "Succeeded"}}
    refusals, _ = run({"uid-c": "node-a"}, [claim("c")], [pod("p1", "c"), pod("p2", "c"), finished])
    assert refusals[0].pods == ("ns/p1", "ns/p2")


@pytest.mark.parametrize(
    "message, label",
    [
        ("0/2 nodes are available: 1 node(s) didn't match pod anti-affinity rules, 1 ...", "inter-pod-affinity"),
        ("0/3 nodes are available: 3 node(s) didn't satisfy existing pods anti-affinity rules.", "inter-pod-affinity"),
        ("0/2 nodes are available: 2 node(s) didn't match pod topology spread constraints.", "topology-spread"),
        ("0/1 nodes are available: 1 node(s) had volume node affinity conflict.", "volume"),
        ("0/1 nodes are available: 1 node(s) didn't have free ports for the requested pod ports.", "ports"),
        ("0/1 nodes are available: 1 Insufficient cpu.", "node-fit"),
        ("kube-scheduler did not say why", "other"),
    ],
)
def test_kube_schedulers_message_gives_the_metrics_reason(message, label):
    assert refusal_reason(message) == label


def test_kube_schedulers_words_are_its_unschedulable_condition_only():
    gated_condition = {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated", "message": "gated"}
    refused = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/2 nodes ..."}
    assert scheduler_says({"status": {"conditions": [gated_condition]}}) is None
    assert scheduler_says({"status": {"conditions": [refused]}}) == "0/2 nodes ..."
    assert scheduler_says(None) is None


def test_a_refused_node_is_ruled_out_for_that_pod_only():
    nodes = [NodeFacts(name) for name in ("node-a", "node-b")]
    refused_pod, other_pod = PodNeeds("ns/p"), PodNeeds("ns/q")
    room = NodeRoom(nodes, {"ns/c": [refused_pod], "ns/d": [other_pod]}, refused={"ns/p": {"node-a"}})
    c, d = (Claim("ns", n, f"uid-{n}", (), (), (), {}) for n in ("c", "d"))
    assert not room.fits(c, "node-a") and room.fits(c, "node-b")
    assert room.fits(d, "node-a")
    assert room.why_not(c, ["node-a"]) == f"0/1 nodes are available: 1 {REFUSED}."
