"""The ledger fence: each unit recorded in the pools' ledgers before its claims are written, two
replicas that both believe they lead, conflicts, decisions left by a stopped replica, writes in
flight."""

from __future__ import annotations

from typing import Any

import pytest

from driver.controller.controller import MAX_IN_FLIGHT
from driver.controller.ledger import FENCE_ANNOTATION, Entry, ledger_name
from driver.kube.errors import ConflictError
from driver.kube.informer import object_key
from tests.support.controller_cluster import (
    assert_no_device_given_twice,
    claims_in,
    devices_of,
    fake_cluster,
    gated_pod,
    gates,
    ledger_entries,
    opt_in_claim,
    sync,
)


def test_the_ledger_records_the_claim_before_its_status_and_only_our_gate_is_lifted(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    api.put("claims", opt_in_claim("train", 2))
    api.put("pods", gated_pod("trainer", "train"))
    replicas(api).run_pass()
    claim = claims_in(api)["train"]
    assert len(devices_of(claim)) == 2
    assert "resource.kubernetes.io/delete-protection" in claim["metadata"]["finalizers"]
    (entry,) = ledger_entries(api).values()
    assert entry.claim == "ml/train" and {("n1", d) for d, _ in entry.results} == set(devices_of(claim))
    assert int(entry.version) < int(claim["metadata"]["resourceVersion"])  # the status write's precondition
    assert gates(api, "trainer") == []


def test_a_conflict_ends_the_pass_and_the_claims_are_read_afresh(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    claim = api.put("claims", opt_in_claim("train", 2))
    controller = replicas(api)
    api.put("claims", {**claim, "metadata": {**claim["metadata"], "labels": {**claim["metadata"]["labels"], "x": "y"}}})
    controller.run_pass()  # its copy of the claim is stale: the write conflicts, nothing is allocated
    assert not api.status_writes and not ledger_entries(api)
    assert controller.informers["claims"].get("ml/train")["metadata"]["labels"]["x"] == "y"  # read afresh
    controller.run_pass()
    assert len(devices_of(claims_in(api)["train"])) == 2


def test_two_replicas_that_both_lead_never_give_a_device_twice(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    first, second = replicas(api, "a"), replicas(api, "b")  # both synced while nothing was allocated
    api.put("claims", opt_in_claim("x", 6))
    sync(first, "claims")
    first.run_pass()
    assert len(devices_of(claims_in(api)["x"])) == 6
    # The second replica's cache never saw x nor the ledger (as after a pause): it places y on GPUs
    # x holds, and its ledger write conflicts; it reads afresh and finds y cannot fit.
    second.informers["claims"].update(api.put("claims", opt_in_claim("y", 6)))
    second.run_pass()
    assert devices_of(claims_in(api)["y"]) == []
    assert second.informers["claims"].get("ml/x")["status"]["allocation"]  # read afresh
    second.run_pass()
    assert devices_of(claims_in(api)["y"]) == []
    assert [e["reason"] for e in api.events] == ["FailedAllocation"]
    assert_no_device_given_twice(api)


def test_a_decision_left_by_a_stopped_replica_is_voided_before_its_claim_is_placed_again(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    api.put("claims", opt_in_claim("x", 8))
    stopped = replicas(api, "a")
    real_change = stopped.ledgers.change

    def change_then_stop(*args: Any, **kwargs: Any) -> bool:
        ok = real_change(*args, **kwargs)
        stopped.leader.leading = lambda: False  # type: ignore[method-assign]  # SIGSTOP right after the ledger write
        return ok

    stopped.ledgers.change = change_then_stop  # type: ignore[method-assign]
    stopped.run_pass()
    (decided,) = ledger_entries(api).values()
    assert devices_of(claims_in(api)["x"]) == []
    held = stopped.informers["claims"].get("ml/x")  # what it will write when it resumes
    assert held["metadata"]["resourceVersion"] == decided.version

    successor = replicas(api, "b")
    successor.run_pass()
    claim = claims_in(api)["x"]
    assert claim["metadata"]["annotations"][FENCE_ANNOTATION] == decided.version
    assert len(devices_of(claim)) == 8
    (entry,) = ledger_entries(api).values()
    assert entry.version != decided.version
    allocation = {"devices": {"results": [{"driver": "gpu.fgpu.dev", "pool": "n1", "device": "gpu-0"}]}}
    with pytest.raises(ConflictError):  # the resumed replica's write of its old decision fails
        api.replace_claim_status({**held, "status": {"allocation": allocation}})


def test_an_entry_holds_the_devices_until_its_claim_is_gone(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    api.put("claims", opt_in_claim("x", 8))
    controller = replicas(api)
    controller.run_pass()
    x = claims_in(api)["x"]
    controller.informers["claims"].update({**x, "status": {}})  # a cache that lost x's allocation
    controller.informers["claims"].update(api.put("claims", opt_in_claim("y", 8)))
    controller.run_pass()  # the ledger still holds x's GPUs: y waits
    assert devices_of(claims_in(api)["y"]) == [] and len(devices_of(claims_in(api)["x"])) == 8
    del api.store["claims"]["ml/x"]
    sync(controller, "claims")  # the watch's DELETED
    controller.run_pass()  # x's entry is checked against the API server: x is gone, so is its entry
    assert [e.claim for e in ledger_entries(api).values()] == ["ml/y"]
    assert len(devices_of(claims_in(api)["y"])) == 8


def test_writes_overlap_with_a_bound_on_how_many(h100_slices, replicas):
    claims = MAX_IN_FLIGHT + 32
    api = fake_cluster(h100_slices, nodes=claims // 8)
    for i in range(claims):
        api.put("claims", opt_in_claim(f"c{i:03d}", 1))
    api.write_delay_s = 0.02
    replicas(api).run_pass()
    assert 1 < api.most_in_flight <= MAX_IN_FLIGHT
    assert api.ledger_writes < claims  # units that reach a ledger together share one write
    assert all(len(devices_of(c)) == 1 for c in claims_in(api).values())
    assert_no_device_given_twice(api)


def test_a_status_write_that_may_have_landed_keeps_its_entry(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    api.put("claims", opt_in_claim("x", 8))
    api.lost_replies = {1}  # x's allocation is written, the answer is lost
    first = replicas(api, "a")
    first.run_pass()
    assert len(devices_of(claims_in(api)["x"])) == 8
    (entry,) = ledger_entries(api).values()  # not dropped on a failure that may be a success
    assert entry.claim == "ml/x"
    # A replica whose cache never saw x allocated (its watch lags) counts the entry: y must wait.
    second = replicas(api, "b")
    x = claims_in(api)["x"]
    second.informers["claims"].update(
        {**x, "metadata": {**x["metadata"], "resourceVersion": entry.version}, "status": {}}
    )
    second.informers["claims"].update(api.put("claims", opt_in_claim("y", 1)))
    second.run_pass()
    assert devices_of(claims_in(api)["y"]) == []
    assert api.status_writes == ["x"]  # nor is x placed again: its entry was checked against the claim
    assert_no_device_given_twice(api)


def _drop_node(api, node: str) -> None:
    """The node an autoscaler removed: its slices go with it."""
    for key in [k for k, s in api.store["slices"].items() if s["spec"].get("nodeName") == node]:
        del api.store["slices"][key]
    del api.store["nodes"][f"/{node}"]


def test_the_ledger_of_a_pool_that_is_gone_is_deleted_once_it_records_nothing(h100_slices, replicas):
    api = fake_cluster(h100_slices, nodes=2)
    api.put("claims", opt_in_claim("x", 8))
    api.put("claims", opt_in_claim("y", 8))
    controller = replicas(api)
    controller.run_pass()
    held = {
        claim["status"]["allocation"]["devices"]["results"][0]["pool"]: name for name, claim in claims_in(api).items()
    }
    assert set(held) == {"n1", "n2"} and ledger_entries(api, "n1") and ledger_entries(api, "n2")
    _drop_node(api, "n2")
    sync(controller, "slices", "nodes")
    controller.run_pass()  # its claim still holds the entry: the ledger stays
    assert ledger_entries(api, "n2")
    del api.store["claims"][f"ml/{held['n2']}"]
    sync(controller, "claims")
    controller.run_pass()  # the entry goes, then the ledger: no pool, nothing recorded
    assert set(api.store["ledgers"]) == {f"fgpu/{ledger_name(('gpu.fgpu.dev', 'n1'))}"}
    assert not controller.informers["ledgers"].get(f"fgpu/{ledger_name(('gpu.fgpu.dev', 'n2'))}")
    del api.store["claims"][f"ml/{held['n1']}"]
    sync(controller, "claims")
    controller.run_pass()  # n1's ledger records nothing now, but its pool is there: kept
    assert f"fgpu/{ledger_name(('gpu.fgpu.dev', 'n1'))}" in api.store["ledgers"] and not ledger_entries(api, "n1")


def test_a_ledger_another_replica_wrote_to_since_is_not_deleted(h100_slices, replicas):
    api = fake_cluster(h100_slices, nodes=2)
    api.put("claims", opt_in_claim("x", 8))
    api.put("claims", opt_in_claim("y", 8))
    first = replicas(api, "a")
    first.run_pass()
    n2 = f"fgpu/{ledger_name(('gpu.fgpu.dev', 'n2'))}"
    on_n2 = next(
        c for c in claims_in(api).values() if c["status"]["allocation"]["devices"]["results"][0]["pool"] == "n2"
    )
    del api.store["claims"][f"ml/{on_n2['metadata']['name']}"]
    _drop_node(api, "n2")
    sync(first)
    stale = replicas(api, "b")  # reads the ledger with the entry of a claim that is gone
    first.run_pass()  # drops the entry, deletes the ledger
    assert n2 not in api.store["ledgers"]
    # A replica whose cache holds the ledger as it was (the entry still in) drops the entry
    # first: its write is refused (the ledger is gone), so it reads afresh and deletes nothing.
    ledger = stale.informers["ledgers"].get(n2)
    assert ledger["data"]
    stale.run_pass()
    assert n2 not in api.store["ledgers"]
    # One written to after this replica read it (another replica's entry) is kept.
    empty = api.put("ledgers", {**ledger, "data": {}})
    sync(stale, "ledgers")
    api.put("ledgers", {**empty, "data": {"u": Entry("ml/z", "1", (("gpu-0", ""),), ({},)).encode()}})
    stale.ledgers.begin(stale.informers["ledgers"].items())  # as a pass begins: the empty ledger
    assert not next(o for o in stale.ledgers.objects() if object_key(o) == n2)["data"]
    stale.writer.retire_gone_pools()
    assert api.store["ledgers"][n2]["data"]
