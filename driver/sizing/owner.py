"""Whose a claim is, for sizing (pure: API objects as the server sends them, in; names out): the
workload that owns the claim's pods, and the claim template and request the claim came from.

The owner comes from the pod alone, with no read of its owners: a pod of a Deployment is owned by a
ReplicaSet named `<deployment>-<pod-template-hash>`, and carries that hash as a label, so the
Deployment's name is the ReplicaSet's without it (a ReplicaSet of its own keeps its name, as it has
no such label). A Job of a JobSet (or a LeaderWorkerSet's StatefulSet) names its set in a label of
the pod. Every other controller owner (StatefulSet, DaemonSet, Job, ...) is the workload as it is;
a pod without one is its own.
"""

from __future__ import annotations

from typing import Any

from driver.sizing.history import Workload

POD_TEMPLATE_HASH = "pod-template-hash"
POD_CLAIM_NAME = "resource.kubernetes.io/pod-claim-name"  # on a claim made from a pod's template
SET_LABELS = {  # a pod's label -> the kind of the set above its controller
    "jobset.sigs.k8s.io/jobset-name": "JobSet",
    "leaderworkerset.sigs.k8s.io/name": "LeaderWorkerSet",
}

JsonObject = dict[str, Any]


def workload_of(pod: JsonObject) -> Workload:
    """The workload at the top of the pod's ownership chain (the module's rule)."""
    metadata = pod.get("metadata") or {}
    labels = metadata.get("labels") or {}
    for label, kind in SET_LABELS.items():
        if labels.get(label):
            return Workload(kind, str(labels[label]))
    controller = next((r for r in metadata.get("ownerReferences") or () if r.get("controller")), None)
    if controller is None:
        return Workload("Pod", str(metadata.get("name", "")))
    kind, name = str(controller.get("kind", "")), str(controller.get("name", ""))
    suffix = f"-{labels.get(POD_TEMPLATE_HASH, '')}"
    if kind == "ReplicaSet" and labels.get(POD_TEMPLATE_HASH) and name.endswith(suffix):
        return Workload("Deployment", name[: -len(suffix)])
    return Workload(kind, name)


def template_of(pod: JsonObject, claim: JsonObject) -> str:
    """The ResourceClaimTemplate the claim was made from for this pod; "" for a claim not made
    from a template (not sized: nothing to patch)."""
    pod_claim = ((claim.get("metadata") or {}).get("annotations") or {}).get(POD_CLAIM_NAME)
    if not pod_claim:
        return ""
    for entry in (pod.get("spec") or {}).get("resourceClaims") or ():
        if entry.get("name") == pod_claim:
            return str(entry.get("resourceClaimTemplateName") or "")
    return ""


def request_index(claim: JsonObject, request: str) -> int:
    """The request's place in the claim's spec (a patch to its template names it by index); -1
    where the claim has no such request."""
    requests = ((claim.get("spec") or {}).get("devices") or {}).get("requests") or ()
    names = [str(r.get("name")) for r in requests]
    return names.index(request) if request in names else -1
