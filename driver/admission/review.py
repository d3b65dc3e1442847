"""Admission review of fgpu's opaque device configs (pure: AdmissionReview in, response out).

ResourceClaims, ResourceClaimTemplates and DeviceClasses carry `opaque` configs for a driver; those
for ours are checked with the very rules prepare applies (driver/claims/config.py), so a bad
config is refused at `kubectl apply`, naming the field, instead of failing the pod at start.
A claim's or template's own config may not set what only a DeviceClass sets (the GPU-wide
time-slice interval, the tenancy). What depends on the allocated device (a limit within the
allocated capacity, a strategy that fits the device's kind) is known only at prepare, and checked
there.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from driver.claims.config import DeviceConfig, parse_device_config
from driver.claims.refs import ClaimError

REVIEW_API_VERSION = "admission.k8s.io/v1"

# Where each kind keeps its list of device configs.
CONFIG_PATHS: dict[str, tuple[str, ...]] = {
    "ResourceClaim": ("spec", "devices", "config"),
    "ResourceClaimTemplate": ("spec", "spec", "devices", "config"),
    "DeviceClass": ("spec", "config"),
}

# Kinds whose configs are a claim's (source FromClaim at prepare), not a class's.
CLAIM_KINDS = frozenset({"ResourceClaim", "ResourceClaimTemplate"})


class ReviewError(ValueError):
    """The request is not an AdmissionReview this webhook can answer."""


def config_errors(kind: str, obj: dict[str, Any], driver: str) -> list[str]:
    """One line per bad opaque config of `driver` in the object, each naming its field."""
    path = CONFIG_PATHS.get(kind)
    if path is None:
        return []
    configs: Any = obj
    for key in path:
        configs = configs.get(key) if isinstance(configs, dict) else None
    errors = []
    for index, entry in enumerate(configs if isinstance(configs, list) else []):
        opaque = entry.get("opaque") if isinstance(entry, dict) else None
        if not isinstance(opaque, dict) or opaque.get("driver") != driver:
            continue  # another driver's config, or none: not ours to judge
        field = ".".join(path) + f"[{index}].opaque.parameters"
        try:
            parsed = parse_device_config(opaque.get("parameters"))
        except ClaimError as err:
            errors.append(f"{field}: {err}")
            continue
        if kind in CLAIM_KINDS:
            errors.extend(f"{field}: {error}" for error in class_only_errors(parsed))
    return errors


def class_only_errors(parsed: DeviceConfig) -> list[str]:
    """What a claim's config sets that only a DeviceClass may. Prepare refuses a claim's tenancy, and
    a claim's interval that differs from its class's; the class is unknown here, so any interval is
    refused: a GPU-wide setting is the administrator's, and a claim that repeats it gains nothing."""
    fields = {"sharing.timeSlicing.interval": parsed.interval, "sharing.tenancy": parsed.tenancy}
    return [
        f"opaque config: {field} is set by the device class only; remove it from the claim"
        for field, value in fields.items()
        if value is not None
    ]


def admission_request(document: Any) -> dict[str, Any]:
    """The request of an AdmissionReview; ReviewError when `document` is not one."""
    request = document.get("request") if isinstance(document, dict) else None
    if not isinstance(request, dict) or not request.get("uid"):
        raise ReviewError("not an AdmissionReview with a request uid")
    if not isinstance(request.get("kind") or {}, dict):
        raise ReviewError("request.kind must be an object (group, version, kind)")
    if document.get("apiVersion") != REVIEW_API_VERSION:
        raise ReviewError(
            f"AdmissionReview apiVersion must be {REVIEW_API_VERSION}, got {document.get('apiVersion')!r}"
        )
    return request


def review(document: Any, driver: str) -> dict[str, Any]:
    """The AdmissionReview answering `document` (an AdmissionReview with a request)."""
    request = admission_request(document)
    kind = (request.get("kind") or {}).get("kind", "")
    obj = request.get("object")
    if not isinstance(obj, dict):
        obj = {}
    errors = config_errors(kind, obj, driver)
    response: dict[str, Any] = {"uid": request["uid"], "allowed": not errors}
    if errors:
        name = (obj.get("metadata") or {}).get("name") or (obj.get("metadata") or {}).get("generateName", "")
        response["status"] = {
            "code": 422,
            "reason": "Invalid",
            "message": f"{kind} {name}: " + "; ".join(errors),
        }
    return {"apiVersion": REVIEW_API_VERSION, "kind": "AdmissionReview", "response": response}


def allowed(
    request: dict[str, Any], patch: list[dict[str, Any]] | None = None, warnings: list[str] | None = None
) -> dict[str, Any]:
    """The AdmissionReview that admits the request, with a JSON patch and warnings where given (the
    mutating webhooks' answer)."""
    response: dict[str, Any] = {"uid": request["uid"], "allowed": True}
    if patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
    if warnings:
        response["warnings"] = warnings
    return {"apiVersion": REVIEW_API_VERSION, "kind": "AdmissionReview", "response": response}
