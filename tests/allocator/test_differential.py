"""Our allocator against the reference allocator (tests/allocator/differential.py says what must
hold): on a fixed, reproducible set of generated scenarios (Hypothesis derandomized: every run
draws the same examples), and on every stored case in cases/ (scenarios that once failed, and
one pinned example for each path where upstream's verdict depends on its search order).
New examples are explored by `make fuzz` (tests/allocator/fuzz.py), not here."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings

from testbed.cluster.harness import build_binaries
from tests.support.differential import check
from tests.support.reference import ReferenceAllocator
from tests.support.scenarios import scenarios

pytestmark = pytest.mark.go
EXAMPLES = int(os.environ.get("FGPU_DIFFERENTIAL_EXAMPLES", "2000"))
CASES = sorted((Path(__file__).parent / "cases").glob("*.json"))


@pytest.fixture(scope="module")
def reference() -> Iterator[ReferenceAllocator]:
    allocator = ReferenceAllocator(build_binaries() / "allocate")
    yield allocator
    allocator.close()


@settings(
    max_examples=EXAMPLES,
    derandomize=True,  # the same examples on every run and machine: CI never fails by chance
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenario=scenarios())
def test_same_verdict_as_the_reference_and_valid_allocations(reference: ReferenceAllocator, scenario: dict[str, Any]):
    verdicts = check(reference, scenario)
    event(verdicts["reference"].split(":")[0] + " by the reference")
    allocated = {side: verdict == "allocated" for side, verdict in verdicts.items()}
    if len(set(allocated.values())) > 1:
        event("a policy allocates where the reference refuses (search order)")


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_stored_case(reference: ReferenceAllocator, path: Path):
    """A stored case passes the same checks; where it says what each side must answer
    ("expect": reference and policies, each "allocated" or the start of "failed: <error>"), it does."""
    case = json.loads(path.read_text())
    verdicts = check(reference, case)
    for side, expected in case.get("expect", {}).items():
        assert verdicts[side].startswith(expected), f"{side}: expected {expected!r}, got {verdicts[side]!r}"


def _drawn(count: int) -> list[str]:
    seen: list[str] = []

    @settings(max_examples=count, derandomize=True, database=None, deadline=None)
    @given(scenario=scenarios())
    def collect(scenario: dict[str, Any]) -> None:
        seen.append(json.dumps(scenario, sort_keys=True))

    collect()
    return seen


def test_the_examples_drawn_are_the_same_on_every_run():
    """What makes CI reproducible: the derandomized strategy draws the very same scenarios twice."""
    first, second = _drawn(50), _drawn(50)
    assert first == second and len(set(first)) > 10
