"""Shares that end together (issue 43): a claim's expected end read from its annotation
gpu.fgpu.dev/expected-duration and creationTimestamp (driver/allocator/lifetimes.py), and a share
placed, among the GPUs the policy scores alike, on the one whose tenants are expected to end
nearest to it; claims without the hint, and an allocator told not to read it, place as before."""

from __future__ import annotations

import copy
import random
import uuid
from typing import Any

import pytest

from driver.allocator.cluster import ClusterAllocator, Placement, Snapshot
from driver.allocator.lifetimes import (
    EXPECTED_DURATION,
    MAX_DURATION_S,
    TOLERANCE,
    expected_duration,
    expected_end,
    nearest_first,
)
from driver.allocator.model import Claim, claim_from_object, class_from_object, slice_from_object
from driver.allocator.state import AllocatedState
from driver.common.flags import FlagParser
from driver.controller.settings import ControllerSettings, add_controller_flags, controller_settings
from tests.support.allocation import CLASSES, devices, exactly, first_gpus

MPS = "mps.gpu.fgpu.dev"
CREATED = "2024-05-01T12:00:00Z"
T0 = 1714564800.0  # CREATED in seconds since the epoch


# --- reading the hint --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30m", 1800.0), ("2h", 7200.0), ("90s", 90.0), ("1h30m", 5400.0), ("600", 600.0), ("30d", MAX_DURATION_S)],
)
def test_the_annotation_is_a_go_duration(text: str, seconds: float):
    assert expected_duration({EXPECTED_DURATION: text}) == seconds


@pytest.mark.parametrize("text", ["", "soon", "-5m", "0s", "5 minutes", "31d", "744h", "1e400", "nan", "5mm"])
def test_a_malformed_or_unbounded_annotation_is_no_hint(text: str):
    assert expected_duration({EXPECTED_DURATION: text}) is None


def test_the_end_is_counted_from_the_creation_time_and_needs_both():
    annotations = {EXPECTED_DURATION: "30m"}
    assert expected_end({"annotations": annotations, "creationTimestamp": CREATED}) == T0 + 1800
    assert expected_end({"annotations": annotations}) is None
    assert expected_end({"annotations": annotations, "creationTimestamp": "yesterday"}) is None
    assert expected_end({"annotations": annotations, "creationTimestamp": "2024-05-01T12:00:00"}) is None  # no zone
    assert expected_end({"annotations": {EXPECTED_DURATION: 1800}, "creationTimestamp": CREATED}) is None
    assert expected_end({"creationTimestamp": CREATED}) is None


def test_a_claim_carries_its_expected_end_and_a_bad_hint_never_fails_it():
    assert share("a", end_s=600).expected_end == T0 + 600
    bad = share("b", end_s=600)
    obj = claim_object("b", None)
    obj["metadata"]["annotations"] = {EXPECTED_DURATION: "forever"}
    assert claim_from_object(obj).expected_end is None and bad.search_key == claim_from_object(obj).search_key


def test_nearest_first_reorders_only_what_scores_as_the_best_does():
    ranked = [(0, 0.0, "a"), (0, 0.1, "b"), (0, 0.2, "c"), (1, 0.0, "d")]
    far = {"a": 50.0, "b": 10.0, "c": 1.0, "d": 0.0}
    # c is past the tolerance of a's score, d differs in what must be equal: neither moves up.
    assert [i[2] for i in nearest_first(ranked, lambda i: i[0], lambda i: i[1], lambda i: far[i[2]])] == list("bacd")
    unknown = [i[2] for i in nearest_first(ranked, lambda i: i[0], lambda i: i[1], lambda _: float("inf"))]
    assert unknown == list("abcd")
    assert 0.1 <= TOLERANCE < 0.2


# --- placing -----------------------------------------------------------------------------------


def cluster(slices: list[dict[str, Any]], policy: str = "binpack", hints: bool = True) -> ClusterAllocator:
    snapshot = Snapshot.from_slices([slice_from_object(s) for s in slices])
    classes = {c["metadata"]["name"]: class_from_object(c) for c in CLASSES}
    return ClusterAllocator(snapshot, classes, AllocatedState(), policy, hints)  # type: ignore[arg-type]


def claim_object(name: str, end_s: float | None, compute: str = "10") -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": "a", "uid": f"uid-{name}", "creationTimestamp": CREATED}
    if end_s is not None:
        metadata["annotations"] = {EXPECTED_DURATION: f"{end_s:g}s"}
    request = exactly(MPS, capacity={"requests": {"compute": compute}})
    return {"metadata": metadata, "spec": {"devices": {"requests": [request]}}}


def share(name: str, end_s: float | None = None, compute: str = "10") -> Claim:
    """One MPS share of the namespace `a`, created at T0, expected to end `end_s` later."""
    return claim_from_object(claim_object(name, end_s, compute))


def hold(allocator: ClusterAllocator, claim: Claim, device: str, node: str = "n1") -> dict[str, Any]:
    """The claim's share counted on `device` (as the controller counts a claim's allocation)."""
    result = {"request": "r", "driver": "gpu.fgpu.dev", "pool": node, "device": device, "shareID": str(uuid.uuid4())}
    result["consumedCapacity"] = {"clients": "1", "compute": "10", "memory": "1Gi"}
    allocation = {"devices": {"results": [result]}}
    allocator.add(node, allocation, claim)
    return allocation


def two_gpus_ending_apart(policy: str, hints: bool = True) -> ClusterAllocator:
    """GPU 0's share ends in 10 minutes, GPU 1's in 10 hours; otherwise alike."""
    allocator = cluster(first_gpus(2), policy, hints)
    hold(allocator, share("soon", 600), "gpu-0-mps")
    hold(allocator, share("late", 36000), "gpu-1-mps")
    return allocator


@pytest.mark.parametrize("policy", ["binpack", "fragmentation"])
def test_a_share_goes_to_the_gpu_whose_tenants_end_nearest_to_it(policy: str):
    allocator = two_gpus_ending_apart(policy)
    assert devices(allocator.allocate(share("long", 30000))) == ["gpu-1-mps"]  # type: ignore[arg-type]
    assert devices(allocator.allocate(share("short", 900))) == ["gpu-0-mps"]  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["binpack", "fragmentation"])
def test_without_a_hint_or_with_hints_off_the_policy_s_choice_stands(policy: str):
    assert devices(two_gpus_ending_apart(policy).allocate(share("plain"))) == ["gpu-0-mps"]  # type: ignore[arg-type]
    off = two_gpus_ending_apart(policy, hints=False)
    assert devices(off.allocate(share("long", 30000))) == ["gpu-0-mps"]  # type: ignore[arg-type]


def test_a_gpu_with_a_share_of_unknown_end_is_not_matched():
    allocator = cluster(first_gpus(2))
    hold(allocator, share("unknown"), "gpu-0-mps")  # no hint
    hold(allocator, share("late", 36000), "gpu-1-mps")
    hold(allocator, share("later", 36000), "gpu-1-mps")  # one less share of room than GPU 0: within tolerance
    assert devices(allocator.allocate(share("long", 30000))) == ["gpu-1-mps"]  # type: ignore[arg-type]
    assert allocator.state.expected_empty([("gpu.fgpu.dev", "n1", "gpu-0-mps")]) is None
    assert allocator.state.expected_empty([("gpu.fgpu.dev", "n1", "gpu-1-mps")]) == T0 + 36000


def test_the_fit_the_policy_prefers_beyond_the_tolerance_wins():
    allocator = cluster(first_gpus(2))
    hold(allocator, share("soon", 600), "gpu-0-mps")
    for i in range(5):  # GPU 1 has half its compute left, GPU 0 nine tenths: far from alike
        hold(allocator, share(f"late-{i}", 900), "gpu-1-mps")
    assert devices(allocator.allocate(share("short", 600))) == ["gpu-1-mps"]  # type: ignore[arg-type]


def test_binpack_across_nodes_takes_the_node_whose_shares_end_nearest():
    allocator = cluster([*first_gpus(1, "n1"), *first_gpus(1, "n2")])
    hold(allocator, share("soon", 600), "gpu-0-mps", "n1")
    hold(allocator, share("late", 36000), "gpu-0-mps", "n2")
    assert allocator.allocate(share("long", 30000)).node == "n2"  # type: ignore[union-attr]
    assert allocator.allocate(share("short", 900)).node == "n1"  # type: ignore[union-attr]
    assert allocator.allocate(share("plain")).node == "n1"  # type: ignore[union-attr]


def test_ends_are_forgotten_with_the_claim_s_last_share():
    allocator = cluster(first_gpus(1))
    claim = share("soon", 600)
    allocation = hold(allocator, claim, "gpu-0-mps")
    placement = allocator.allocate(share("other", 600))
    assert isinstance(placement, Placement)
    allocator.commit(placement)
    allocator.release(placement.node, placement.allocation, placement.claim)
    assert allocator.state.ends == {"uid-soon": T0 + 600}
    allocator.release("n1", {"devices": {"results": []}}, claim)  # nothing of it released: kept
    assert allocator.state.ends == {"uid-soon": T0 + 600}
    allocator.release("n1", allocation, claim)
    assert allocator.state.ends == {} and allocator.state.expected_empty([("gpu.fgpu.dev", "n1", "gpu-0-mps")]) is None


@pytest.mark.parametrize("policy", ["binpack", "fragmentation"])
def test_hints_read_or_not_place_unhinted_claims_alike(policy: str):
    """A stream of shares of several sizes arriving and leaving, placed twice: the claims with a
    hint by an allocator that does not read them, the same claims without one by one that does."""
    rng = random.Random(7)
    stream = [(f"c{i}", rng.choice(["5", "10", "20", "40"]), rng.uniform(60, 36000)) for i in range(120)]
    slices = [*first_gpus(2, "n1"), *first_gpus(2, "n2")]
    runs = []
    for hints, hinted in ((False, True), (True, False)):
        allocator, live, chosen = cluster(copy.deepcopy(slices), policy, hints), [], []
        leaving = random.Random(8)  # the same departures in both runs
        for name, compute, end in stream:
            if live and leaving.random() < 0.4:
                gone = live.pop(leaving.randrange(len(live)))
                allocator.release(gone.node, gone.allocation, gone.claim)
            outcome = allocator.allocate(share(name, end if hinted else None, compute))
            if isinstance(outcome, Placement):
                allocator.commit(outcome)
                live.append(outcome)
                chosen.append((outcome.node, devices(outcome)))
            else:
                chosen.append(("", []))
        runs.append(chosen)
    assert runs[0] == runs[1]


def test_the_controller_reads_hints_unless_told_not_to():
    def settings(*argv: str) -> ControllerSettings:
        parser = FlagParser(prog="fgpu controller")
        add_controller_flags(parser)
        return controller_settings(parser.parse_args(argv))

    assert settings().lifetime_hints is True
    assert settings("--no-lifetime-hints").lifetime_hints is False


def test_the_controller_counts_the_ends_of_shares_it_learns_from_claims():
    """A share counted from a claim's status (the controller's recount) keeps its claim's end."""
    allocator = cluster(first_gpus(1))
    result = {"request": "r", "driver": "gpu.fgpu.dev", "pool": "n1", "device": "gpu-0-mps", "shareID": "s1"}
    tenant = allocator.state.share_tenant(result, (), "a", "uid-soon")
    allocator.recount([], [(result, tenant)], {"uid-soon": T0 + 600})
    assert allocator.state.expected_empty([("gpu.fgpu.dev", "n1", "gpu-0-mps")]) == T0 + 600
    allocator.recount([(result, tenant)], [])
    assert allocator.state.ends == {}
