"""How claims and pods ask for the controller: its labels, its scheduling gate, and what they say.

Claims opt in with the label `gpu.fgpu.dev/allocator=fgpu` (set it on a ResourceClaimTemplate's
metadata and every claim made from it carries it). Their pods carry the scheduling gate
`gpu.fgpu.dev/allocation`, so kube-scheduler leaves them alone until the controller has written
every claim's allocation; it then lifts the gate and kube-scheduler binds the pod to the node the
allocation names. Gangs: claims labelled `gpu.fgpu.dev/gang=<name>` and `gpu.fgpu.dev/gang-size=<n>`
are allocated together once all n exist, all or none (upstream PodGroups with a gang policy are
gangs too: driver/controller/groups.py).

Pods without claims opt in by namespace: the platform team labels a Namespace
`gpu.fgpu.dev/place-pods=fgpu` (tenants cannot label namespaces under the usual RBAC), the webhook
gates its claimless pods, and the controller places them with the policy it places claims with
(driver/controller/placed_pods.py): it pins the pod to the node it chose (required node affinity)
and lifts the gate. Some pods are never placed so (placement_exempt).

Read by the controller, by the admission webhook (it gates the pods of opt-in claims) and by
`fgpu plan`, which plans claims as the controller would: below all three."""

from __future__ import annotations

from typing import Any, NamedTuple

from driver.allocator.model import Claim

OPT_IN_LABEL = "gpu.fgpu.dev/allocator"
OPT_IN_VALUE = "fgpu"
GANG_LABEL = "gpu.fgpu.dev/gang"
GANG_SIZE_LABEL = "gpu.fgpu.dev/gang-size"
SCHEDULING_GATE = "gpu.fgpu.dev/allocation"
MOVABLE_ANNOTATION = "gpu.fgpu.dev/movable"  # on a pod: the controller may move it to make room
PLACE_PODS_LABEL = "gpu.fgpu.dev/place-pods"  # on a Namespace: the controller places its pods without claims
PLACE_PODS_VALUE = "fgpu"
DEFAULT_SCHEDULER = "default-scheduler"
SYSTEM_NAMESPACE = "kube-system"


def opted_in(claim: dict[str, Any]) -> bool:
    return ((claim.get("metadata") or {}).get("labels") or {}).get(OPT_IN_LABEL) == OPT_IN_VALUE


def pending(claim: dict[str, Any]) -> bool:
    meta = claim.get("metadata") or {}
    return opted_in(claim) and not (claim.get("status") or {}).get("allocation") and not meta.get("deletionTimestamp")


def pod_claim_names(pod: dict[str, Any]) -> list[str] | None:
    """The claims a pod uses, or None while one made from a template has no name yet."""
    names = _claim_names(pod)
    return None if None in names else [name for name in names if name is not None]


def known_claim_names(pod: dict[str, Any]) -> list[str]:
    """The claims a pod uses that have a name so far (one made from a template once the pod's
    status names it)."""
    return [name for name in _claim_names(pod) if name is not None]


def _claim_names(pod: dict[str, Any]) -> list[str | None]:
    statuses = {
        s["name"]: s.get("resourceClaimName") for s in (pod.get("status") or {}).get("resourceClaimStatuses") or ()
    }
    refs = (pod.get("spec") or {}).get("resourceClaims") or ()
    return [ref.get("resourceClaimName") or statuses.get(ref.get("name")) or None for ref in refs]


def gang_of(claim: Claim) -> tuple[str, int] | None:
    """The claim's gang (namespace/name) and its size; size 0 when the size label is not a number
    (reported, never placed)."""
    name = claim.labels.get(GANG_LABEL)
    if not name:
        return None
    return f"{claim.namespace}/{name}", gang_size(claim.labels)


def gang_label(claim: dict[str, Any]) -> str | None:
    return (claim["metadata"].get("labels") or {}).get(GANG_LABEL)


def gang_size(labels: dict[str, str]) -> int:
    try:
        return max(1, int(labels.get(GANG_SIZE_LABEL, "1")))
    except ValueError:
        return 0


def gated(pod: dict[str, Any]) -> bool:
    return any(g.get("name") == SCHEDULING_GATE for g in (pod.get("spec") or {}).get("schedulingGates") or ())


def held_by_another_gate(pod: dict[str, Any]) -> bool:
    """Whether the pod carries a scheduling gate besides fgpu's (Kueue's admission gate, say):
    kube-scheduler will not bind it, so devices placed for it now would be held for nothing, and
    outside the quota the other gate's owner enforces."""
    return any(g.get("name") != SCHEDULING_GATE for g in (pod.get("spec") or {}).get("schedulingGates") or ())


def claimless(pod: dict[str, Any]) -> bool:
    return not (pod.get("spec") or {}).get("resourceClaims")


class PodRef(NamedTuple):
    key: str  # namespace/name
    uid: str


def owner_pod(claim: dict[str, Any]) -> PodRef | None:
    """The pod that owns the claim: the one kube-controller-manager made it for, from that pod's
    ResourceClaimTemplate; None for a claim made on its own."""
    meta = claim.get("metadata") or {}
    for ref in meta.get("ownerReferences") or ():
        if isinstance(ref, dict) and ref.get("kind") == "Pod" and ref.get("controller") and ref.get("name"):
            return PodRef(f"{meta.get('namespace', '')}/{ref['name']}", str(ref.get("uid", "")))
    return None


def places_pods(namespace: dict[str, Any]) -> bool:
    """Whether a Namespace opts its pods without claims in (PLACE_PODS_LABEL)."""
    labels = (namespace.get("metadata") or {}).get("labels") or {}
    return labels.get(PLACE_PODS_LABEL) == PLACE_PODS_VALUE


def daemonset_pod(pod: dict[str, Any]) -> bool:
    """Whether a DaemonSet owns the pod (it runs on its node whatever is placed there)."""
    refs = (pod.get("metadata") or {}).get("ownerReferences") or ()
    return any(isinstance(r, dict) and r.get("kind") == "DaemonSet" for r in refs)


def placement_exempt(pod: dict[str, Any]) -> str | None:
    """Why a pod without claims is never placed by the controller, even in an opted-in namespace
    (None: it may be): it is bound already, a DaemonSet's (pinned to its node by the DaemonSet
    controller), in kube-system, for another scheduler, or in a PodGroup (kube-scheduler's gang)."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    if spec.get("nodeName"):
        return "spec.nodeName is set"
    if daemonset_pod(pod):
        return "a DaemonSet's pod"
    if meta.get("namespace") == SYSTEM_NAMESPACE:
        return f"in {SYSTEM_NAMESPACE}"
    if spec.get("schedulerName", DEFAULT_SCHEDULER) != DEFAULT_SCHEDULER:
        return f"spec.schedulerName is {spec.get('schedulerName')!r}"
    if spec.get("schedulingGroup"):
        return "in a PodGroup (spec.schedulingGroup)"
    return None
