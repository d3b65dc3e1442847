"""The usage history: buckets summarize samples exactly, merging never understates a percentile,
expiry keeps it bounded, and the format round-trips and refuses what it is not."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from driver.sizing.history import (
    DAY_S,
    HOUR_S,
    ClaimRecord,
    HistoryError,
    Sample,
    UsageHistory,
    Workload,
    expire,
    from_json,
    merge,
    record,
    summarize,
    to_json,
)
from driver.sizing.sizes import Size

H100 = "NVIDIA H100 80GB HBM3"


def claim(uid: str = "u1", pinned: bool = False) -> ClaimRecord:
    return ClaimRecord(
        uid, "ns", f"c-{uid}", Workload("Deployment", "web"), "t", "gpu", 0, H100, Size("mps", 10240, 25), pinned
    )


def test_a_bucket_holds_the_exact_peak_and_nearest_rank_p95():
    samples = [Sample("u1", i, memory_mib=i, compute_percent=i / 2, oom=i == 7) for i in range(1, 101)]
    bucket = summarize(samples, 0, HOUR_S)
    assert (bucket.samples, bucket.memory_peak_mib, bucket.memory_p95_mib) == (100, 100, 95)
    assert (bucket.compute_p95, bucket.compute_peak, bucket.ooms) == (47.5, 50.0, 1)


def test_samples_go_into_hourly_buckets_of_their_claim():
    samples = [Sample("u1", t, 100 + t // HOUR_S, 5.0) for t in range(0, 3 * HOUR_S, 60)]
    history = record(UsageHistory(60), [claim()], samples)
    buckets = history.claims["u1"].buckets
    assert [(b.start, b.samples, b.memory_peak_mib) for b in buckets] == [
        (0, 60, 100),
        (3600, 60, 101),
        (7200, 60, 102),
    ]


def test_a_sample_of_an_unknown_claim_is_refused():
    with pytest.raises(HistoryError, match="without its record"):
        record(UsageHistory(), [], [Sample("nobody", 0, 1, 1.0)])


def test_a_record_changes_without_samples_a_pin_for_one():
    history = record(UsageHistory(60), [claim()], [Sample("u1", 0, 1, 1.0)])
    assert record(history, [claim(pinned=True)], []).claims["u1"].record.pinned


@given(
    st.lists(st.integers(0, 80_000), min_size=1, max_size=60),
    st.lists(st.integers(0, 80_000), min_size=1, max_size=60),
)
def test_merging_two_sources_of_one_hour_never_understates_the_p95_or_the_peak(left: list[int], right: list[int]):
    def history(values: list[int]) -> UsageHistory:
        return record(UsageHistory(60), [claim()], [Sample("u1", i, v, v / 1000) for i, v in enumerate(values)])

    (bucket,) = merge(history(left), history(right)).claims["u1"].buckets
    union = sorted(left + right)
    assert bucket.memory_p95_mib >= union[math.ceil(0.95 * len(union)) - 1]
    assert bucket.memory_peak_mib == union[-1]
    assert bucket.samples == len(union)


def test_histories_sampled_at_different_rates_do_not_merge():
    with pytest.raises(HistoryError, match="do not merge"):
        merge(UsageHistory(10), UsageHistory(60))


def test_expiry_rolls_hours_into_days_and_drops_the_week_before():
    now = 10 * DAY_S
    samples = [Sample("u1", t, 100, 5.0) for t in range(0, now, 600)]
    history = expire(record(UsageHistory(600), [claim()], samples), now)
    buckets = history.claims["u1"].buckets
    assert [b.seconds for b in buckets] == [DAY_S] * 6 + [HOUR_S] * 24
    assert buckets[0].start == now - 7 * DAY_S  # the days that ended a week ago or earlier are gone
    assert sum(b.samples for b in buckets) == 6 * 144 + 24 * 6  # a sample each 10 minutes
    assert expire(history, now + 8 * DAY_S).claims == {}


@given(st.integers(1, 30), st.sampled_from([10, 60, 300]))
def test_a_claim_costs_at_most_a_week_of_days_and_a_day_of_hours(days: int, period: int):
    now = days * DAY_S
    samples = [Sample("u1", t, 100, 5.0) for t in range(0, now, max(period, 1800))]
    history = expire(record(UsageHistory(period), [claim()], samples), now)
    assert len(history.claims["u1"].buckets) <= 7 + 24


def test_the_json_form_round_trips_and_names_its_version():
    history = record(UsageHistory(60), [claim(), claim("u2", pinned=True)], [Sample("u1", 5, 1, 1.5, oom=True)])
    text = to_json(history)
    assert '"apiVersion":"gpu.fgpu.dev/v1alpha1"' in text and '"kind":"UsageHistory"' in text
    assert from_json(text) == history


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not JSON"),
        ('{"apiVersion": "v9", "kind": "UsageHistory"}', "expected apiVersion"),
        ('{"apiVersion": "gpu.fgpu.dev/v1alpha1", "kind": "UsageHistory", "sampleSeconds": 10}', "bad field"),
    ],
)
def test_a_bad_history_is_refused_with_the_reason(text: str, message: str):
    with pytest.raises(HistoryError, match=message):
        from_json(text)
