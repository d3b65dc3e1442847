"""The search's bounds (issue 38, finding 6): a claim of n shared requests and one that cannot be
met took 8^n steps on a DGX H100 (11.7 s at n = 6, a claim may carry 32 requests). A request with
too few candidates ends the search before it starts; any other search ends at its step budget,
and what the budget cut is not remembered as not fitting. Timing is bench/'s (BENCHMARKS.md):
these tests bound the steps, and pytest-timeout catches the search that is not bounded."""

from __future__ import annotations

from typing import Any

import pytest

from driver.allocator.allocate import SearchBudget
from driver.allocator.cluster import Failure, Placement
from driver.allocator.make_room import Holder, make_room
from tests.support.allocation import allocator, claim, exactly, h100_slices, place, profile

pytestmark = pytest.mark.timeout(60)


def shared(n: int) -> list[dict[str, Any]]:
    """n time-slice requests: each may take any of the 8 GPUs' shared devices."""
    return [exactly("timeslice.gpu.fgpu.dev", name=f"ts{i}") for i in range(n)]


def test_a_claim_whose_search_explodes_fails_at_its_budget_saying_so():
    cluster = allocator(h100_slices("n1", "n2"))
    # The time-slices draw on GPUs the 8 whole GPUs need: no order fits, every order is tried.
    hostile = claim("hostile", *shared(6), exactly("gpu.fgpu.dev", name="all", count=8))
    budget = SearchBudget(20_000)
    outcome = cluster.allocate(hostile, budget=budget)
    assert isinstance(outcome, Failure) and budget.exhausted and budget.spent == 20_000
    assert "no answer within the search budget (20000 devices tried)" in outcome.reason
    assert isinstance(cluster.allocate(hostile), Failure)  # the default budget ends it too
    place(cluster, claim("ordinary", exactly("gpu.fgpu.dev", count=2)))  # and nothing is left behind


def test_a_request_no_device_matches_fails_before_any_search():
    cluster = allocator(h100_slices("n1"))
    nothing = exactly("mig.gpu.fgpu.dev", name="none", selector=profile("9g.900gb"))
    budget = SearchBudget(1)
    outcome = cluster.allocate(claim("hopeless", *shared(8), nothing), budget=budget)
    assert isinstance(outcome, Failure) and budget.spent == 0 and not budget.exhausted
    assert "request none: no device of class mig.gpu.fgpu.dev" in outcome.reason
    too_many = exactly("gpu.fgpu.dev", name="nine", count=9)  # 8 on the node: as hopeless
    assert isinstance(cluster.allocate(claim("nine", *shared(8), too_many), budget=budget), Failure)
    assert budget.spent == 0


def test_a_search_the_budget_cut_is_not_remembered_as_not_fitting():
    cluster = allocator(h100_slices("n1"))
    fits = claim("fits", *shared(3), exactly("gpu.fgpu.dev", name="five", count=5))
    cut = SearchBudget(3)
    assert isinstance(cluster.allocate(fits, budget=cut), Failure) and cut.exhausted
    assert isinstance(cluster.allocate(fits), Placement)


def test_a_gang_spends_one_budget_for_all_its_members():
    cluster = allocator(h100_slices("n1", "n2"))
    members = [claim(f"m{i}", *shared(5), exactly("gpu.fgpu.dev", name="all", count=8)) for i in range(3)]
    budget = SearchBudget(5_000)
    outcome = cluster.allocate_gang(members, budget=budget)
    assert isinstance(outcome, Failure) and "search budget" in outcome.reason
    assert budget.spent == 5_000


def test_making_room_for_a_claim_whose_search_explodes_plans_nothing():
    taken = place(allocator(h100_slices("n1")), claim("held", exactly("gpu.fgpu.dev", count=8)))
    cluster = allocator(h100_slices("n1"), allocated=(taken.allocation,))
    holder = Holder(taken.claim, "n1", taken.allocation, movable=True, started=0.0)
    hostile = claim("hostile", *shared(6), exactly("gpu.fgpu.dev", name="all", count=8))
    budget = SearchBudget(20_000)
    assert make_room(cluster, hostile, [holder], move=False, budget=budget) == []
    assert budget.exhausted
    # An ordinary claim gets its plan on the same state.
    (plan,) = make_room(cluster, claim("two", exactly("gpu.fgpu.dev", count=2)), [holder], move=False)
    assert plan.victims == (holder,)
