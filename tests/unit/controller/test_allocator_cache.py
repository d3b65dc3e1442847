"""The allocator kept from pass to pass (driver/controller/allocators.py): ready on a standby, told
only what changed in the slices."""

from __future__ import annotations

import json

from tests.support.controller_cluster import (
    claims_in,
    devices_of,
    fake_cluster,
    opt_in_claim,
    sync,
)


def test_a_standby_keeps_its_allocator_ready_and_writes_nothing(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    api.put("claims", opt_in_claim("x", 2))
    standby = replicas(api)
    standby.leader.leading = lambda: False  # type: ignore[method-assign]
    ready = standby.keep_ready()
    assert ready is not None and not api.status_writes and not api.store["ledgers"]
    standby.leader.leading = lambda: True  # type: ignore[method-assign]  # it wins the lease
    standby.run_pass()
    assert standby.allocators.allocator() is ready  # the first pass placed on it, nothing rebuilt
    assert len(devices_of(claims_in(api)["x"])) == 2


def test_new_slices_reach_the_allocator_without_gathering_other_nodes_again(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    api.put("claims", opt_in_claim("a", 8))
    controller = replicas(api)
    controller.run_pass()
    snapshot = controller.allocators.snapshot()
    n1_pools = snapshot.pools["n1"]
    for obj in json.loads(h100_slices.replace('"n1', '"n2'))["items"]:
        api.put("slices", obj)
    unreadable = json.loads(h100_slices.replace('"n1', '"n3'))["items"][0]
    unreadable["spec"]["sharedCounters"][0]["counters"]["memory-slice-0"]["value"] = "lots"
    api.put("slices", unreadable)
    api.put("claims", opt_in_claim("b", 8))
    sync(controller)
    controller.run_pass()
    assert controller.allocators.snapshot() is snapshot and snapshot.pools["n1"] is n1_pools  # n1 untouched
    assert {pool for pool, _ in devices_of(claims_in(api)["b"])} == {"n2"}
    assert {s.pool for s in controller.informers["slices"].items()} == {"n1", "n2"}  # n3's left out


# --- PodGroups (scheduling.k8s.io/v1beta1) with a gang policy ---------------------------------
