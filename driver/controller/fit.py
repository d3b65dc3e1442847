"""Pod fit for the controller: a claim goes only to a node where the pods that use it can run
(driver/nodefit.py says what kube-scheduler checks). What a pass starts from: each node's
allocatable less what is on its way there or running:

- pods bound to the node (not finished);
- pods nominated to it (`status.nominatedNodeName`: kube-scheduler's preemption keeps room there);
- pods released towards it and not bound yet: ungated pods whose claims are allocated on it (the
  node their allocation's node selector names), which kube-scheduler is about to bind there.

A claim's pods are those that name it (in `spec.resourceClaims`, or in
`status.resourceClaimStatuses` for a claim made from a template) and the pod that owns it (a
template's claim exists before its pod's status names it)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from driver.controller.labels import SCHEDULING_GATE, pod_claim_names
from driver.nodefit import NodeFacts, NodeRoom, PodNeeds

JsonObject = dict[str, Any]
FINISHED = ("Succeeded", "Failed")


def node_room(nodes: Iterable[JsonObject], pods: Iterable[JsonObject], claims: Iterable[JsonObject]) -> NodeRoom:
    pods = [p for p in pods if (p.get("status") or {}).get("phase") not in FINISHED]
    claims_by_key = {_key(c): c for c in claims}
    pods_of: dict[str, list[PodNeeds]] = defaultdict(list)
    running: list[tuple[str, PodNeeds]] = []
    by_uid = {}
    for pod in pods:
        needs = PodNeeds.from_object(pod)
        by_uid[pod["metadata"].get("uid")] = needs
        names = pod_claim_names(pod) or _named(pod)
        for name in names:
            pods_of[f"{pod['metadata']['namespace']}/{name}"].append(needs)
        if node := _where(pod, [claims_by_key.get(f"{pod['metadata']['namespace']}/{n}") for n in names]):
            running.append((node, needs))
    for key, claim in claims_by_key.items():
        for owner in claim["metadata"].get("ownerReferences") or ():
            needs = by_uid.get(owner.get("uid")) if owner.get("kind") == "Pod" else None
            if needs is not None and needs not in pods_of[key]:
                pods_of[key].append(needs)
    return NodeRoom((NodeFacts.from_object(n) for n in nodes), pods_of, running)


def _key(obj: JsonObject) -> str:
    return f"{obj['metadata'].get('namespace', '')}/{obj['metadata']['name']}"


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
    if any(g.get("name") == SCHEDULING_GATE for g in spec.get("schedulingGates") or ()):
        return ""
    nodes = {_allocated_node(c) for c in claims if c is not None}
    return nodes.pop() if len(nodes) == 1 else ""


def _allocated_node(claim: JsonObject) -> str:
    """The one node an allocation's node selector names (matchFields metadata.name In [node])."""
    selector = ((claim.get("status") or {}).get("allocation") or {}).get("nodeSelector") or {}
    for term in selector.get("nodeSelectorTerms") or ():
        for field in term.get("matchFields") or ():
            if field.get("key") == "metadata.name" and field.get("operator") == "In" and len(field["values"]) == 1:
                return field["values"][0]
    return ""
