"""What a pod gets at create (POST /mutate): the scheduling gate of opt-in claims, the toleration
of the nodes kept for pods with GPUs; and the gate for pods without claims (POST /place-pods).

A pod that uses an opt-in claim (labelled `gpu.fgpu.dev/allocator: fgpu`, driver/scheduling/opt_in.py)
gets the gate `gpu.fgpu.dev/allocation` (--gate-pods), so that kube-scheduler leaves it to fgpu's
controller, as if its author had written the gate. A claim by name (`resourceClaimName`) is read; one
made from a template (`resourceClaimTemplateName`) does not exist yet at pod create (kube-controller-
manager makes it afterwards, with the template's `spec.metadata.labels` and `spec.spec`), so the
template is read. With --gpu-pods-toleration KEY, a pod one of whose claims asks for fgpu's devices
also gets the toleration of the taint KEY (driver/admission/gpu_pods_only.py). Each claim is read
once, for both, and no more of them than MAX_CLAIMS_READ.

Never a refusal: a pod that uses no opt-in claim, a claim or template not found, or an API server
that cannot be read is admitted unchanged (logged), and kube-scheduler allocates its claims as it
would without fgpu's controller. A pod already carrying the gate, or a toleration of the taint, is
not given another.

POST /place-pods: the configuration's second rule, which kube-apiserver sends only the pods of
namespaces labelled `gpu.fgpu.dev/place-pods=fgpu` (its namespaceSelector: the label is the
platform team's, checked there and again by the controller). A pod without claims gets the gate,
and the controller places it (driver/controller/placed_pods.py); nothing is read from the API. A
pod with claims, or one that is never placed so (driver/scheduling/opt_in.py, placement_exempt:
bound already, a DaemonSet's, in kube-system, another scheduler's, in a PodGroup), is left as it
came, whatever the configuration sends.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from driver.admission.gpu_pods_only import tolerates, toleration_patch
from driver.admission.review import admission_request, allowed
from driver.claims.classes import asks_for_ours
from driver.common.flags import DEFAULT_DRIVER_NAME
from driver.kube.errors import KubeError
from driver.scheduling.opt_in import SCHEDULING_GATE, claimless, gated, opted_in, placement_exempt

LOG = logging.getLogger("fgpu.webhook")
# kube-apiserver sets no limit on a pod's resourceClaims, and each one named is a GET while the
# pod's create waits (timeoutSeconds 5): the claims past these are not read.
MAX_CLAIMS_READ = 32


class ClaimReader(Protocol):
    """Reads one claim or template; None when it does not exist, KubeError when it cannot be read."""

    def read_claim(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    def read_claim_template(self, namespace: str, name: str) -> dict[str, Any] | None: ...


@dataclass(frozen=True)
class PodRules:
    """What POST /mutate adds to a pod at create (the webhook's flags)."""

    gate: bool = True  # --gate-pods: the scheduling gate, where a claim opts in
    gpu_pods_toleration: str = ""  # --gpu-pods-toleration: this taint tolerated, where a claim asks for our devices
    driver: str = DEFAULT_DRIVER_NAME  # whose device classes are ours (driver/claims/classes.py)


@dataclass(frozen=True)
class PodClaim:
    """A claim a pod names, as read: the claim itself, or the template it will be made from."""

    what: str  # "ResourceClaim NS/NAME" or "ResourceClaimTemplate NS/NAME", for the log
    found: bool
    opted_in: bool
    spec: Any  # the claim's spec (a template's spec.spec), None when not found


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


def pod_claims(pod: dict[str, Any], namespace: str, reader: ClaimReader) -> Iterator[PodClaim]:
    """The claims the pod names, read one at a time as the caller asks (each once, MAX_CLAIMS_READ at most)."""
    seen: set[tuple[str, str]] = set()
    for ref in (pod.get("spec") or {}).get("resourceClaims") or ():
        if not isinstance(ref, dict):
            continue
        if isinstance(name := ref.get("resourceClaimName"), str) and name:
            kind = "ResourceClaim"
        elif isinstance(name := ref.get("resourceClaimTemplateName"), str) and name:
            kind = "ResourceClaimTemplate"
        else:
            continue
        if (kind, name) in seen:
            continue
        if len(seen) == MAX_CLAIMS_READ:
            LOG.info("pod in %s names more than %d claims: the others are not read", namespace, MAX_CLAIMS_READ)
            return
        seen.add((kind, name))
        if kind == "ResourceClaim":
            obj = reader.read_claim(namespace, name)
            spec, yes = (obj or {}).get("spec"), obj is not None and opted_in(obj)
        else:
            obj = reader.read_claim_template(namespace, name)
            spec, yes = ((obj or {}).get("spec") or {}).get("spec"), obj is not None and template_opted_in(obj)
        yield PodClaim(f"{kind} {namespace}/{name}", obj is not None, yes, spec)


@dataclass
class _Found:
    """What the pod's claims asked for, as they are read."""

    gate: str | None = None  # the claim that opts in
    toleration: str | None = None  # the claim that asks for our devices
    not_gated: list[str] = field(default_factory=list)  # why each claim read does not opt in


def _read(pod: dict[str, Any], namespace: str, reader: ClaimReader, gate: bool, key: str, driver: str) -> _Found:
    """Claims read until each rule wanted (`gate`, a toleration of `key`) has its answer."""
    found = _Found()
    for claim in pod_claims(pod, namespace, reader):
        if gate and found.gate is None:
            if claim.opted_in:
                found.gate = claim.what
            else:
                found.not_gated.append(f"{claim.what} {'not opted in' if claim.found else 'not found'}")
        if key and found.toleration is None and asks_for_ours(claim.spec, driver):
            found.toleration = claim.what
        if (found.gate or not gate) and (found.toleration or not key):
            break
    return found


def _created_pod(request: dict[str, Any]) -> tuple[dict[str, Any], str, str] | None:
    """(the pod, its namespace, its name for the log) of a pod's CREATE, else None."""
    pod = request.get("object")
    if not isinstance(pod, dict):
        pod = {}
    kind = (request.get("kind") or {}).get("kind", "")
    if kind != "Pod" or request.get("operation", "CREATE") != "CREATE":
        return None
    meta = pod.get("metadata") or {}
    namespace = request.get("namespace") or meta.get("namespace") or ""
    return pod, namespace, f"{namespace}/{meta.get('name') or meta.get('generateName', '') + '*'}"


def mutate(document: Any, reader: ClaimReader, rules: PodRules = PodRules()) -> dict[str, Any]:
    """The AdmissionReview answering a pod's CREATE: allowed, with the gate's patch where a claim
    opts in and the toleration's where one asks for our devices (as `rules` say)."""
    request = admission_request(document)
    if (created := _created_pod(request)) is None:
        return allowed(request)
    pod, namespace, name = created
    gate = rules.gate and not gated(pod)
    key = (
        rules.gpu_pods_toleration if rules.gpu_pods_toleration and not tolerates(pod, rules.gpu_pods_toleration) else ""
    )
    if not (gate or key):
        return allowed(request)
    try:
        found = _read(pod, namespace, reader, gate, key, rules.driver)
    except KubeError as err:  # never a refusal for our own read failure: kube-scheduler allocates
        LOG.warning("pod %s admitted unchanged: cannot read its claims: %s", name, err)
        return allowed(request)
    patch: list[dict[str, Any]] = []
    if found.gate is not None:
        LOG.info("pod %s gated (%s): %s opts in", name, SCHEDULING_GATE, found.gate)
        patch += gate_patch(pod)
    elif gate:
        LOG.info("pod %s not gated: %s", name, "; ".join(found.not_gated) or "no claim named")
    if found.toleration is not None:
        LOG.info("pod %s tolerates the taint %s: %s asks for %s's devices", name, key, found.toleration, rules.driver)
        patch += toleration_patch(pod, key)
    return allowed(request, patch)


def review_result(answer: dict[str, Any]) -> str:
    """The metrics' `result` of a /mutate answer: "gated" where its patch adds the scheduling gate,
    "tolerated" where it adds only the toleration, else "allowed"."""
    response = answer["response"]
    if "patch" not in response:
        return "allowed"
    paths = [op["path"] for op in json.loads(base64.b64decode(response["patch"]))]
    return "gated" if any(p.startswith("/spec/schedulingGates") for p in paths) else "tolerated"


def place_pods(document: Any) -> dict[str, Any]:
    """The AdmissionReview answering a pod's CREATE in a namespace whose pods without claims the
    controller places: allowed, with the gate's patch where the pod has no claims and is not exempt."""
    request = admission_request(document)
    if (created := _created_pod(request)) is None:
        return allowed(request)
    pod, namespace, name = created
    if gated(pod) or not claimless(pod):
        return allowed(request)  # gated by its author; or its claims decide (POST /mutate)
    exempt = placement_exempt({**pod, "metadata": {**(pod.get("metadata") or {}), "namespace": namespace}})
    if exempt is not None:
        LOG.info("pod %s not gated for placement: %s", name, exempt)
        return allowed(request)
    LOG.info("pod %s gated (%s): the controller places the pods of namespace %s", name, SCHEDULING_GATE, namespace)
    return allowed(request, gate_patch(pod))
