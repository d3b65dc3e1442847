"""The explorer: the differential check (differential.py) on new random scenarios for a time
budget, where CI runs a fixed set. A failure is shrunk by Hypothesis and written to
tests/allocator/cases/ as a case file ready to commit (the CI test then runs it every time).

    python -m tests.allocator.fuzz --minutes 30        (make fuzz FUZZ_MINUTES=30)

Exit 0: the budget ran out clean (the count of scenarios is printed); 1: a case was written."""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings

from testbed.cluster.harness import build_binaries
from tests.support.differential import check
from tests.support.reference import ReferenceAllocator
from tests.support.scenarios import scenarios

CASES = Path(__file__).parent / "cases"
ROUND = 500  # examples a Hypothesis run; the budget is checked between runs


def explore(reference: ReferenceAllocator, seconds: float, cases: Path) -> tuple[int, Path | None]:
    """Scenarios checked, and the case file written for a failure (None if clean)."""
    checked = 0
    failing: dict[str, Any] = {}

    @settings(
        max_examples=ROUND,
        derandomize=False,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(scenario=scenarios())
    def one(scenario: dict[str, Any]) -> None:
        nonlocal checked
        checked += 1
        kept = copy.deepcopy(scenario)
        try:
            check(reference, scenario)
        except Exception:
            failing.clear()
            failing.update(kept)  # Hypothesis replays the shrunk example last: that one stays
            raise

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            one()
        except Exception as error:  # the assertion (or the reference's complaint) on the shrunk example
            stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H%M%S")
            path = cases / f"found-{stamp}.json"
            failing["found"] = f"{type(error).__name__}: {error}".splitlines()[0][:500]
            path.write_text(json.dumps(failing, indent=1) + "\n")
            return checked, path
    return checked, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.allocator.fuzz", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="time budget (default 30)")
    parser.add_argument("--cases", type=Path, default=CASES, help="where a failing case is written")
    args = parser.parse_args(argv)
    if args.minutes <= 0:
        parser.error(f"--minutes must be positive, got {args.minutes}")
    if not args.cases.is_dir():
        parser.error(f"--cases: not a directory: {args.cases}")
    reference = ReferenceAllocator(build_binaries() / "allocate")
    started = time.monotonic()
    try:
        checked, path = explore(reference, args.minutes * 60, args.cases)
    finally:
        reference.close()
    took = time.monotonic() - started
    if path is not None:
        print(f"fuzz: failed after {checked} scenarios in {took:.0f} s; case written to {path}", file=sys.stderr)
        return 1
    print(f"fuzz: {checked} scenarios in {took:.0f} s, all clean")
    return 0


if __name__ == "__main__":
    sys.exit(main())
