"""Would kube-scheduler run a pod on a node: the Filter checks of its default plugins that depend
on the pod and the node alone, with their semantics and their reasons, so that a claim is placed
only where the pods that use it can run.

- NodeUnschedulable: a cordoned node (`spec.unschedulable`) unless the pod tolerates
  `node.kubernetes.io/unschedulable:NoSchedule`;
- TaintToleration: every NoSchedule and NoExecute taint tolerated (k8s.io/api core/v1
  toleration.go `ToleratesTaint`; Lt/Gt compare integers). A node that is not Ready carries the
  node lifecycle controller's `node.kubernetes.io/not-ready` taint, which is how the scheduler
  sees readiness;
- NodeAffinity: `nodeSelector` and the required node affinity (component-helpers
  nodeaffinity.go: terms ORed, a term's requirements ANDed, an empty term matches nothing);
- NodeResourcesFit: CPU, memory, ephemeral storage, extended resources and the pod count against
  allocatable less what the node's pods request (`fitsRequest` in noderesources/fit.go), a pod's
  requests as component-helpers resource.PodRequests counts them (sidecars, init containers,
  pod-level requests, overhead).

Not evaluated (kube-scheduler may still refuse the node; docs/allocator.md says what happens then):
inter-pod affinity, topology spread, volumes, host ports, image locality, DRA itself."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from driver.allocator.cluster import Placement
from driver.allocator.model import Claim
from driver.allocator.pools import Node, decimal_integer, selector_matches
from driver.common.quantity import Amount, parse_quantity

JsonObject = dict[str, Any]
CPU, MEMORY, PODS = "cpu", "memory", "pods"
FILTERED_EFFECTS = ("NoSchedule", "NoExecute")
UNSCHEDULABLE_TAINT = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
# kube-scheduler's reasons, as its FitError message counts them ("0/3 nodes are available: ..."); a taint
# is named where kube-scheduler 1.37 says only "node(s) had untolerated taint(s)".
UNSCHEDULABLE = "node(s) were unschedulable"
UNTOLERATED = "node(s) had untolerated taint {{{key}: {value}}}"
AFFINITY = "node(s) didn't match Pod's node affinity/selector"
TOO_MANY_PODS = "Too many pods"
# Not kube-scheduler's words: a node it refused for the pod before, for a reason not evaluated here
# (driver/controller/refusals.py).
REFUSED = "node(s) refused by kube-scheduler for the pod"

Resources = dict[str, Amount]


@dataclass(frozen=True)
class NodeFacts:
    """What the fit checks read of a node."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[JsonObject, ...] = ()
    unschedulable: bool = False
    allocatable: Mapping[str, Amount] = field(default_factory=dict)

    @classmethod
    def from_object(cls, node: JsonObject) -> NodeFacts:
        spec, status = node.get("spec") or {}, node.get("status") or {}
        return cls(
            name=node["metadata"]["name"],
            labels=dict(node["metadata"].get("labels") or {}),
            taints=tuple(spec.get("taints") or ()),
            unschedulable=bool(spec.get("unschedulable")),
            allocatable=_resources(status.get("allocatable")),
        )


@dataclass(frozen=True)
class PodNeeds:
    """What the fit checks read of a pod."""

    name: str
    requests: Mapping[str, Amount] = field(default_factory=dict)
    tolerations: tuple[JsonObject, ...] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)
    required_terms: tuple[JsonObject, ...] | None = None  # None: no required node affinity

    @classmethod
    def from_object(cls, pod: JsonObject) -> PodNeeds:
        spec = pod.get("spec") or {}
        required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        )
        metadata = pod.get("metadata") or {}
        return cls(
            name=f"{metadata.get('namespace', 'default')}/{metadata.get('name', '')}",
            requests=pod_requests(spec),
            tolerations=tuple(spec.get("tolerations") or ()),
            node_selector=dict(spec.get("nodeSelector") or {}),
            required_terms=None if required is None else tuple(required.get("nodeSelectorTerms") or ()),
        )


def _resources(raw: Mapping[str, Any] | None) -> Resources:
    return {name: parse_quantity(str(value)) for name, value in (raw or {}).items()}


def _add(total: Resources, more: Mapping[str, Amount]) -> None:
    for name, value in more.items():
        total[name] = total.get(name, Fraction(0)) + value


def _max(total: Resources, other: Mapping[str, Amount]) -> None:
    for name, value in other.items():
        if value > total.get(name, Fraction(0)):
            total[name] = value


def pod_requests(spec: JsonObject) -> Resources:
    """A pod's requests as kube-scheduler counts them (resource.PodRequests): the containers'
    sum with restartable init containers (sidecars) running beside them, at least what any init
    container needs with the sidecars started before it, pod-level requests where set, plus the
    runtime class overhead."""
    total: Resources = {}
    for container in spec.get("containers") or ():
        _add(total, _resources((container.get("resources") or {}).get("requests")))
    sidecars: Resources = {}
    init_peak: Resources = {}
    for container in spec.get("initContainers") or ():
        own = _resources((container.get("resources") or {}).get("requests"))
        if container.get("restartPolicy") == "Always":
            _add(total, own)
            _add(sidecars, own)
            _max(init_peak, sidecars)
        else:
            running = dict(own)
            _add(running, sidecars)
            _max(init_peak, running)
    _max(total, init_peak)
    for name, value in _resources((spec.get("resources") or {}).get("requests")).items():
        if name in (CPU, MEMORY) or name.startswith("hugepages-"):
            total[name] = value
    _add(total, _resources(spec.get("overhead")))
    return total


def _tolerates(toleration: JsonObject, taint: JsonObject) -> bool:
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Equal":
        return (toleration.get("value") or "") == (taint.get("value") or "")
    if operator == "Exists":
        return True
    if operator in ("Lt", "Gt"):
        mine, theirs = decimal_integer(toleration.get("value")), decimal_integer(taint.get("value"))
        if mine is None or theirs is None:
            return False
        return theirs < mine if operator == "Lt" else theirs > mine
    return False


def untolerated_taint(pod: PodNeeds, node: NodeFacts) -> JsonObject | None:
    """The first NoSchedule/NoExecute taint of the node the pod does not tolerate, if any."""
    for taint in node.taints:
        if taint.get("effect") in FILTERED_EFFECTS and not any(_tolerates(t, taint) for t in pod.tolerations):
            return taint
    return None


def affinity_matches(pod: PodNeeds, node: NodeFacts) -> bool:
    if any(node.labels.get(key) != value for key, value in pod.node_selector.items()):
        return False
    if pod.required_terms is None:
        return True
    return selector_matches({"nodeSelectorTerms": list(pod.required_terms)}, Node(node.name, dict(node.labels)))


def insufficient(pod: PodNeeds, node: NodeFacts, requested: Mapping[str, Amount], pods_on_node: int) -> list[str]:
    """kube-scheduler's `Insufficient <resource>` / `Too many pods` reasons for the pod on a node
    whose pods request `requested` (pods_on_node of them)."""
    reasons = []
    if PODS in node.allocatable and pods_on_node + 1 > node.allocatable[PODS]:
        reasons.append(TOO_MANY_PODS)
    for name in sorted(pod.requests):
        wanted = pod.requests[name]
        if wanted <= 0 or name == PODS:
            continue
        if wanted > node.allocatable.get(name, Fraction(0)) - requested.get(name, Fraction(0)):
            reasons.append(f"Insufficient {name}")
    return reasons


def unfit_reasons(
    pod: PodNeeds, node: NodeFacts, requested: Mapping[str, Amount] | None = None, pods_on_node: int = 0
) -> list[str]:
    """Why kube-scheduler would not run the pod on the node (empty: it fits), in its words. The
    filters run in its order and stop at the first that fails, as its framework does."""
    return filtered(pod, node) or insufficient(pod, node, requested or {}, pods_on_node)


ANY_POD = PodNeeds("")  # a pod that asks for no node in particular


def filtered(pod: PodNeeds, node: NodeFacts) -> list[str]:
    """unfit_reasons before resources: schedulability, taints, affinity."""
    if node.unschedulable and not any(_tolerates(t, UNSCHEDULABLE_TAINT) for t in pod.tolerations):
        return [UNSCHEDULABLE]
    taint = untolerated_taint(pod, node)
    if taint is not None:
        return [UNTOLERATED.format(key=taint.get("key", ""), value=taint.get("value", ""))]
    if not affinity_matches(pod, node):
        return [AFFINITY]
    return []


def summary(nodes: int, reasons: Iterable[str]) -> str:
    """kube-scheduler's FitError message: `0/3 nodes are available: 1 Insufficient cpu, 2 node(s)
    were unschedulable.` (each reason counted over the nodes, sorted as text)."""
    parts = ", ".join(sorted(f"{count} {reason}" for reason, count in Counter(reasons).items()))
    return f"0/{nodes} nodes are available: {parts}." if parts else f"0/{nodes} nodes are available."


class NodeRoom:
    """What the nodes have left for pods, kept as claims are placed: a PodRoom for the allocator
    (driver/allocator/cluster.py). A claim's pods (`pods_of`, by claim key) fit a node when each
    of them does with the ones before it counted; a pod counted on a node already (it uses
    another claim placed there) is not counted twice."""

    def __init__(
        self,
        nodes: Iterable[NodeFacts],
        pods_of: Mapping[str, Sequence[PodNeeds]],
        running: Iterable[tuple[str, PodNeeds]] = (),
        refused: Mapping[str, AbstractSet[str]] | None = None,
    ) -> None:
        """`running`: pods already on (or on their way to) a node, by node name; `refused`: pod
        (namespace/name) -> nodes kube-scheduler refused for it."""
        self.nodes = {node.name: node for node in nodes}
        self.pods_of = pods_of
        self.refused = refused or {}
        self.requested: dict[str, Resources] = {name: {} for name in self.nodes}
        self.counted: dict[str, set[str]] = {name: set() for name in self.nodes}
        self._admitted: dict[tuple[str, str], bool] = {}  # (claim key, node) -> admits()
        self._open: dict[str, bool] = {}  # node -> open_to_any_pod()
        # left() and allocatable() in floats, kept per node until its pods change (read often: the
        # fragmentation policy reads every node's room each time it sets its level)
        self._left: dict[str, Mapping[str, float]] = {}
        self._allocatable: dict[str, Mapping[str, float]] = {}
        for node, pod in running:
            if node in self.nodes:
                self._count(node, pod)

    def reasons(self, pods: Sequence[PodNeeds], node: str) -> list[str]:
        """Why the pods cannot all run on the node (empty: they can). A node without facts (no
        Node object) is not one a pod can be placed on."""
        if not pods:
            return []  # no pod uses the claim yet: nothing to check (kube-scheduler checks its pods)
        facts = self.nodes.get(node)
        if facts is None:
            return ["node(s) not found"]
        requested, counted = dict(self.requested[node]), len(self.counted[node])
        for pod in pods:
            if node in self.refused.get(pod.name, ()):
                return [REFUSED]
            if pod.name in self.counted[node]:
                continue
            reasons = unfit_reasons(pod, facts, requested, counted)
            if reasons:
                return reasons
            _add(requested, pod.requests)
            counted += 1
        return []

    def fits(self, claim: Claim, node: str) -> bool:
        """reasons() is empty: what the node admits, then its resources left against what the
        pods request together (each pod fits with the ones before it counted: the same, requests
        being positive)."""
        pods = self.pods_of.get(claim.key, ())
        counted = self.counted.get(node, set())
        if any(pod.name in counted for pod in pods):
            return not self.reasons(pods, node)  # some are counted there already: pod by pod
        if not self.admits(claim, node):
            return False
        if not pods:
            return True
        facts, requested = self.nodes[node], self.requested[node]
        if PODS in facts.allocatable and len(counted) + len(pods) > facts.allocatable[PODS]:
            return False
        wanted = pods[0].requests
        if len(pods) > 1:
            wanted = {}
            for pod in pods:
                _add(wanted, pod.requests)
        zero = Fraction(0)
        return all(
            value <= 0 or name == PODS or value <= facts.allocatable.get(name, zero) - requested.get(name, zero)
            for name, value in wanted.items()
        )

    def admits(self, claim: Claim, node: str) -> bool:
        """Whether the claim's pods may run on the node, what it has left aside (its facts, taints,
        affinity, kube-scheduler's refusals): fixed for this room, so kept."""
        key = (claim.key, node)
        found = self._admitted.get(key)
        if found is None:
            pods, facts = self.pods_of.get(claim.key, ()), self.nodes.get(node)
            found = self._admitted[key] = not pods or (
                facts is not None
                and not any(node in self.refused.get(pod.name, ()) or filtered(pod, facts) for pod in pods)
            )
        return found

    def open_to_any_pod(self, node: str) -> bool:
        """Whether a pod that asks for no node (no toleration, selector or affinity) may run on the
        node: where kube-scheduler may put pods that fgpu does not place. A taint keeps them off
        (a node kept for the pods with claims that tolerate it)."""
        found = self._open.get(node)
        if found is None:
            facts = self.nodes.get(node)
            found = self._open[node] = facts is not None and not filtered(ANY_POD, facts)
        return found

    def allocatable(self, node: str) -> Mapping[str, float]:
        """What the node holds for pods, per allocatable resource (`pods`: how many); nothing for a
        node without facts."""
        found = self._allocatable.get(node)
        if found is None:
            facts = self.nodes.get(node)
            found = {name: float(value) for name, value in facts.allocatable.items()} if facts is not None else {}
            self._allocatable[node] = found
        return found

    def left(self, node: str) -> Mapping[str, float]:
        """What the node has left for pods, per allocatable resource (`pods`: how many more); nothing
        for a node without facts (no Node object: no pod is placed there)."""
        found = self._left.get(node)
        if found is None:
            found = self._left[node] = self._left_now(node)
        return found

    def _left_now(self, node: str) -> dict[str, float]:
        facts = self.nodes.get(node)
        if facts is None:
            return {}
        requested = self.requested[node]
        left = {name: float(value - requested.get(name, Fraction(0))) for name, value in facts.allocatable.items()}
        if PODS in facts.allocatable:
            left[PODS] = float(facts.allocatable[PODS]) - len(self.counted[node])
        return left

    def holds(self, node: str) -> tuple[NodeFacts | None, Mapping[str, Amount], int]:
        """What the node holds for pods, as one value to compare: its facts (allocatable, taints,
        labels), what its pods request and how many they are."""
        return self.nodes.get(node), self.requested.get(node, {}), len(self.counted.get(node, ()))

    def changed_since(self, before: NodeRoom) -> set[str]:
        """The nodes whose facts or pods differ from what `before` (an earlier room, with what was
        placed on it since) holds: one comparison a node, nothing measured again."""
        return {node for node in self.nodes.keys() | before.nodes.keys() if self.holds(node) != before.holds(node)}

    def needs(self, claim: Claim) -> dict[str, float]:
        """What the claim's pods request together (`pods`: how many they are)."""
        pods = self.pods_of.get(claim.key, ())
        if not pods:
            return {}
        total: Resources = {}
        for pod in pods:
            _add(total, pod.requests)
        needs = {name: float(value) for name, value in total.items() if value > 0 and name != PODS}
        return needs | {PODS: float(len(pods))}

    def demand(self, claim: Claim) -> Hashable:
        """What fit reads of the claim's pods, as one value (equal values: equal fit)."""
        return tuple(
            (
                tuple(sorted(pod.requests.items())),
                repr(pod.tolerations),
                tuple(sorted(pod.node_selector.items())),
                repr(pod.required_terms),
            )
            for pod in self.pods_of.get(claim.key, ())
        )

    def take(self, placement: Placement) -> None:
        for pod in self.pods_of.get(placement.claim.key, ()):
            self._count(placement.node, pod)

    def _count(self, node: str, pod: PodNeeds) -> None:
        if pod.name not in self.counted[node]:
            _add(self.requested[node], pod.requests)
            self.counted[node].add(pod.name)
            self._left.pop(node, None)

    def give_back(self, placement: Placement) -> None:
        for pod in self.pods_of.get(placement.claim.key, ()):
            if pod.name in self.counted.get(placement.node, ()):
                _add(self.requested[placement.node], {k: -v for k, v in pod.requests.items()})
                self.counted[placement.node].discard(pod.name)
                self._left.pop(placement.node, None)

    def why_not(self, claim: Claim, nodes: Sequence[str]) -> str:
        pods = self.pods_of.get(claim.key, ())
        return summary(len(nodes), (reason for node in nodes for reason in self.reasons(pods, node)))
