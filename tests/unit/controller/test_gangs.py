"""Labelled gangs: placed whole once every claim exists, completed after an interruption, taken
back all or none, and a stale take-back fenced off."""

from __future__ import annotations

from driver.controller.ledger import FENCE_ANNOTATION
from testbed.controller_api import InMemoryControllerApi
from tests.support.controller_cluster import (
    assert_no_device_given_twice,
    claims_in,
    devices_of,
    fake_cluster,
    gated_pod,
    gates,
    ledger_entries,
    opt_in_claim,
)


def test_controller_waits_for_the_whole_gang_and_reports_once(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    gang = {"gpu.fgpu.dev/gang": "g", "gpu.fgpu.dev/gang-size": "3"}
    for obj in [opt_in_claim(f"w{i}", 2, **gang) for i in range(2)] + [opt_in_claim("huge", 9)]:
        api.put("claims", obj)
    controller = replicas(api)
    controller.run_pass()
    controller.run_pass()
    assert not api.status_writes
    reasons = sorted((e["involvedObject"]["name"], e["reason"], e["message"]) for e in api.events)
    assert [r[:2] for r in reasons] == [
        ("huge", "FailedAllocation"),
        ("w0", "WaitingForGang"),
        ("w1", "WaitingForGang"),
    ]
    assert "waits for 1 more claim(s) of 3" in reasons[1][2]
    controller.informers["claims"].update(api.put("claims", opt_in_claim("w2", 2, **gang)))
    controller.run_pass()
    assert sorted(api.status_writes) == ["w0", "w1", "w2"]


def gang_with_pods(slices: str, size: int) -> InMemoryControllerApi:
    """A gang of `size` claims of 2 GPUs (w0, w1, ...), a gated pod for each (p0, p1, ...)."""
    api = fake_cluster(slices)
    gang = {"gpu.fgpu.dev/gang": "g", "gpu.fgpu.dev/gang-size": str(size)}
    for i in range(size):
        api.put("claims", opt_in_claim(f"w{i}", 2, **gang))
        api.put("pods", gated_pod(f"p{i}", f"w{i}"))
    return api


def test_a_gang_interrupted_by_an_outage_is_completed_after_a_fresh_read_its_pods_released_then(h100_slices, replicas):
    api = gang_with_pods(h100_slices, 3)
    api.failing_status_writes = {3}  # two members written, the third write fails
    controller = replicas(api)
    controller.run_pass()
    # Nothing is taken back on the view that just proved stale. The third entry stays too: with no
    # answer, w2's write may have landed, until a pass reads w2 afresh (then voids the decision).
    assert [len(devices_of(claims_in(api)[f"w{i}"])) for i in range(3)] == [2, 2, 0]
    assert sorted(e.claim for e in ledger_entries(api).values()) == ["ml/w0", "ml/w1", "ml/w2"]
    assert all(gates(api, f"p{i}") == ["gpu.fgpu.dev/allocation"] for i in range(3))
    controller.gates.lift_all = lambda: None  # type: ignore[method-assign]  # no sweep: the unit lifts them
    controller.run_pass()
    assert all(len(devices_of(c)) == 2 for c in claims_in(api).values())
    assert api.status_writes == ["w0", "w1", "w2", "w2"]  # only the missing member was placed again
    assert FENCE_ANNOTATION in claims_in(api)["w2"]["metadata"]["annotations"]
    assert sorted(e.claim for e in ledger_entries(api).values()) == ["ml/w0", "ml/w1", "ml/w2"]
    assert all(gates(api, f"p{i}") == [] for i in range(3))
    assert_no_device_given_twice(api)


def test_a_take_back_decided_before_another_replica_completed_the_gang_fails(h100_slices, replicas):
    api = gang_with_pods(h100_slices, 2)
    api.failing_status_writes = {2}
    stale = replicas(api, "a")
    stale.run_pass()  # w0 written, w1 not
    decided_on = stale.informers["claims"].get("ml/w0")  # it decides to take w0 back, then stops
    successor = replicas(api, "b")
    successor.run_pass()  # completes the gang, w0 kept
    assert all(len(devices_of(c)) == 2 for c in claims_in(api).values())
    assert all(gates(api, f"p{i}") == [] for i in range(2))
    stale.writer.take_back([decided_on])  # it resumes: the write its decision leads to
    assert all(len(devices_of(c)) == 2 for c in claims_in(api).values())  # refused: w0 was fenced
    assert_no_device_given_twice(api)
