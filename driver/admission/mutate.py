"""Opt-in without editing pods: the scheduling gate added at pod create (POST /mutate, and POST
/place-pods for pods without claims).

A pod that uses an opt-in claim (labelled `gpu.fgpu.dev/allocator: fgpu`, driver/scheduling/opt_in.py)
gets the gate `gpu.fgpu.dev/allocation`, so that kube-scheduler leaves it to fgpu's controller, as
if its author had written the gate. A claim by name (`resourceClaimName`) is read; one made from a
template (`resourceClaimTemplateName`) does not exist yet at pod create (kube-controller-manager makes
it afterwards, with the template's `spec.metadata.labels`), so the template is read.

Never a refusal: a pod that uses no opt-in claim, a claim or template not found, or an API server
that cannot be read is admitted unchanged (logged), and kube-scheduler allocates its claims as it
would without fgpu's controller. A pod already carrying the gate is left as it is.

POST /place-pods: the configuration's second rule, which kube-apiserver sends only the pods of
namespaces labelled `gpu.fgpu.dev/place-pods=fgpu` (its namespaceSelector: the label is the
platform team's, checked there and again by the controller). A pod without claims gets the gate,
and the controller places it (driver/controller/placed_pods.py); nothing is read from the API. A
pod with claims, or one that is never placed so (driver/scheduling/opt_in.py, placement_exempt:
bound already, a DaemonSet's, in kube-system, another scheduler's, in a PodGroup), is left as it
came, whatever the configuration sends.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from driver.admission.review import admission_request, allowed
from driver.kube.errors import KubeError
from driver.scheduling.opt_in import SCHEDULING_GATE, claimless, gated, opted_in, placement_exempt

LOG = logging.getLogger("fgpu.webhook")


class ClaimReader(Protocol):
    """Reads one claim or template; None when it does not exist, KubeError when it cannot be read."""

    def read_claim(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    def read_claim_template(self, namespace: str, name: str) -> dict[str, Any] | None: ...


def gate_patch(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON patch adding fgpu's scheduling gate (none when the pod has it already)."""
    if gated(pod):
        return []
    gate = {"name": SCHEDULING_GATE}
    if (pod.get("spec") or {}).get("schedulingGates"):
        return [{"op": "add", "path": "/spec/schedulingGates/-", "value": gate}]
    return [{"op": "add", "path": "/spec/schedulingGates", "value": [gate]}]


def template_opted_in(template: dict[str, Any]) -> bool:
    """Whether the claims made from this template carry the opt-in label."""
    return opted_in(template.get("spec") or {})  # its spec.metadata is the claims' metadata


def opt_in_reason(pod: dict[str, Any], namespace: str, reader: ClaimReader) -> tuple[str | None, str]:
    """(the opt-in claim or template that asks for the gate, or None; why not, for the log)."""
    why = []
    for ref in (pod.get("spec") or {}).get("resourceClaims") or ():
        if not isinstance(ref, dict):
            continue
        if name := ref.get("resourceClaimName"):
            what, obj = f"ResourceClaim {namespace}/{name}", reader.read_claim(namespace, name)
            yes = obj is not None and opted_in(obj)
        elif name := ref.get("resourceClaimTemplateName"):
            what, obj = f"ResourceClaimTemplate {namespace}/{name}", reader.read_claim_template(namespace, name)
            yes = obj is not None and template_opted_in(obj)
        else:
            continue
        if yes:
            return what, ""
        why.append(f"{what} {'not found' if obj is None else 'not opted in'}")
    return None, "; ".join(why) or "no claim named"


def _created_pod(request: dict[str, Any]) -> tuple[dict[str, Any], str, str] | None:
    """(the pod, its namespace, its name for the log) of a pod's CREATE not gated yet, else None."""
    pod = request.get("object")
    if not isinstance(pod, dict):
        pod = {}
    kind = (request.get("kind") or {}).get("kind", "")
    if kind != "Pod" or request.get("operation", "CREATE") != "CREATE" or gated(pod):
        return None
    meta = pod.get("metadata") or {}
    namespace = request.get("namespace") or meta.get("namespace") or ""
    return pod, namespace, f"{namespace}/{meta.get('name') or meta.get('generateName', '') + '*'}"


def mutate(document: Any, reader: ClaimReader) -> dict[str, Any]:
    """The AdmissionReview answering a pod's CREATE: allowed, with the gate's patch where it opts in."""
    request = admission_request(document)
    if (created := _created_pod(request)) is None:
        return allowed(request)
    pod, namespace, name = created
    try:
        source, why = opt_in_reason(pod, namespace, reader)
    except KubeError as err:  # never a refusal for our own read failure: kube-scheduler allocates
        LOG.warning("pod %s admitted without the scheduling gate: cannot read its claims: %s", name, err)
        source, why = None, ""
    if source is None:
        if why:
            LOG.info("pod %s not gated: %s", name, why)
        return allowed(request)
    LOG.info("pod %s gated (%s): %s opts in", name, SCHEDULING_GATE, source)
    return allowed(request, gate_patch(pod))


def place_pods(document: Any) -> dict[str, Any]:
    """The AdmissionReview answering a pod's CREATE in a namespace whose pods without claims the
    controller places: allowed, with the gate's patch where the pod has no claims and is not exempt."""
    request = admission_request(document)
    if (created := _created_pod(request)) is None:
        return allowed(request)
    pod, namespace, name = created
    if not claimless(pod):
        return allowed(request)  # its claims decide (POST /mutate)
    exempt = placement_exempt({**pod, "metadata": {**(pod.get("metadata") or {}), "namespace": namespace}})
    if exempt is not None:
        LOG.info("pod %s not gated for placement: %s", name, exempt)
        return allowed(request)
    LOG.info("pod %s gated (%s): the controller places the pods of namespace %s", name, SCHEDULING_GATE, namespace)
    return allowed(request, gate_patch(pod))
