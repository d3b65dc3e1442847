"""Sizes and their ladders: the smallest size of a kind that holds a need, what a size takes from
its GPU, and the steps between sizes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from driver.sizing.sizes import (
    Need,
    Size,
    compute_capacity,
    fit,
    gpu_fraction,
    gpu_model,
    memory_limit_mib,
    steps_between,
)

H100 = gpu_model("NVIDIA H100 80GB HBM3")
L4 = gpu_model("NVIDIA L4")


def test_the_mig_ladder_comes_from_the_machine_profile_without_media_variants():
    assert [o.name for o in H100.mig_ladder] == ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]
    assert L4.mig_ladder == ()


def test_a_whole_gpu_goes_to_the_smallest_mig_profile_holding_memory_and_compute():
    assert fit(Size("whole"), Need(12_000, 10.0), H100) == Size("mig", profile="1g.20gb")
    # 1g.20gb has 26 of 132 SMs (19.7%): 20% of the GPU needs the 2g
    assert fit(Size("whole"), Need(12_000, 20.0), H100) == Size("mig", profile="2g.20gb")
    # only the 7g (all 8 memory slices) holds it: that frees nothing, so it stays whole
    assert fit(Size("whole"), Need(50_000, 10.0), H100) == Size("whole")


def test_a_whole_gpu_without_mig_becomes_an_mps_share():
    assert fit(Size("whole"), Need(3000, 12.4), L4) == Size("mps", memory_mib=3072, compute_percent=13)


def test_a_share_keeps_its_kind_in_256mi_and_1_percent_steps_and_outgrows_to_whole():
    assert fit(Size("mps", 10240, 25), Need(2457, 8.8), H100) == Size("mps", 2560, 9)
    assert fit(Size("timeslice", 1024), Need(100, 50.0), H100) == Size("timeslice", 256)
    assert fit(Size("mps", 10240, 25), Need(90_000, 8.8), H100) == Size("whole")


def test_an_mps_share_in_a_partition_requests_compute_of_the_partition_and_outgrows_to_a_mig():
    share = Size("mig-mps", 8192, 30, "3g.40gb")
    # 10% of the GPU's 132 SMs is 22% of the partition's 60
    assert fit(share, Need(4000, 10.0), H100) == Size("mig-mps", 4096, 22, "3g.40gb")
    assert fit(share, Need(30_000, 46.0), H100) == Size("mig", profile="4g.40gb")  # past the 3g's SMs
    assert fit(share, Need(45_000, 10.0), H100) == Size("whole")  # past every partition but the 7g


def test_what_a_size_takes_from_its_gpu():
    assert gpu_fraction(Size("whole"), H100) == 1
    assert gpu_fraction(Size("mig", profile="3g.40gb"), H100) == 0.5
    assert gpu_fraction(Size("mps", 8192, 10), H100) == pytest.approx(8192 / 81559)
    assert gpu_fraction(Size("mps", 1024, 50), H100) == 0.5  # compute fills a GPU too


def test_steps_count_profiles_on_the_ladder_and_256mi_or_1_percent_for_shares():
    assert steps_between(Size("mig", profile="1g.10gb"), Size("mig", profile="2g.20gb"), H100) == 2
    assert steps_between(Size("mps", 2560, 9), Size("mps", 2816, 9), H100) == 1
    assert steps_between(Size("mps", 2560, 9), Size("mps", 2560, 12), H100) == 3
    assert steps_between(Size("mps", 2560, 9), Size("whole"), H100) is None


SIZES = st.sampled_from(
    [
        *(Size("whole"), Size("mig", profile="1g.10gb"), Size("mps", 10240, 25), Size("timeslice", 1024)),
        *(Size("mig-mps", 8192, 30, "3g.40gb"), Size("mig-timeslice", 4096, None, "3g.40gb")),
    ]
)


@given(SIZES, st.integers(0, 80_000), st.floats(0, 100))
def test_a_fitted_size_holds_the_need(current: Size, memory: int, compute: float):
    size = fit(current, Need(memory, compute), H100)
    assert memory_limit_mib(size, H100) >= min(memory, H100.memory_mib // 256 * 256)
    assert compute_capacity(size, H100) >= compute - 1e-9 or compute_capacity(size, H100) == 100
