"""The recommendation rules, each with a case that would fail without it: fit to the peak plus a
margin and the p95 compute, too-short histories, pins, out-of-memory raises and cool-downs,
saturated compute, growth, confidence."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from driver.sizing.history import DAY_S, HOUR_S, ClaimRecord, Sample, UsageHistory, Workload, record
from driver.sizing.recommend import Policy, Recommendation, recommend
from driver.sizing.sizes import Size, gpu_model, memory_limit_mib

H100 = "NVIDIA H100 80GB HBM3"
SHARE = Size("mps", 10240, 25)


def claim(uid: str = "u1", size: Size = SHARE, **changes) -> ClaimRecord:
    base = ClaimRecord(uid, "ns", f"c-{uid}", Workload("Deployment", "web"), "t", "gpu", 0, H100, size)
    return replace(base, **changes)


def only(history: UsageHistory, now: float) -> Recommendation:
    (rec,) = recommend(history, now)
    return rec


def steady(uid: str = "u1", memory: int = 2048, compute: float = 8.0, days: float = 2, start: int = 0, **changes):
    samples = [Sample(uid, t, memory, compute) for t in range(start, start + int(days * DAY_S), 60)]
    return record(UsageHistory(60), [claim(uid, **changes)], samples)


def test_a_10gi_share_that_uses_2gi_is_recommended_2_5gi():
    rec = only(steady(), 2 * DAY_S)
    assert (rec.recommended, rec.reason) == (Size("mps", 2560, 9), "fits the observed use")
    assert rec.gpu_hours_freed_per_day == pytest.approx((0.25 - 0.09) * 24)


def test_a_whole_gpu_using_little_becomes_a_mig_profile():
    rec = only(steady(memory=12_000, compute=15.0, size=Size("whole")), 2 * DAY_S)
    assert rec.recommended == Size("mig", profile="1g.20gb")


@pytest.mark.parametrize("days", [0.5, 0.9])
def test_a_history_shorter_than_a_day_changes_nothing(days: float):
    rec = only(steady(days=days), days * DAY_S)
    assert not rec.changed and rec.reason.startswith("history too short")


def test_too_few_samples_change_nothing():
    samples = [Sample("u1", t, 2048, 8.0) for t in range(0, 2 * DAY_S, 2 * HOUR_S)]
    rec = only(record(UsageHistory(60), [claim()], samples), 2 * DAY_S)
    assert not rec.changed and "24 samples" in rec.reason


def test_a_pinned_template_is_never_changed_even_after_an_out_of_memory():
    history = steady(pinned=True)
    history = record(history, [], [Sample("u1", 2 * DAY_S - 30, 10240, 8.0, oom=True)])
    rec = only(history, 2 * DAY_S)
    assert not rec.changed and rec.reason.startswith("pinned")


def test_an_out_of_memory_after_sizing_raises_at_once_back_to_the_original_and_no_shrink_in_cool_down():
    sized = Size("mps", 2560, 9)
    history = steady(size=sized, original=SHARE)
    history = record(history, [], [Sample("u1", 2 * DAY_S + 10, 2560, 8.0, oom=True)])
    rec = only(history, 2 * DAY_S + 60)
    assert (rec.recommended, rec.reason) == (SHARE, "raised after an out-of-memory")
    # the template now at the original size: still not shrunk two days on, though it uses 2Gi
    history = record(
        history, [claim("u2", SHARE)], [Sample("u2", t, 2048, 8.0) for t in range(2 * DAY_S, 4 * DAY_S, 60)]
    )
    rec = only(history, 4 * DAY_S)
    assert (rec.recommended, rec.reason) == (SHARE, "out-of-memory cool-down: not shrunk")
    # after the cool-down it is sized again, but past the size that ran out while that is remembered
    history = record(history, [], [Sample("u2", t, 2048, 8.0) for t in range(4 * DAY_S, 6 * DAY_S, 60)])
    assert only(history, 6 * DAY_S).recommended == Size("mps", 3840, 9)


def test_a_share_that_runs_out_at_its_own_request_grows_past_it():
    history = steady(memory=10_000, compute=8.0)
    history = record(history, [], [Sample("u1", 2 * DAY_S - 30, 10240, 8.0, oom=True)])
    rec = only(history, 2 * DAY_S)
    assert rec.recommended.kind == "mps" and rec.recommended.memory_mib >= 10240 * 1.5


def test_a_mig_partition_that_runs_out_moves_up_the_ladder():
    history = steady(memory=9000, compute=5.0, size=Size("mig", profile="1g.10gb"))
    history = record(history, [], [Sample("u1", 2 * DAY_S - 30, 9984, 5.0, oom=True)])
    assert only(history, 2 * DAY_S).recommended == Size("mig", profile="1g.20gb")


def test_compute_at_its_limit_is_not_shrunk():
    rec = only(steady(compute=24.0), 2 * DAY_S)  # p95 24% of a 25% limit: how much more is unseen
    assert rec.recommended.compute_percent == 27  # the limit's 25 at least; the margin over 24 gives 27


def test_a_growing_peak_is_projected_a_day_ahead():
    samples = [Sample("u1", t, 2048 + t * 1024 // DAY_S, 8.0) for t in range(0, 4 * DAY_S, 60)]
    rec = only(record(UsageHistory(60), [claim()], samples), 4 * DAY_S)
    assert rec.observed.growth_mib_per_day == pytest.approx(1024, rel=0.01)
    peak = rec.observed.memory_peak_mib
    assert rec.recommended.memory_mib is not None and rec.recommended.memory_mib >= peak * 1.2 + 1000


def test_confidence_grows_with_the_samples():
    assert only(steady(days=1), DAY_S).confidence == pytest.approx(1 / 3)
    assert only(steady(days=3), 3 * DAY_S).confidence == 1


def test_workloads_are_told_apart_by_owner_template_and_request():
    history = record(
        steady(),
        [claim("u2", workload=Workload("StatefulSet", "db")), claim("u3", template="other")],
        [Sample(uid, 0, 100, 1.0) for uid in ("u2", "u3")],
    )
    keys = [(r.key.workload.kind, r.key.template) for r in recommend(history, 2 * DAY_S)]
    assert keys == [("Deployment", "other"), ("Deployment", "t"), ("StatefulSet", "t")]


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([SHARE, Size("whole"), Size("mig", profile="3g.40gb"), Size("mig-mps", 8192, 30, "3g.40gb")]),
    st.integers(0, 60_000),
    st.floats(0, 100),
)
def test_never_below_the_observed_peak(size: Size, memory: int, compute: float):
    samples = [Sample("u1", t, memory, compute) for t in range(0, 2 * DAY_S, 1800)]
    (rec,) = recommend(record(UsageHistory(1800), [claim(size=size)], samples), 2 * DAY_S, Policy(min_samples=50))
    assert rec.changed or rec.reason == "already the right size"
    assert memory_limit_mib(rec.recommended, gpu_model(H100)) >= memory
