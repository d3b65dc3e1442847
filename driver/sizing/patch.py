"""Recommendations as JSON Patches (RFC 6902) to ResourceClaimTemplates: `kubectl patch
resourceclaimtemplate NAME -n NS --type json -p PATCH`. Each patch first tests the request's device
class, so a template changed since the history was sampled is refused rather than mangled. A
template shared by several workloads gets the largest of their sizes: one patch per request."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from driver.sizing.recommend import Recommendation
from driver.sizing.request import capacity_requests, resize_ops
from driver.sizing.sizes import DEVICE_CLASSES, capacity_key, gpu_model


@dataclass(frozen=True)
class TemplatePatch:
    namespace: str
    template: str
    patch: tuple[dict[str, Any], ...]


def template_patches(recommendations: Iterable[Recommendation]) -> list[TemplatePatch]:
    """One patch per template with changed requests (pinned and unchanged ones are left out)."""
    chosen: dict[tuple[str, str, int], Recommendation] = {}
    for rec in recommendations:
        if not rec.changed:
            continue
        slot = (rec.key.namespace, rec.key.template, rec.request_index)
        if slot not in chosen or _bigness(rec) > _bigness(chosen[slot]):
            chosen[slot] = rec
    ops: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for (namespace, template, _), rec in sorted(chosen.items()):
        ops.setdefault((namespace, template), []).extend(request_ops(rec))
    return [TemplatePatch(ns, name, tuple(patch)) for (ns, name), patch in ops.items()]


def request_ops(rec: Recommendation) -> list[dict[str, Any]]:
    """The operations that turn the template's request into the recommended size."""
    base = f"/spec/spec/devices/requests/{rec.request_index}/exactly"
    current = rec.current
    test = {"op": "test", "path": f"{base}/deviceClassName", "value": DEVICE_CLASSES[current.kind]}
    return [test, *resize_ops(base, current, rec.recommended, rec.gpu, capacity_requests(current))]


def _bigness(rec: Recommendation) -> tuple[int, float, float]:
    return capacity_key(rec.recommended, gpu_model(rec.gpu))
