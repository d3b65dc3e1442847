"""The usage history: per claim, a bounded summary of what its processes used, in time buckets.

Samples (memory in use, compute activity in percent of the GPU's SMs, out-of-memory seen) go in;
each claim keeps one bucket per hour for the last day and one per day before that, for a week, so
a claim costs at most 24 + 7 buckets of 8 numbers whatever the sample rate. A bucket keeps the
sample count, the peak and 95th percentile of memory and of compute, and the out-of-memory count.

Percentiles do not merge exactly; merged buckets (a roll-up of hours into a day, two sources of the
same hour) keep the larger 95th percentile, which is never below the 95th percentile of the union
(each part has 95% of its samples at or below its own), so sizing from them errs towards bigger.
Merging adds sample counts: it is for disjoint samples (different nodes, different hours).

Serialized as JSON, `apiVersion: gpu.fgpu.dev/v1alpha1`, `kind: UsageHistory`, one row of numbers
per bucket (docs/rightsizing.md: where it lives, and how big it gets).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from driver.inventory.sharing import DeviceKind
from driver.sizing.sizes import DEVICE_CLASSES, Size

API_VERSION = "gpu.fgpu.dev/v1alpha1"
KIND = "UsageHistory"
HOUR_S = 3600
DAY_S = 24 * HOUR_S
FINE_FOR_S = DAY_S  # hourly buckets this far back, daily ones before
RETENTION_S = 7 * DAY_S
DEFAULT_SAMPLE_S = 10
QUANTILE = 0.95


class HistoryError(ValueError):
    """A usage history that cannot be read or combined, with the reason."""


@dataclass(frozen=True)
class Workload:
    """The owner of a claim's pods at the top of the chain (a Deployment, not its ReplicaSet), or
    the pod itself when nothing owns it."""

    kind: str
    name: str


@dataclass(frozen=True)
class ClaimRecord:
    """Who a claim is and what it asked for, as the plugin saw it when it sampled the claim.
    `original`: the request before automatic sizing changed it (the webhook's annotation), if any;
    `pinned`: the claim carries `gpu.fgpu.dev/rightsize: "off"` (from its template)."""

    uid: str
    namespace: str
    claim: str
    workload: Workload
    template: str
    request: str
    request_index: int
    gpu: str  # the product name, e.g. "NVIDIA H100 80GB HBM3"
    size: Size
    pinned: bool = False
    original: Size | None = None


@dataclass(frozen=True)
class Sample:
    """What the claim's processes used at one instant."""

    claim_uid: str
    at: float  # unix seconds
    memory_mib: int
    compute_percent: float  # of the GPU's SMs
    oom: bool = False  # an out-of-memory seen in the claim's processes since the last sample


@dataclass(frozen=True)
class Bucket:
    start: int
    seconds: int
    samples: int
    memory_peak_mib: int
    memory_p95_mib: int
    compute_p95: float
    compute_peak: float
    ooms: int = 0

    @property
    def end(self) -> int:
        return self.start + self.seconds


@dataclass(frozen=True)
class ClaimHistory:
    record: ClaimRecord
    buckets: tuple[Bucket, ...]  # by start

    @property
    def last_seen(self) -> int:
        return self.buckets[-1].end if self.buckets else 0


@dataclass(frozen=True)
class UsageHistory:
    sample_seconds: int = DEFAULT_SAMPLE_S  # what one sample stands for: the plugin's sampling period
    claims: Mapping[str, ClaimHistory] = field(default_factory=dict)


def summarize(samples: Sequence[Sample], start: int, seconds: int) -> Bucket:
    """One bucket from its raw samples (at least one): exact peaks and nearest-rank percentiles."""
    memory = sorted(s.memory_mib for s in samples)
    compute = sorted(s.compute_percent for s in samples)
    rank = max(0, math.ceil(QUANTILE * len(samples)) - 1)
    return Bucket(
        start=start,
        seconds=seconds,
        samples=len(samples),
        memory_peak_mib=memory[-1],
        memory_p95_mib=memory[rank],
        compute_p95=round(compute[rank], 1),
        compute_peak=round(compute[-1], 1),
        ooms=sum(1 for s in samples if s.oom),
    )


def record(history: UsageHistory, claims: Iterable[ClaimRecord], samples: Iterable[Sample]) -> UsageHistory:
    """The history with new samples (and the records of their claims: new ones, or changed ones such
    as a pin) added in hourly buckets."""
    records = {uid: c.record for uid, c in history.claims.items()} | {r.uid: r for r in claims}
    by_hour: dict[tuple[str, int], list[Sample]] = defaultdict(list)
    for sample in samples:
        if sample.claim_uid not in records:
            raise HistoryError(f"a sample of claim {sample.claim_uid} without its record")
        by_hour[sample.claim_uid, int(sample.at) // HOUR_S * HOUR_S].append(sample)
    added: dict[str, list[Bucket]] = defaultdict(list)
    for (uid, start), hour in by_hour.items():
        added[uid].append(summarize(hour, start, HOUR_S))
    new = UsageHistory(
        history.sample_seconds,
        {uid: ClaimHistory(records[uid], tuple(buckets)) for uid, buckets in added.items()},
    )
    return merge(UsageHistory(history.sample_seconds, _records_only(history, records)), new)


def merge(a: UsageHistory, b: UsageHistory) -> UsageHistory:
    """Both histories in one: each claim's buckets combined, its record from the side that saw it
    last."""
    if a.sample_seconds != b.sample_seconds:
        raise HistoryError(f"histories sampled every {a.sample_seconds} s and {b.sample_seconds} s do not merge")
    claims = dict(a.claims)
    for uid, theirs in b.claims.items():
        ours = claims.get(uid)
        if ours is None:
            claims[uid] = theirs
            continue
        latest = theirs if theirs.last_seen >= ours.last_seen else ours
        claims[uid] = ClaimHistory(latest.record, _combined((*ours.buckets, *theirs.buckets)))
    return UsageHistory(a.sample_seconds, claims)


def expire(history: UsageHistory, now: float) -> UsageHistory:
    """The history as of `now`: buckets older than the retention gone, hours older than a day
    rolled up into days, claims with nothing left gone. This is what keeps it bounded."""
    oldest, fine_since = now - RETENTION_S, now - FINE_FOR_S
    claims = {}
    for uid, claim in history.claims.items():
        kept = [
            _rolled_up(b) if b.seconds < DAY_S and b.end <= fine_since else b for b in claim.buckets if b.end > oldest
        ]
        if kept:
            claims[uid] = ClaimHistory(claim.record, _combined(kept))
    return UsageHistory(history.sample_seconds, claims)


def to_json(history: UsageHistory) -> str:
    return json.dumps(_to_dict(history), separators=(",", ":"), sort_keys=True)


def from_json(text: str) -> UsageHistory:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise HistoryError(f"usage history: not JSON: {err}") from err
    if not isinstance(raw, dict) or (raw.get("apiVersion"), raw.get("kind")) != (API_VERSION, KIND):
        raise HistoryError(f"usage history: expected apiVersion {API_VERSION}, kind {KIND}")
    try:
        claims = [_claim_from_dict(c) for c in raw["claims"]]
        return UsageHistory(int(raw["sampleSeconds"]), {c.record.uid: c for c in claims})
    except (KeyError, TypeError, ValueError) as err:
        raise HistoryError(f"usage history: bad field: {err!r}") from err


def _records_only(history: UsageHistory, records: Mapping[str, ClaimRecord]) -> dict[str, ClaimHistory]:
    """Known claims with their records updated (a record changes without new samples: a pin)."""
    return {uid: replace(c, record=records[uid]) for uid, c in history.claims.items()}


def _combined(buckets: Iterable[Bucket]) -> tuple[Bucket, ...]:
    by_key: dict[tuple[int, int], Bucket] = {}
    for bucket in buckets:
        key = (bucket.start, bucket.seconds)
        by_key[key] = _merged(by_key[key], bucket) if key in by_key else bucket
    return tuple(sorted(by_key.values(), key=lambda b: (b.start, b.seconds)))


def _merged(a: Bucket, b: Bucket) -> Bucket:
    return Bucket(
        start=a.start,
        seconds=a.seconds,
        samples=a.samples + b.samples,
        memory_peak_mib=max(a.memory_peak_mib, b.memory_peak_mib),
        memory_p95_mib=max(a.memory_p95_mib, b.memory_p95_mib),  # an upper bound (module docstring)
        compute_p95=max(a.compute_p95, b.compute_p95),
        compute_peak=max(a.compute_peak, b.compute_peak),
        ooms=a.ooms + b.ooms,
    )


def _rolled_up(bucket: Bucket) -> Bucket:
    return replace(bucket, start=bucket.start // DAY_S * DAY_S, seconds=DAY_S)


_BUCKET_FIELDS = ("start", "seconds", "samples", "memory_peak_mib", "memory_p95_mib", "compute_p95", "compute_peak")


def _to_dict(history: UsageHistory) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "sampleSeconds": history.sample_seconds,
        # buckets: [start, seconds, samples, memory peak MiB, memory p95 MiB, compute p95 %, compute peak %, OOMs]
        "claims": [_claim_to_dict(c) for _, c in sorted(history.claims.items())],
    }


def _claim_to_dict(claim: ClaimHistory) -> dict[str, Any]:
    r = claim.record
    out: dict[str, Any] = {
        "uid": r.uid,
        "namespace": r.namespace,
        "claim": r.claim,
        "workload": {"kind": r.workload.kind, "name": r.workload.name},
        "template": r.template,
        "request": r.request,
        "requestIndex": r.request_index,
        "gpu": r.gpu,
        "size": _size_to_dict(r.size),
        "buckets": [[*(getattr(b, f) for f in _BUCKET_FIELDS), b.ooms] for b in claim.buckets],
    }
    if r.pinned:
        out["pinned"] = True
    if r.original is not None:
        out["original"] = _size_to_dict(r.original)
    return out


def _claim_from_dict(raw: dict[str, Any]) -> ClaimHistory:
    record = ClaimRecord(
        uid=str(raw["uid"]),
        namespace=str(raw["namespace"]),
        claim=str(raw["claim"]),
        workload=Workload(str(raw["workload"]["kind"]), str(raw["workload"]["name"])),
        template=str(raw["template"]),
        request=str(raw["request"]),
        request_index=int(raw["requestIndex"]),
        gpu=str(raw["gpu"]),
        size=_size_from_dict(raw["size"]),
        pinned=bool(raw.get("pinned", False)),
        original=_size_from_dict(raw["original"]) if "original" in raw else None,
    )
    buckets = tuple(
        Bucket(int(s), int(w), int(n), int(mp), int(m95), float(c95), float(cp), int(o))
        for s, w, n, mp, m95, c95, cp, o in raw["buckets"]
    )
    return ClaimHistory(record, _combined(buckets))


def _size_to_dict(size: Size) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": size.kind}
    for key, value in (("memoryMiB", size.memory_mib), ("compute", size.compute_percent), ("profile", size.profile)):
        if value is not None:
            out[key] = value
    return out


def _size_from_dict(raw: dict[str, Any]) -> Size:
    kind: DeviceKind = raw["kind"]
    if kind not in DEVICE_CLASSES:
        raise ValueError(f"unknown device kind {kind!r}")
    memory, compute, profile = raw.get("memoryMiB"), raw.get("compute"), raw.get("profile")
    return Size(
        kind,
        int(memory) if memory is not None else None,
        int(compute) if compute is not None else None,
        str(profile) if profile is not None else None,
    )
