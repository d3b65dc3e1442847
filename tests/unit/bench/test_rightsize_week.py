"""A small form of bench/rightsize_week.py (3 days, a sample each 5 minutes): every example workload
has a usage profile (the NVML mock's, driver/nvml/usage_profiles.py), sizing causes no out-of-memory,
steady workloads end within one step of their best size, GPU-hours fall; and the history stays about
a kilobyte and a half per claim."""

from __future__ import annotations

from bench.rightsize_week import PRODUCT, example_workloads, history_size, run
from driver.nvml.usage_profiles import WORKLOAD_PROFILES
from driver.sizing.sizes import Size, gpu_model


def test_the_examples_are_read_with_their_sizes_and_each_has_a_profile():
    workloads = {w.label: w for w in example_workloads(gpu_model(PRODUCT))}
    assert set(workloads) == set(WORKLOAD_PROFILES)
    assert all(profile.valid() for profile in WORKLOAD_PROFILES.values())  # the mock would take each
    assert (workloads["Deployment/inference"].devices, workloads["Deployment/inference"].size) == (
        3,
        Size("mps", 8192, 10),
    )
    assert workloads["Pod/mig-pair"].devices == 2 and workloads["Pod/mig-pair"].size.profile == "2g.20gb"
    assert not workloads["Pod/timeslice-a"].sizable and not workloads["Pod/h100-or-3g"].sizable


def test_three_days_of_sizing_cause_no_out_of_memory_and_keep_steady_workloads_within_a_step():
    result = run(days=3, sample_s=300, lifetime_h=12)
    assert result["ooms_by_sizing"] == 0
    assert result["steady_max_steps"] <= 1 and result["steady_not_comparable"] == 0
    assert result["reduction"] >= 0.2  # the first day is never sized (too short): the week's figure is higher
    grown = next(w for w in result["workloads"] if w["workload"] == "Pod/mig-3g")
    assert grown["sizes_used"][-1] != "mig 1g.10gb"


def test_the_history_costs_at_most_1_5_kb_a_claim_for_a_week():
    size = history_size(claims=20, days=7)
    assert size["json_bytes"] <= 20 * 1500 and size["gzip_bytes"] < size["json_bytes"] / 3
