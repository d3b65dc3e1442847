"""Recommendations per workload (its namespace, owner, claim template and request) from the usage
history: the smallest size on the request's ladder (driver/sizing/sizes.py) that holds the observed
memory peak plus a margin and the growth seen over the week for a day more, and the p95 compute
activity plus a margin.

Safety comes first, in this order: a pinned template is never changed; an out-of-memory in the
cool-down raises the size at once (past the size that ran out, and back to the original request if
sizing had cut below it) and never lets it shrink; a history too short (in time or samples) changes
nothing. Compute that sits at its limit is not shrunk: the demand above a limit is not seen.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from driver.sizing.history import DAY_S, HOUR_S, ClaimHistory, UsageHistory, Workload, expire
from driver.sizing.sizes import (
    GpuModel,
    Need,
    Size,
    capacity_key,
    compute_capacity,
    fit,
    gpu_fraction,
    gpu_model,
    memory_limit_mib,
)

PIN_ANNOTATION = "gpu.fgpu.dev/rightsize"  # "off": never change this template


@dataclass(frozen=True)
class Policy:
    memory_margin: float = 0.2  # over the peak: 2Gi used -> 2.4Gi -> 2.5Gi in 256Mi steps
    compute_margin: float = 0.1  # over the p95 activity
    min_history_s: int = DAY_S  # a day's cycle at least, before any change
    min_samples: int = 360  # and this many samples (an hour at the plugin's 10 s)
    confident_s: int = 3 * DAY_S  # of claim time sampled: confidence 100%
    cooldown_s: int = 3 * DAY_S  # after an out-of-memory: not shrunk
    oom_raise: float = 0.5  # after an out-of-memory: this much more memory than the size that ran out
    saturated: float = 0.9  # p95 compute at this fraction of the limit or more: demand unknown
    growth_horizon_s: int = DAY_S  # a growing peak is projected this far ahead


@dataclass(frozen=True)
class WorkloadKey:
    namespace: str
    workload: Workload
    template: str
    request: str


@dataclass(frozen=True)
class Observed:
    samples: int
    span_s: int
    held_hours: float
    memory_peak_mib: int
    compute_p95: float
    growth_mib_per_day: float
    last_oom: int | None  # end of the last bucket with an out-of-memory


@dataclass(frozen=True)
class Recommendation:
    key: WorkloadKey
    gpu: str
    request_index: int
    current: Size
    recommended: Size
    reason: str
    confidence: float  # 0 to 1, from the sample count
    gpu_hours_freed_per_day: float  # negative when it grows
    observed: Observed
    # False where the history does not decide the size (a pinned template, a history too short):
    # `recommended` is then the size last seen, which automatic sizing must not copy to new claims.
    decided: bool = True

    @property
    def changed(self) -> bool:
        return self.recommended != self.current


def recommend(history: UsageHistory, now: float, policy: Policy = Policy()) -> list[Recommendation]:
    """A recommendation per workload in the history, as of `now`."""
    groups: dict[WorkloadKey, list[ClaimHistory]] = defaultdict(list)
    for claim in expire(history, now).claims.values():
        r = claim.record
        groups[WorkloadKey(r.namespace, r.workload, r.template, r.request)].append(claim)
    keys = sorted(groups, key=lambda k: (k.namespace, k.workload.kind, k.workload.name, k.template, k.request))
    return [recommend_workload(key, groups[key], history.sample_seconds, now, policy) for key in keys]


def recommend_workload(
    key: WorkloadKey, claims: Sequence[ClaimHistory], sample_seconds: int, now: float, policy: Policy
) -> Recommendation:
    latest = max(claims, key=lambda c: c.last_seen).record
    gpu, current = gpu_model(latest.gpu), latest.size
    observed = observe(claims, sample_seconds)
    need = _need(claims, observed, current, gpu, policy)
    recommended, reason, decided = _decide(claims, current, need, observed, gpu, now, policy)
    held_per_day = observed.held_hours * DAY_S / max(observed.span_s, DAY_S)
    return Recommendation(
        key=key,
        gpu=latest.gpu,
        request_index=latest.request_index,
        current=current,
        recommended=recommended,
        reason=reason,
        confidence=min(1.0, observed.samples * sample_seconds / policy.confident_s),
        gpu_hours_freed_per_day=(gpu_fraction(current, gpu) - gpu_fraction(recommended, gpu)) * held_per_day,
        observed=observed,
        decided=decided,
    )


def observe(claims: Sequence[ClaimHistory], sample_seconds: int) -> Observed:
    buckets = [b for c in claims for b in c.buckets]
    samples = sum(b.samples for b in buckets)
    ooms = [b.end for b in buckets if b.ooms]
    return Observed(
        samples=samples,
        span_s=max(b.end for b in buckets) - min(b.start for b in buckets),
        held_hours=samples * sample_seconds / HOUR_S,
        memory_peak_mib=max(b.memory_peak_mib for b in buckets),
        # The largest bucket p95: at or above the p95 of all the samples (history.py's docstring).
        compute_p95=max(b.compute_p95 for b in buckets),
        growth_mib_per_day=_daily_peak_slope(claims),
        last_oom=max(ooms) if ooms else None,
    )


def _decide(
    claims: Sequence[ClaimHistory], current: Size, need: Need, observed: Observed, gpu: GpuModel, now: float, p: Policy
) -> tuple[Size, str, bool]:
    """(the size, why, whether the history decided it)."""
    if max(claims, key=lambda c: c.last_seen).record.pinned:
        return current, f'pinned ({PIN_ANNOTATION}: "off")', False
    if in_cooldown(observed, now, p):
        return *_after_oom(claims, current, need, gpu, now, p), True
    if observed.span_s < p.min_history_s or observed.samples < p.min_samples:
        hours = observed.span_s / HOUR_S
        return current, f"history too short ({hours:.0f} h, {observed.samples} samples)", False
    recommended = fit(current, need, gpu)
    return recommended, "fits the observed use" if recommended != current else "already the right size", True


def in_cooldown(observed: Observed, now: float, p: Policy) -> bool:
    """Whether an out-of-memory is recent enough that the workload must not shrink."""
    return observed.last_oom is not None and now - observed.last_oom < p.cooldown_s


def _after_oom(
    claims: Sequence[ClaimHistory], current: Size, need: Need, gpu: GpuModel, now: float, p: Policy
) -> tuple[Size, str]:
    """Raised at once past every size that ran out (the need holds them, `_need`), back to the
    original request where sizing had cut below it, and never below the current size."""
    candidates = [current, fit(current, need, gpu)]
    for c in claims:
        original = c.record.original
        ran_out = any(b.ooms and now - b.end < p.cooldown_s for b in c.buckets)
        if ran_out and original is not None and capacity_key(c.record.size, gpu) < capacity_key(original, gpu):
            candidates.append(original)
    recommended = max(candidates, key=lambda size: capacity_key(size, gpu))
    if recommended == current:
        return current, "out-of-memory cool-down: not shrunk"
    return recommended, "raised after an out-of-memory"


def _need(claims: Sequence[ClaimHistory], observed: Observed, current: Size, gpu: GpuModel, p: Policy) -> Need:
    growth = max(0.0, observed.growth_mib_per_day) * p.growth_horizon_s / DAY_S
    # A size that ran out had demand past its limit, by how much unseen: while its out-of-memory is
    # in the history, the need is a raise over that limit at least.
    ran_out = [memory_limit_mib(c.record.size, gpu) * (1 + p.oom_raise) for c in claims if _ran_out(c)]
    memory = max([observed.memory_peak_mib * (1 + p.memory_margin) + growth, *ran_out])
    compute = observed.compute_p95 * (1 + p.compute_margin)
    capacity = compute_capacity(current, gpu)
    if observed.compute_p95 >= p.saturated * capacity:
        compute = max(compute, capacity)  # at its limit: how much more it would use is not seen
    return Need(math.ceil(memory), compute)


def _ran_out(claim: ClaimHistory) -> bool:
    return any(b.ooms for b in claim.buckets)


def _daily_peak_slope(claims: Sequence[ClaimHistory]) -> float:
    """MiB per day by which the daily memory peak grows (least squares; 0 with under 2 days)."""
    peaks: dict[int, int] = {}
    for bucket in (b for c in claims for b in c.buckets):
        day = bucket.start // DAY_S
        peaks[day] = max(peaks.get(day, 0), bucket.memory_peak_mib)
    if len(peaks) < 2:
        return 0.0
    days = sorted(peaks)
    return statistics.linear_regression(days, [peaks[d] for d in days]).slope
