"""Pods without claims placed by the controller (driver/controller/placed_pods.py, `--place-pods`):
in a namespace labelled gpu.fgpu.dev/place-pods=fgpu, a gated pod without claims goes to the node
the policy picks, pinned there and released in one patch; the room counts it there; a pod that
fits none of fgpu's nodes, or that fgpu does not evaluate or read, is let go as it came, told why."""

from __future__ import annotations

from typing import Any

import pytest

from driver.controller.fit import pinned_node
from driver.controller.placed_pods import MAX_TOLERATIONS, out_of_bounds, pinned_affinity, unevaluated
from driver.scheduling.opt_in import PLACE_PODS_LABEL, SCHEDULING_GATE
from testbed.controller_api import InMemoryControllerApi
from tests.support.controller_cluster import fake_cluster

GATES = [{"name": SCHEDULING_GATE}]
ALLOCATABLE = {"cpu": "64", "memory": "512Gi", "pods": "110"}


class PlacingApi(InMemoryControllerApi):
    """The in-memory API server with Namespaces, and the controller's pinning patch."""

    def __init__(self) -> None:
        super().__init__()
        self.store["namespaces"] = {}
        self.placed: list[tuple[str, dict[str, Any], list[Any]]] = []  # (pod, affinity, gates) as patched

    def place_pod(self, pod: dict[str, Any], affinity: dict[str, Any], gates: list[Any]) -> dict[str, Any]:
        self.placed.append((pod["metadata"]["name"], affinity, gates))
        return self._replace("pods", {**pod, "spec": {**pod["spec"], "affinity": affinity, "schedulingGates": gates}})


def cluster(h100_slices: str, nodes: int = 2, labels: dict[str, dict[str, str]] | None = None) -> PlacingApi:
    template = fake_cluster(h100_slices, nodes)
    api = PlacingApi()
    for kind in ("slices", "classes"):
        for obj in template.store[kind].values():
            api.put(kind, obj)
    for i in range(1, nodes + 1):
        name = f"n{i}"
        api.put("nodes", {"metadata": {"name": name, "labels": (labels or {}).get(name, {})},
                          "status": {"allocatable": ALLOCATABLE}})  # fmt: skip
    api.put("namespaces", {"metadata": {"name": "web", "labels": {PLACE_PODS_LABEL: "fgpu"}}})
    api.put("namespaces", {"metadata": {"name": "plain", "labels": {}}})
    return api


def pod(name: str, namespace: str = "web", cpu: str = "1", **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": "x", "resources": {"requests": {"cpu": cpu, "memory": "1Gi"}}}
    body = {"schedulingGates": list(GATES), "containers": [container], **spec}
    return {"metadata": {"name": name, "namespace": namespace, "creationTimestamp": f"2026-01-01T00:00:0{name[-1]}Z"},
            "spec": body}  # fmt: skip


def stored(api: PlacingApi, name: str, namespace: str = "web") -> dict[str, Any]:
    return api.store["pods"][f"{namespace}/{name}"]


def gates_of(api: PlacingApi, name: str, namespace: str = "web") -> list[str]:
    return [g["name"] for g in stored(api, name, namespace)["spec"]["schedulingGates"]]


def events(api: PlacingApi, name: str) -> list[tuple[str, str, str]]:
    return [(e["reason"], e["type"], e["message"]) for e in api.events if e["involvedObject"]["name"] == name]


@pytest.fixture
def placing(replicas):
    def start(api: PlacingApi, policy: str = "first-fit"):
        return replicas(api, policy=policy, place_pods=True)

    return start


def test_a_pod_goes_to_the_node_the_policy_picks_pinned_and_released_in_one_patch(h100_slices, placing):
    api = cluster(h100_slices)
    api.put("pods", pod("p1"))
    placing(api).run_pass()
    assert api.placed == [("p1", pinned_affinity(pod("p1"), "n1"), [])]  # first-fit: n1
    assert gates_of(api, "p1") == []
    assert pinned_node(stored(api, "p1")) == "n1"
    assert pinned_affinity(pod("p1"), "n1") == {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]
            }
        }
    }


@pytest.mark.parametrize("policy", ["fragmentation", "binpack", "spread"])
def test_every_policy_places_pods(h100_slices, placing, policy):
    api = cluster(h100_slices)
    api.put("pods", pod("p1", cpu="60"))
    api.put("pods", pod("p2", cpu="60"))
    placing(api, policy).run_pass()
    assert sorted(pinned_node({"spec": {"affinity": a}}) for _, a, _ in api.placed) == ["n1", "n2"]


def test_the_pods_own_terms_are_narrowed_each_and_decide_the_node(h100_slices, placing):
    api = cluster(h100_slices, labels={"n2": {"zone": "b"}})
    zone_b = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}
    other = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["c"]}]}
    required = {"nodeSelectorTerms": [zone_b, other]}
    preferred = [{"weight": 1, "preference": zone_b}]
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required,
                                 "preferredDuringSchedulingIgnoredDuringExecution": preferred}}  # fmt: skip
    api.put("pods", pod("p1", affinity=affinity))
    placing(api).run_pass()
    [(_, patched, _)] = api.placed
    pin = {"key": "metadata.name", "operator": "In", "values": ["n2"]}
    node_affinity = patched["nodeAffinity"]
    assert node_affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [
        {**zone_b, "matchFields": [pin]},
        {**other, "matchFields": [pin]},
    ]  # the same terms, in order, each only added to: what kube-apiserver lets a gated pod change
    assert node_affinity["preferredDuringSchedulingIgnoredDuringExecution"] == preferred


def test_the_room_counts_a_placed_pod_on_its_node_in_the_pass_and_after(h100_slices, placing):
    api = cluster(h100_slices)
    api.put("pods", pod("p1", cpu="40"))
    api.put("pods", pod("p2", cpu="40"))  # first-fit would take n1 again if p1 were not counted there
    controller = placing(api)
    controller.run_pass()
    assert [(name, pinned_node({"spec": {"affinity": a}})) for name, a, _ in api.placed] == [("p1", "n1"), ("p2", "n2")]
    controller.informers["pods"].relist()
    room = controller.replica.room({})  # read afresh from the caches: pinned, not bound yet
    assert room.counted["n1"] == {"web/p1"} and room.counted["n2"] == {"web/p2"}
    api.put("pods", pod("p3", cpu="40"))  # room on neither node now: kube-scheduler's then
    controller.informers["pods"].relist()
    controller.run_pass()
    assert [name for name, _, _ in api.placed] == ["p1", "p2"]
    assert gates_of(api, "p3") == [] and "affinity" not in stored(api, "p3")["spec"]
    [(reason, kind, message)] = events(api, "p3")
    assert (reason, kind) == ("NotPlacedByFgpu", "Normal")
    assert message == (
        "no node of fgpu's fits the pod (0/2 nodes are available: 2 Insufficient cpu.): kube-scheduler places it"
    )


def test_pods_of_other_namespaces_and_exempt_pods_are_left_to_the_gate_lifter(h100_slices, placing, replicas):
    api = cluster(h100_slices)
    api.put("pods", pod("p1", namespace="plain"))  # its namespace does not opt in: released as before
    owned = pod("p2")
    owned["metadata"]["ownerReferences"] = [{"kind": "DaemonSet", "name": "d", "uid": "u", "apiVersion": "apps/v1"}]
    api.put("pods", owned)
    api.put("pods", pod("p3", schedulerName="other-scheduler"))
    placing(api).run_pass()
    assert api.placed == []
    for name, namespace in (("p1", "plain"), ("p2", "web"), ("p3", "web")):
        assert gates_of(api, name, namespace) == []
    api = cluster(h100_slices)
    api.put("pods", pod("p1"))
    replicas(api).run_pass()  # without --place-pods: the controller lifts the gate as before
    assert api.placed == [] and gates_of(api, "p1") == []


def test_what_fgpu_does_not_read_or_evaluate_is_let_go_with_the_field_named(h100_slices, placing):
    api = cluster(h100_slices)
    tolerations = [{"key": f"k{i}", "operator": "Exists"} for i in range(MAX_TOLERATIONS + 1)]
    api.put("pods", pod("p1", tolerations=tolerations))
    anti = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{"topologyKey": "zone"}]}}
    api.put("pods", pod("p2", affinity=anti))
    placing(api).run_pass()
    assert api.placed == []
    assert gates_of(api, "p1") == [] and gates_of(api, "p2") == []
    assert events(api, "p1") == [("NotPlacedByFgpu", "Warning", "fgpu does not place this pod (spec.tolerations: "
                                  f"a list of at most {MAX_TOLERATIONS}): kube-scheduler places it")]  # fmt: skip
    assert "spec.affinity.podAntiAffinity is required" in events(api, "p2")[0][2]


def test_bounds_and_unevaluated_fields_name_the_field():
    required = {"nodeSelectorTerms": [{"matchFields": []}] * 17}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}
    assert out_of_bounds(pod("p", affinity=affinity)) == (
        "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms: "
        "a list of at most 16 terms"
    )
    assert out_of_bounds(pod("p", nodeSelector=["x"])) == "spec.nodeSelector: a map of at most 64 labels"
    assert out_of_bounds(pod("p")) is None and unevaluated(pod("p")) is None
    spread = [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}]
    assert unevaluated(pod("p", topologySpreadConstraints=spread)) == "spec.topologySpreadConstraints: DoNotSchedule"
    anyway = [{**spread[0], "whenUnsatisfiable": "ScheduleAnyway"}]
    assert unevaluated(pod("p", topologySpreadConstraints=anyway)) is None
    claim_volume = [{"name": "v", "persistentVolumeClaim": {"claimName": "c"}}]
    assert unevaluated(pod("p", volumes=claim_volume)) == "spec.volumes: a persistent volume"


def test_a_pod_another_gate_holds_is_placed_once_that_gate_goes(h100_slices, placing):
    api = cluster(h100_slices)
    held = pod("p1")
    held["spec"]["schedulingGates"].append({"name": "kueue.x-k8s.io/admission"})
    api.put("pods", held)
    controller = placing(api)
    controller.run_pass()
    assert api.placed == [] and gates_of(api, "p1") == [SCHEDULING_GATE, "kueue.x-k8s.io/admission"]
    admitted = stored(api, "p1")
    admitted["spec"]["schedulingGates"] = [{"name": SCHEDULING_GATE}]
    api.put("pods", admitted)
    controller.informers["pods"].relist()
    controller.run_pass()
    assert [name for name, _, _ in api.placed] == ["p1"] and gates_of(api, "p1") == []
