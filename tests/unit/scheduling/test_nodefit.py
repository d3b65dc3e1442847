"""Pod fit as kube-scheduler's Filter plugins decide it (driver/scheduling/nodefit.py), on hand-built pods
and nodes: each reason, the filters' order, requests counted as resource.PodRequests counts them."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest

from driver.allocator.model import Placement
from driver.scheduling.nodefit import NodeFacts, NodeRoom, PodNeeds, pod_requests, summary, unfit_reasons
from tests.support.allocation import claim


def node(name: str = "n1", **spec: Any) -> NodeFacts:
    allocatable = spec.pop("allocatable", {"cpu": "4", "memory": "16Gi", "pods": "110"})
    labels = spec.pop("labels", {"zone": "a"})
    body = {"metadata": {"name": name, "labels": labels}, "spec": spec, "status": {"allocatable": allocatable}}
    return NodeFacts.from_object(body)


def pod(cpu: str = "1", memory: str = "1Gi", **spec: Any) -> PodNeeds:
    container = {"name": "main", "resources": {"requests": {"cpu": cpu, "memory": memory}}}
    return PodNeeds.from_object(
        {"metadata": {"name": "p", "namespace": "ns"}, "spec": {"containers": [container], **spec}}
    )


def test_a_pod_that_fits_has_no_reason():
    assert unfit_reasons(pod(), node()) == []


def test_resources_against_allocatable_less_what_the_node_runs():
    assert unfit_reasons(pod(cpu="4"), node()) == []
    assert unfit_reasons(pod(cpu="4", memory="20Gi"), node()) == ["Insufficient memory"]
    used = {"cpu": Fraction(1), "memory": Fraction(0)}
    assert unfit_reasons(pod(cpu="3500m"), node(), used) == ["Insufficient cpu"]
    assert unfit_reasons(pod(cpu="3"), node(), used) == []
    assert unfit_reasons(pod(), node(allocatable={"cpu": "4", "memory": "16Gi", "pods": "2"}), {}, 2) == [
        "Too many pods"
    ]
    gpu_pod = PodNeeds("ns/p", {"example.com/fpga": Fraction(1)})
    assert unfit_reasons(gpu_pod, node()) == ["Insufficient example.com/fpga"]


def test_requests_count_sidecars_init_containers_pod_level_and_overhead():
    def container(cpu: str, **more: Any) -> dict[str, Any]:
        return {"name": cpu, "resources": {"requests": {"cpu": cpu}}, **more}

    spec = {"containers": [container("1"), container("500m")]}
    assert pod_requests(spec)["cpu"] == Fraction(3, 2)
    # An init container alone needs 2: more than the containers' 1.5.
    assert pod_requests({**spec, "initContainers": [container("2")]})["cpu"] == 2
    # A sidecar runs beside the containers (1.5 + 1) and beside the init containers after it (1 + 2).
    sidecar = container("1", restartPolicy="Always")
    assert pod_requests({**spec, "initContainers": [sidecar, container("2")]})["cpu"] == 3
    assert pod_requests({**spec, "initContainers": [container("2"), sidecar]})["cpu"] == Fraction(5, 2)
    # Pod-level requests replace the containers' for cpu and memory; overhead adds.
    assert pod_requests({**spec, "resources": {"requests": {"cpu": "3"}}, "overhead": {"cpu": "250m"}})["cpu"] == (
        Fraction(13, 4)
    )


GENERATION_9 = {"key": "gpu-gen", "value": "9", "effect": "NoSchedule"}


@pytest.mark.parametrize(
    ("taint", "tolerations", "fits"),
    [
        ({"key": "dedicated", "value": "x", "effect": "NoSchedule"}, [], False),
        ({"key": "dedicated", "value": "x", "effect": "NoExecute"}, [], False),
        ({"key": "dedicated", "value": "x", "effect": "PreferNoSchedule"}, [], True),
        ({"key": "dedicated", "value": "x", "effect": "NoSchedule"}, [{"key": "dedicated", "value": "x"}], True),
        ({"key": "dedicated", "value": "x", "effect": "NoSchedule"}, [{"key": "dedicated", "value": "y"}], False),
        ({"key": "dedicated", "value": "x", "effect": "NoSchedule"}, [{"operator": "Exists"}], True),
        (
            {"key": "dedicated", "value": "x", "effect": "NoExecute"},
            [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
            False,
        ),
        (
            {"key": "gpu-gen", "value": "9", "effect": "NoSchedule"},
            [{"key": "gpu-gen", "operator": "Lt", "value": "10"}],
            True,
        ),
        (
            {"key": "gpu-gen", "value": "9", "effect": "NoSchedule"},
            [{"key": "gpu-gen", "operator": "Gt", "value": "10"}],
            False,
        ),
    ],
)
def test_taints_against_tolerations(taint: dict[str, str], tolerations: list[dict[str, str]], fits: bool):
    reasons = unfit_reasons(pod(tolerations=tolerations), node(taints=[taint]))
    assert reasons == ([] if fits else [f"node(s) had untolerated taint {{{taint['key']}: {taint['value']}}}"])


def test_a_cordoned_node_unless_tolerated():
    assert unfit_reasons(pod(), node(unschedulable=True)) == ["node(s) were unschedulable"]
    tolerating = pod(tolerations=[{"key": "node.kubernetes.io/unschedulable", "operator": "Exists"}])
    assert unfit_reasons(tolerating, node(unschedulable=True)) == []


def named(node: str) -> dict[str, Any]:
    return {"key": "metadata.name", "operator": "In", "values": [node]}


def affinity(*terms: dict[str, Any]) -> dict[str, Any]:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}}}


@pytest.mark.parametrize(
    ("spec", "fits"),
    [
        ({"nodeSelector": {"zone": "a"}}, True),
        ({"nodeSelector": {"zone": "b"}}, False),
        ({"affinity": affinity({"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}]})}, True),
        ({"affinity": affinity({"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["a"]}]})}, False),
        ({"affinity": affinity({"matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"}]})}, True),
        ({"affinity": affinity({"matchExpressions": [{"key": "gpu", "operator": "Exists"}]})}, False),
        ({"affinity": affinity({"matchExpressions": [{"key": "rank", "operator": "Gt", "values": ["3"]}]})}, True),
        (
            {"affinity": affinity({"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n2"]}]})},
            False,
        ),
        # Terms are ORed; an empty term matches nothing.
        (
            {"affinity": affinity({}, {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]})},
            True,
        ),
        ({"affinity": affinity({})}, False),
    ],
)
def test_node_selector_and_required_affinity(spec: dict[str, Any], fits: bool):
    reasons = unfit_reasons(pod(**spec), node(labels={"zone": "a", "rank": "5"}))
    assert reasons == ([] if fits else ["node(s) didn't match Pod's node affinity/selector"])


def test_filters_stop_at_the_first_that_fails_in_kube_schedulers_order():
    unfit = pod(cpu="64", nodeSelector={"zone": "b"})
    tainted = node(unschedulable=True, taints=[{"key": "k", "value": "v", "effect": "NoSchedule"}])
    assert unfit_reasons(unfit, tainted) == ["node(s) were unschedulable"]
    assert unfit_reasons(unfit, node(taints=[{"key": "k", "value": "v", "effect": "NoSchedule"}])) == [
        "node(s) had untolerated taint {k: v}"
    ]
    assert unfit_reasons(unfit, node()) == ["node(s) didn't match Pod's node affinity/selector"]


def test_the_summary_counts_reasons_as_kube_scheduler_writes_them():
    reasons = ["Insufficient cpu", "node(s) were unschedulable", "Insufficient cpu"]
    assert summary(3, reasons) == "0/3 nodes are available: 1 node(s) were unschedulable, 2 Insufficient cpu."
    assert summary(0, []) == "0/0 nodes are available."


def test_a_room_admits_pods_on_what_fit_reads_besides_resources():
    # The fragmentation policy counts resources itself: admits() is fit without them.
    nodes = [node("tainted", taints=[{"key": "gpu", "value": "a", "effect": "NoSchedule"}]), node("small"), node("b")]
    big = PodNeeds("ns/big", {"cpu": Fraction(64)})
    room = NodeRoom(nodes, {"ns/c": [big], "ns/empty": []}, refused={"ns/big": {"b"}})
    assert [room.admits(claim("c"), n) for n in ("tainted", "small", "b", "gone")] == [False, True, False, False]
    assert not room.fits(claim("c"), "small")  # 64 CPUs on a 4-CPU node: resources are fit's
    assert room.admits(claim("empty"), "gone")  # no pods: nothing to admit


def test_a_node_is_open_to_any_pod_unless_tainted_or_cordoned():
    # Where kube-scheduler may put a pod that tolerates nothing and selects no node: the pods
    # without claims fgpu does not place (the fragmentation policy counts their level there only).
    gpu_pods_only = {"key": "example.com/gpu-pods-only", "value": "true", "effect": "NoSchedule"}
    preferred = {"key": "example.com/busy", "effect": "PreferNoSchedule"}
    nodes = [node("plain"), node("tainted", taints=[gpu_pods_only]), node("soft", taints=[preferred])]
    room = NodeRoom([*nodes, node("cordoned", unschedulable=True)], {})
    opened = {name: room.open_to_any_pod(name) for name in ("plain", "tainted", "soft", "cordoned", "gone")}
    assert opened == {"plain": True, "tainted": False, "soft": True, "cordoned": False, "gone": False}


def test_fits_answers_as_the_reasons_do_pod_by_pod():
    # fits() sums a claim's pods; reasons() counts them one by one: the same answer at every
    # boundary (CPU exactly used up, the pod limit, a resource the node lacks, a pod counted
    # there already, a refusal, a taint).
    nodes = [
        node("a", allocatable={"cpu": "4", "memory": "16Gi", "pods": "3"}),
        node("tainted", taints=[{"key": "k", "value": "v", "effect": "NoSchedule"}]),
    ]
    one, two, fpga = pod(cpu="2"), pod(cpu="1500m"), PodNeeds("ns/fpga", {"example.com/fpga": Fraction(1)})
    pods_of = {
        "ns/pair": [PodNeeds("ns/x", one.requests), PodNeeds("ns/y", two.requests)],
        "ns/three": [PodNeeds(f"ns/t{i}", {"cpu": Fraction(1, 2)}) for i in range(3)],  # CPU fits, the 4th pod not
        "ns/fpga": [fpga],
        "ns/zero": [PodNeeds("ns/z", {"cpu": Fraction(0), "example.com/fpga": Fraction(0)})],
        "ns/refused": [PodNeeds("ns/r", one.requests)],
        "ns/again": [PodNeeds("ns/run", one.requests), PodNeeds("ns/new", one.requests)],
    }
    running = [("a", PodNeeds("ns/run", {"cpu": Fraction(1, 2)}))]
    room = NodeRoom(nodes, pods_of, running, refused={"ns/r": {"a"}})
    answers = {}
    for key in pods_of:
        for name in ("a", "tainted", "gone"):
            c = claim(key.removeprefix("ns/"))
            answers[key, name] = room.fits(c, name)
            assert answers[key, name] == (not room.reasons(pods_of[key], name)), (key, name)
    assert answers["ns/pair", "a"] and not answers["ns/three", "a"] and not answers["ns/fpga", "a"]
    assert answers["ns/zero", "a"] and not answers["ns/refused", "a"] and answers["ns/again", "a"]
    assert not any(answers[key, "tainted"] or answers[key, "gone"] for key in pods_of)


def test_a_room_names_the_nodes_whose_facts_or_pods_differ_from_an_earlier_rooms():
    web, batch = PodNeeds("ns/web", {"cpu": Fraction(1)}), PodNeeds("ns/batch", {"cpu": Fraction(2)})
    before = NodeRoom([node("a"), node("b"), node("c"), node("d")], {}, [("a", web), ("b", batch), ("c", batch)])
    resized = PodNeeds("ns/batch", {"cpu": Fraction(3)})
    nodes = [node("a"), node("b"), node("c", allocatable={"cpu": "8"}), node("e")]
    after = NodeRoom(nodes, {}, [("b", resized), ("c", batch), ("e", web)])
    # a: its pod finished; b: its pod resized; c: allocatable changed; d gone, e new.
    assert after.changed_since(before) == {"a", "b", "c", "d", "e"}
    assert NodeRoom([node("a"), node("b")], {}, [("a", web)]).changed_since(before) == {"b", "c", "d"}


def test_what_a_node_has_left_follows_the_pods_counted_and_given_back_there():
    # left() is kept per node: a claim's pods taken there or given back are read at once.
    room = NodeRoom([node("a"), node("b")], {"ns/web": [PodNeeds("ns/w", {"cpu": Fraction(3, 2)})]})
    assert room.left("a")["cpu"] == 4.0 and room.left("a")["pods"] == 110.0
    placed = Placement(claim("web"), "a", {})
    room.take(placed)
    assert room.left("a")["cpu"] == 2.5 and room.left("a")["pods"] == 109.0
    assert room.left("b")["cpu"] == 4.0
    room.give_back(placed)
    assert room.left("a")["cpu"] == 4.0 and room.allocatable("a")["cpu"] == 4.0
