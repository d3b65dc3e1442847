"""Pod fit for the controller: a claim goes only to a node where the pods that use it can run
(driver/scheduling/nodefit.py says what kube-scheduler checks). What a pass starts from: each node's
allocatable less what is on its way there or running:

- pods bound to the node (not finished);
- pods nominated to it (`status.nominatedNodeName`: kube-scheduler's preemption keeps room there);
- pods released towards it and not bound yet: ungated pods whose claims are allocated on it (the
  node their allocation's node selector names), or whose required node affinity names it alone
  (the pods without claims the controller placed, placed_pods.py, and a DaemonSet's), which
  kube-scheduler is about to bind there.

A claim's pods are those that name it (in `spec.resourceClaims`, or in
`status.resourceClaimStatuses` for a claim made from a template) and the pod that owns it (a
template's claim exists before its pod's status names it)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any, Generic, TypeVar

from driver.kube.informer import object_key
from driver.scheduling.nodefit import NodeFacts, NodeRoom, PodNeeds
from driver.scheduling.opt_in import gated, pod_claim_names

JsonObject = dict[str, Any]
FINISHED = ("Succeeded", "Failed")
Parsed_T = TypeVar("Parsed_T")


class Parsed(Generic[Parsed_T]):
    """What was read of each object (a pod's needs, a node's facts), kept by its uid or name and
    read again only when its resourceVersion changes: a pass builds its room from every pod and
    node, and parsing each one's quantities again was most of that at thousands of pods."""

    def __init__(self, read: Callable[[JsonObject], Parsed_T], key: str) -> None:
        """`key`: the metadata field an object is kept by (uid, or a node's name)."""
        self._read, self._key = read, key
        self._kept: dict[str, tuple[str, Parsed_T]] = {}  # key -> resourceVersion, what was read

    def of(self, obj: JsonObject) -> Parsed_T:
        return self._of(obj, self._kept, self._kept)

    def all_of(self, objects: Iterable[JsonObject]) -> list[Parsed_T]:
        """Each object's, keeping only these: what is gone from the caches is forgotten."""
        before, self._kept = self._kept, {}
        return [self._of(obj, before, self._kept) for obj in objects]

    def _of(
        self, obj: JsonObject, before: dict[str, tuple[str, Parsed_T]], keep: dict[str, tuple[str, Parsed_T]]
    ) -> Parsed_T:
        metadata = obj.get("metadata") or {}
        key, version = metadata.get(self._key), metadata.get("resourceVersion")
        if not key or not version:  # nothing to tell a change by: read it
            return self._read(obj)
        kept = before.get(key)
        if kept is None or kept[0] != version:
            kept = (version, self._read(obj))
        keep[key] = kept
        return kept[1]


class RoomReader:
    """Builds a pass's room for pods from the caches (node_room), reading again only the pods and
    nodes that changed since the last pass."""

    def __init__(self) -> None:
        self._pods: Parsed[PodNeeds] = Parsed(PodNeeds.from_object, "uid")
        self._nodes: Parsed[NodeFacts] = Parsed(NodeFacts.from_object, "name")

    def room(
        self,
        nodes: Iterable[JsonObject],
        pods: Iterable[JsonObject],
        claims: Iterable[JsonObject],
        refused: Mapping[str, AbstractSet[str]] | None = None,
    ) -> NodeRoom:
        """`refused`: pod key -> nodes kube-scheduler refused for it (refusals.py)."""
        live = live_pods(pods)
        claims_by_key = {object_key(c): c for c in claims}
        needs = dict(zip((pod["metadata"].get("uid") for pod in live), self._pods.all_of(live), strict=True))
        running = []
        for pod in live:
            used = [claims_by_key.get(f"{pod['metadata']['namespace']}/{name}") for name in _claim_names(pod)]
            if node := _where(pod, used):
                running.append((node, needs[pod["metadata"].get("uid")]))
        return NodeRoom(self._nodes.all_of(nodes), _pods_of(live, needs, claims_by_key), running, refused)

    def claim_pods(self, pods: Iterable[JsonObject], claims: Iterable[JsonObject]) -> dict[str, list[PodNeeds]]:
        """Claim key -> the pods that use it (what a room's `pods_of` holds), for claims that
        arrive while a pass's room is in use."""
        live = live_pods(pods)
        needs = {pod["metadata"].get("uid"): self._pods.of(pod) for pod in live}
        return _pods_of(live, needs, {object_key(c): c for c in claims})


def node_room(
    nodes: Iterable[JsonObject],
    pods: Iterable[JsonObject],
    claims: Iterable[JsonObject],
    refused: Mapping[str, AbstractSet[str]] | None = None,
) -> NodeRoom:
    """The room read afresh, nothing kept (RoomReader.room)."""
    return RoomReader().room(nodes, pods, claims, refused)


def live_pods(pods: Iterable[JsonObject]) -> list[JsonObject]:
    return [p for p in pods if (p.get("status") or {}).get("phase") not in FINISHED]


def _claim_names(pod: JsonObject) -> list[str]:
    return pod_claim_names(pod) or _named(pod)


def _pods_of(
    pods: list[JsonObject], needs: dict[Any, PodNeeds], claims_by_key: dict[str, JsonObject]
) -> dict[str, list[PodNeeds]]:
    """Claim key -> the pods that name it, and the pod that owns it (a template's claim)."""
    pods_of: dict[str, list[PodNeeds]] = defaultdict(list)
    for pod in pods:
        for name in _claim_names(pod):
            pods_of[f"{pod['metadata']['namespace']}/{name}"].append(needs[pod["metadata"].get("uid")])
    for key, claim in claims_by_key.items():
        for owner in claim["metadata"].get("ownerReferences") or ():
            owner_needs = needs.get(owner.get("uid")) if owner.get("kind") == "Pod" else None
            if owner_needs is not None and owner_needs not in pods_of[key]:
                pods_of[key].append(owner_needs)
    return pods_of


def _named(pod: JsonObject) -> list[str]:
    """The claims a pod names directly (those from templates have no name yet)."""
    refs = (pod.get("spec") or {}).get("resourceClaims") or ()
    return [r["resourceClaimName"] for r in refs if r.get("resourceClaimName")]


def _where(pod: JsonObject, claims: list[JsonObject | None]) -> str:
    """The node the pod runs on or is on its way to ("" when none yet)."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    if spec.get("nodeName"):
        return spec["nodeName"]
    if status.get("nominatedNodeName"):
        return status["nominatedNodeName"]
    if gated(pod):
        return ""
    if node := pinned_node(pod):
        return node
    nodes = {allocated_node(c) for c in claims if c is not None}
    return nodes.pop() if len(nodes) == 1 else ""


def pinned_node(pod: JsonObject) -> str:
    """The one node the pod's required node affinity admits by name ("" when it does not name one):
    every term has `matchFields metadata.name In [node]`, the same node."""
    affinity = ((pod.get("spec") or {}).get("affinity") or {}).get("nodeAffinity") or {}
    terms = (affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or ()
    named = {_named_node(term) for term in terms}
    return named.pop() if len(named) == 1 else ""


def _named_node(term: JsonObject) -> str:
    """The node a node selector term names alone (`matchFields metadata.name In [node]`), or ""."""
    for field in term.get("matchFields") or ():
        values: list[Any] = field.get("values") or []
        if field.get("key") == "metadata.name" and field.get("operator") == "In" and len(values) == 1:
            return str(values[0])
    return ""


def allocated_node(claim: JsonObject) -> str:
    """The one node an allocation's node selector names (matchFields metadata.name In [node])."""
    selector = ((claim.get("status") or {}).get("allocation") or {}).get("nodeSelector") or {}
    return next((node for term in selector.get("nodeSelectorTerms") or () if (node := _named_node(term))), "")
