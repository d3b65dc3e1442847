"""`fgpu status --idle` and `--by namespace`: what the node plugins' metrics say teams used and
which claims sit idle. Reads each plugin's /metrics (`--metrics`, repeatable: one per node), so it
reports since each plugin started (its counters' lifetime), not over a Prometheus window: for
that, the dashboard's per-team row queries Prometheus (docs/kueue.md, Cost and idle capacity).
"""

from __future__ import annotations

import datetime
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from driver.cli.status import render_json, render_yaml, table

GPU_SECONDS = "fgpu_gpu_seconds_total"
IDLE_SECONDS = "fgpu_claim_idle_seconds"
LAST_USED = "fgpu_claim_last_used_timestamp_seconds"


class MetricsReadError(RuntimeError):
    pass


@dataclass(frozen=True)
class IdleClaim:
    node: str
    claim: str  # namespace/name
    pods: list[str]
    kind: str
    device: str
    idle_s: float
    since: str  # RFC 3339, UTC: the last use, or when the plugin first saw the claim held


@dataclass(frozen=True)
class NamespaceUsage:
    namespace: str
    kind: str
    gpu_hours: float


@dataclass(frozen=True)
class IdleReport:
    idle_claims: list[IdleClaim]


@dataclass(frozen=True)
class NamespaceReport:
    namespaces: list[NamespaceUsage]


def read_metrics(url: str, timeout_s: float = 10.0) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read().decode()
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise MetricsReadError(f"--metrics {url}: cannot read it: {getattr(err, 'reason', err)}") from err


def _samples(texts: Iterable[str], names: set[str]) -> list[tuple[str, dict[str, str], float]]:
    return [
        (sample.name, sample.labels, sample.value)
        for text in texts
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in names
    ]


def idle_claims(texts: Iterable[str], longer_than_s: float) -> IdleReport:
    """Claims held but idle for at least `longer_than_s`, most idle first: one row per device of
    a claim, with every pod that holds it."""
    rows: dict[tuple[str, ...], dict] = {}
    for name, labels, value in _samples(texts, {IDLE_SECONDS, LAST_USED}):
        key = tuple(labels[k] for k in ("node", "claim_namespace", "claim", "kind", "device"))
        row = rows.setdefault(key, {"pods": set()})
        if labels["claim_pod"]:
            row["pods"].add(f"{labels['claim_namespace']}/{labels['claim_pod']}")
        row["idle_s" if name == IDLE_SECONDS else "last_used"] = value
    found = [
        IdleClaim(
            node=node,
            claim=f"{namespace}/{claim}",
            pods=sorted(row["pods"]),
            kind=kind,
            device=device,
            idle_s=row["idle_s"],
            since=_timestamp(row["last_used"]),
        )
        for (node, namespace, claim, kind, device), row in rows.items()
        if "idle_s" in row and "last_used" in row and row["idle_s"] >= longer_than_s
    ]
    return IdleReport(sorted(found, key=lambda c: (-c.idle_s, c.claim, c.device)))


def usage_by_namespace(texts: Iterable[str]) -> NamespaceReport:
    """GPU-hours by namespace and kind, summed over the nodes' plugins."""
    hours: dict[tuple[str, str], float] = {}
    for _, labels, value in _samples(texts, {GPU_SECONDS}):
        key = (labels["claim_namespace"], labels["kind"])
        hours[key] = hours.get(key, 0.0) + value / 3600
    return NamespaceReport([NamespaceUsage(ns, kind, value) for (ns, kind), value in sorted(hours.items())])


def _timestamp(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _duration(seconds: float) -> str:
    minutes = int(seconds // 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{int(seconds % 60):02d}s"


def render_idle(report: IdleReport, output: str) -> str:
    if output != "table":
        return STRUCTURED[output](report)
    rows = [
        [c.claim, c.node, f"{c.kind} {c.device}", ", ".join(c.pods) or "-", _duration(c.idle_s), c.since]
        for c in report.idle_claims
    ]
    return "\n".join(table(["CLAIM", "NODE", "HOLDS", "PODS", "IDLE", "SINCE"], rows)) + "\n"


def render_by_namespace(report: NamespaceReport, output: str) -> str:
    if output != "table":
        return STRUCTURED[output](report)
    totals: dict[str, float] = {}
    for entry in report.namespaces:
        totals[entry.namespace] = totals.get(entry.namespace, 0.0) + entry.gpu_hours
    rows = [[u.namespace, u.kind, f"{u.gpu_hours:.3f}"] for u in report.namespaces]
    rows += [[namespace, "all", f"{hours:.3f}"] for namespace, hours in sorted(totals.items())]
    return "\n".join(table(["NAMESPACE", "KIND", "GPU-HOURS"], rows)) + "\n"


STRUCTURED = {"json": render_json, "yaml": render_yaml}
