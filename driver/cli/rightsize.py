"""`fgpu rightsize`'s output (pure): recommendations as a table, as JSON, or as JSON Patches to
the claim templates (driver/sizing/patch.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict

from driver.sizing.patch import template_patches
from driver.sizing.recommend import Recommendation

HEADER = ("NAMESPACE", "WORKLOAD", "TEMPLATE/REQUEST", "CURRENT", "RECOMMENDED", "GPU-H FREED/DAY", "CONFIDENCE", "WHY")


def render_table(recommendations: Sequence[Recommendation]) -> str:
    rows = [HEADER] + [
        (
            r.key.namespace,
            f"{r.key.workload.kind}/{r.key.workload.name}",
            f"{r.key.template}/{r.key.request}",
            r.current.describe(),
            r.recommended.describe() if r.changed else "-",
            f"{r.gpu_hours_freed_per_day:.2f}",
            f"{r.confidence:.0%}",
            r.reason,
        )
        for r in recommendations
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    return "".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + "\n" for row in rows
    )


def render_json(recommendations: Sequence[Recommendation]) -> str:
    return json.dumps([asdict(r) | {"changed": r.changed} for r in recommendations], indent=2) + "\n"


def render_patch(recommendations: Sequence[Recommendation]) -> str:
    patches = [
        {"namespace": p.namespace, "resourceClaimTemplate": p.template, "patch": list(p.patch)}
        for p in template_patches(recommendations)
    ]
    return json.dumps(patches, indent=2) + "\n"


RENDERERS: dict[str, Callable[[Sequence[Recommendation]], str]] = {
    "table": render_table,
    "json": render_json,
    "patch": render_patch,
}
