"""One scenario against the reference allocator (k8s.io/dynamic-resource-allocation/structured),
under each of our policies. What must hold (docs/allocator.md, "Semantics"):

- where the reference allocates, every policy of ours allocates;
- where ours allocates, the allocation passes the reference's own checks, and under first-fit
  (upstream's order) it is the reference's very allocation;
- where the reference refuses, first-fit refuses; another policy may allocate only on a node where
  the reference's refusal came from its search order (SEARCH_ORDER_ERRORS): an error upstream
  meets only on reaching a certain device, which our order may never reach.

Shared by the CI test (a fixed set of examples and the stored cases) and the explorer (fuzz.py)."""

from __future__ import annotations

import copy
from fractions import Fraction
from typing import Any

from driver.allocator.cluster import ClusterAllocator, Failure, Placement, Snapshot
from driver.allocator.model import claim_from_object, class_from_object, slice_from_object
from driver.allocator.pools import Node
from driver.allocator.state import AllocatedState
from driver.common.quantity import parse_quantity
from tests.support.reference import ReferenceAllocator

POLICIES = ("binpack", "spread", "first-fit")
# Upstream's errors that end its search where it meets them (allocator_incubating.go): a selector
# failing at runtime on a device an exact count reaches (isSelectable), a constraint refusing a
# device an `All` request must take (allocateDevice with must=true).
SEARCH_ORDER_ERRORS = ("CEL runtime error", "because a claim constraint would not be satisfied")


def search_order_error(error: str) -> bool:
    return any(marker in error for marker in SEARCH_ORDER_ERRORS)


def with_allocation(claim: dict[str, Any], allocation: dict[str, Any]) -> dict[str, Any]:
    return {**claim, "status": {"allocation": allocation}}


def picks(allocation: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [
        (
            r["request"],
            r["pool"],
            r["device"],
            "shareID" in r,
            _consumed(r.get("consumedCapacity")),
            r.get("adminAccess"),
        )
        for r in allocation["devices"]["results"]
    ]


def _consumed(capacity: dict[str, str] | None) -> dict[str, Fraction]:
    return {name: parse_quantity(value) for name, value in (capacity or {}).items()}


def ours(scenario: dict[str, Any], earlier: list[dict[str, Any]], policy: str) -> Placement | Failure:
    scenario = copy.deepcopy(scenario)
    nodes = [Node(n["metadata"]["name"], n["metadata"]["labels"]) for n in scenario["nodes"]]
    snapshot = Snapshot.from_slices([slice_from_object(s) for s in scenario["slices"]], nodes)
    classes = {c["metadata"]["name"]: class_from_object(c) for c in scenario["classes"]}
    state = AllocatedState.from_allocations(c["status"]["allocation"] for c in earlier)
    allocator = ClusterAllocator(snapshot, classes, state, policy)  # type: ignore[arg-type]
    return allocator.allocate(claim_from_object(scenario["claim"]))


def verdict(result: dict[str, Any]) -> str:
    """A reference result in a word: allocated, or failed with its error."""
    return "allocated" if result.get("allocation") else "failed: " + result.get("error", "")


def outcome_word(outcome: Placement | Failure) -> str:
    return "allocated" if isinstance(outcome, Placement) else "failed: " + outcome.reason


def check(reference: ReferenceAllocator, scenario: dict[str, Any]) -> dict[str, str]:
    """Asserts what must hold (module docstring); returns the verdicts: the reference's and each
    policy's, each "allocated" or "failed: <error>"."""
    base = scenario["classes"] + scenario["nodes"] + scenario["slices"]
    # The state the new claim meets: the earlier claims as the reference allocated them.
    earlier = [
        with_allocation(claim, result["allocation"])
        for claim, result in zip(scenario["earlier"], reference.allocate(base + scenario["earlier"]), strict=True)
        if result.get("allocation")
    ]
    objects = base + earlier + [scenario["claim"]]
    expected = reference.allocate(objects)[0]
    verdicts = {"reference": verdict(expected)}
    for policy in POLICIES:
        outcome = ours(scenario, earlier, policy)
        verdicts[policy] = outcome_word(outcome)
        where = f"{policy}: reference {verdicts['reference']}, ours {outcome}"
        if expected.get("allocation") or policy == "first-fit":
            assert isinstance(outcome, Placement) == bool(expected.get("allocation")), where
        elif isinstance(outcome, Placement):
            there = verdict(reference.allocate(objects, node=outcome.node)[0])
            assert search_order_error(there), f"{where}; the reference on {outcome.node}: {there}"
        if isinstance(outcome, Placement):
            if policy == "first-fit":  # upstream's order: the very same allocation
                _same_allocation(outcome.allocation, expected["allocation"])
            mine = with_allocation(scenario["claim"], outcome.allocation)
            assert reference.problems(base + earlier + [mine]) == [], where
    return verdicts


def _same_allocation(mine: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert picks(mine) == picks(theirs)
    assert mine.get("nodeSelector") == theirs.get("nodeSelector")
    assert mine["devices"].get("config") == theirs["devices"].get("config")
    tolerations = [r.get("tolerations") for r in mine["devices"]["results"]]
    assert tolerations == [r.get("tolerations") for r in theirs["devices"]["results"]]
