"""How claims and pods ask for the controller: its labels, its scheduling gate, and what they say.

Claims opt in with the label `gpu.fgpu.dev/allocator=fgpu` (set it on a ResourceClaimTemplate's
metadata and every claim made from it carries it). Their pods carry the scheduling gate
`gpu.fgpu.dev/allocation`, so kube-scheduler leaves them alone until the controller has written
every claim's allocation; it then lifts the gate and kube-scheduler binds the pod to the node the
allocation names. Gangs: claims labelled `gpu.fgpu.dev/gang=<name>` and `gpu.fgpu.dev/gang-size=<n>`
are allocated together once all n exist, all or none (upstream PodGroups with a gang policy are
gangs too: driver/controller/groups.py).

Read by the controller, by the admission webhook (it gates the pods of opt-in claims) and by
`fgpu plan`, which plans claims as the controller would: below all three."""

from __future__ import annotations

from typing import Any

from driver.allocator.model import Claim

OPT_IN_LABEL = "gpu.fgpu.dev/allocator"
OPT_IN_VALUE = "fgpu"
GANG_LABEL = "gpu.fgpu.dev/gang"
GANG_SIZE_LABEL = "gpu.fgpu.dev/gang-size"
SCHEDULING_GATE = "gpu.fgpu.dev/allocation"
MOVABLE_ANNOTATION = "gpu.fgpu.dev/movable"  # on a pod: the controller may move it to make room


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
