"""Making room: evicting movable and lower-priority pods, reservations, budgets (never preempted
past), preemption within the pending claim's namespace unless told otherwise, compaction while
nothing waits."""

from __future__ import annotations

import time
from typing import Any

import pytest

from driver.controller.clock import WallClock
from driver.controller.emptying import EMPTYING_S, EMPTYING_TAINT, NodeEmptier
from driver.controller.fit import allocated_node
from driver.controller.victims import EvictionBudget
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
    sync,
)


def on_node(node: str) -> dict[str, Any]:
    return {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}


SHARE = {"clients": "1", "compute": "10", "memory": "10Gi"}


def held(name: str, device: str, created: str = "2026-01-01T00:00:00Z", node: str = "n1") -> dict[str, Any]:
    """A claim allocated earlier on the node: a whole GPU, or (device gpu-N-mps) a 10Gi MPS share."""
    share = device.endswith("-mps")
    exactly: dict[str, Any] = {"deviceClassName": "mps.gpu.fgpu.dev" if share else "gpu.fgpu.dev", "count": 1}
    result: dict[str, Any] = {"request": "r", "driver": "gpu.fgpu.dev", "pool": node, "device": device}
    if share:
        exactly["capacity"] = {"requests": {"memory": "10Gi"}}
        result |= {"shareID": f"share-{name}", "consumedCapacity": SHARE}
    meta = {"name": name, "namespace": "ml", "creationTimestamp": created}
    spec = {"devices": {"requests": [{"name": "r", "exactly": exactly}]}}
    return {
        "metadata": meta,
        "spec": spec,
        "status": {"allocation": {"devices": {"results": [result]}, "nodeSelector": on_node(node)}},
    }


def running(name: str, claim: str, movable: bool = False, owned: bool = True, priority: int = 0,
            created: str = "2026-01-01T00:00:00Z", node: str = "n1") -> dict[str, Any]:  # fmt: skip
    meta: dict[str, Any] = {"name": name, "namespace": "ml", "creationTimestamp": created}
    if movable:
        meta["annotations"] = {"gpu.fgpu.dev/movable": "true"}
    if owned:
        meta["ownerReferences"] = [{"kind": "ReplicaSet", "name": "rs", "uid": "rs-1", "controller": True}]
    spec = {"nodeName": node, "priority": priority, "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}]}
    return {"metadata": meta, "spec": spec, "status": {"phase": "Running"}}


def fragmented(api: InMemoryControllerApi, movable: bool = True, owned: bool = True, shares: int = 2) -> None:
    """n1: the last `shares` GPUs each hold one 10Gi MPS share (the later GPU's the younger), the
    others are whole, held by pods that are not movable: no GPU is free, though the shares fit on one."""
    for i in range(8 - shares):
        api.put("claims", held(f"whole-{i}", f"gpu-{i}"))
        api.put("pods", running(f"job-{i}", f"whole-{i}"))
    for i in range(8 - shares, 8):
        created = f"2026-01-0{i - 4}T00:00:00Z"
        api.put("claims", held(f"share-{i}", f"gpu-{i}-mps", created))
        api.put("pods", running(f"infer-{i}", f"share-{i}", movable, owned, created=created))


def pending_gpu(api: InMemoryControllerApi, name: str = "train", priority: int = 0, **spec: Any) -> None:
    api.put("claims", opt_in_claim(name, 1))
    pod = gated_pod(f"{name}-pod", name)
    pod["spec"] |= {"priority": priority, **spec}
    api.put("pods", pod)


def events_of(api: InMemoryControllerApi, name: str, reason: str | None = None) -> list[str]:
    return [
        e["message"]
        for e in api.events
        if e["involvedObject"]["name"] == name and (reason is None or e["reason"] == reason)
    ]


def gone(api: InMemoryControllerApi, claim: str) -> None:
    """kube-controller-manager's part once a pod is evicted: its (template's) claim is deleted."""
    api.store["claims"].pop(f"ml/{claim}")


def test_the_fewest_youngest_movable_pods_are_evicted_and_their_devices_held_for_the_claim(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    fragmented(api)
    pending_gpu(api)
    controller = replicas(api, evictions_per_minute=10)
    controller.run_pass()
    assert api.evicted == ["infer-7"]  # one pod is enough; GPU 7's is the younger
    (reservation,) = ledger_entries(api).values()
    assert reservation.claim == "ml/train" and reservation.results == (("gpu-7", ""),) and reservation.reservation
    assert "evicted by fgpu to make room for claim(s) ml/train on n1 (the pod is movable)" in events_of(
        api, "infer-7", "EvictedToMakeRoom"
    )
    assert any("making room on n1: evicted pod(s) ml/infer-7" in m for m in events_of(api, "train"))

    # The evicted pod's claim is gone; a claim older than train, pending now, may not take GPU 7.
    gone(api, "share-7")
    early = opt_in_claim("early", 1)
    early["metadata"]["creationTimestamp"] = "2025-01-01T00:00:00Z"
    api.put("claims", early)
    sync(controller)
    controller.run_pass()
    claims = claims_in(api)
    assert devices_of(claims["train"]) == [("n1", "gpu-7")] and not devices_of(claims["early"])
    assert not any(e.reservation for e in ledger_entries(api).values())  # train's own entry replaced it
    assert api.evicted == ["infer-7"]  # nothing is evicted for early: no movable pod would fit elsewhere
    assert gates(api, "train-pod") == []
    assert_no_device_given_twice(api)


def test_room_is_made_for_a_whole_gang_with_a_reservation_for_each_member(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    fragmented(api, shares=3)
    gang = {"gpu.fgpu.dev/gang": "g", "gpu.fgpu.dev/gang-size": "2"}
    for name in ("w0", "w1"):
        api.put("claims", opt_in_claim(name, 1, **gang))
        api.put("pods", gated_pod(f"{name}-pod", name))
    controller = replicas(api, evictions_per_minute=10)
    controller.run_pass()
    assert sorted(api.evicted) == ["infer-6", "infer-7"]  # the two youngest; both move onto GPU 5
    reserved = {e.claim: e.results for e in ledger_entries(api).values() if e.reservation}
    assert reserved == {"ml/w0": (("gpu-6", ""),), "ml/w1": (("gpu-7", ""),)} or reserved == {
        "ml/w0": (("gpu-7", ""),),
        "ml/w1": (("gpu-6", ""),),
    }
    for claim in ("share-6", "share-7"):
        gone(api, claim)
    sync(controller)
    controller.run_pass()
    placed = {n: devices_of(c) for n, c in claims_in(api).items() if n in ("w0", "w1")}
    assert sorted(d for devices in placed.values() for d in devices) == [("n1", "gpu-6"), ("n1", "gpu-7")]
    assert gates(api, "w0-pod") == gates(api, "w1-pod") == []


def test_a_budget_that_refuses_an_eviction_fails_the_plan_and_the_next_is_tried(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    fragmented(api)
    pending_gpu(api)
    api.budgeted = {"infer-7"}
    controller = replicas(api, evictions_per_minute=10)
    controller.run_pass()
    assert api.evicted == ["infer-6"]
    assert any("eviction of pod ml/infer-7 refused: Cannot evict pod" in m for m in events_of(api, "train"))
    (reservation,) = ledger_entries(api).values()
    assert reservation.results == (("gpu-6", ""),)  # the refused plan's reservation is gone


def test_nothing_is_evicted_when_every_plan_is_refused(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    fragmented(api)
    pending_gpu(api)
    api.budgeted = {"infer-6", "infer-7"}
    replicas(api, evictions_per_minute=10).run_pass()
    assert api.evicted == []
    assert not ledger_entries(api)


@pytest.mark.parametrize(
    "movable, owned, evictions",
    [(False, True, 10), (True, False, 10), (True, True, 0)],
    ids=["not annotated", "no controller recreates it", "making room off"],
)
def test_pods_not_movable_are_never_evicted(h100_slices, replicas, movable, owned, evictions):
    api = fake_cluster(h100_slices)
    fragmented(api, movable=movable, owned=owned)
    pending_gpu(api)
    replicas(api, evictions_per_minute=evictions).run_pass()
    assert api.evicted == [] and not ledger_entries(api)


def test_a_plan_over_the_eviction_budget_waits(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    fragmented(api)
    pending_gpu(api)
    controller = replicas(api, evictions_per_minute=1)
    assert controller.budget is not None
    controller.budget.spend(time.monotonic())  # the minute's one eviction is spent
    controller.run_pass()
    assert api.evicted == [] and not ledger_entries(api)
    assert any("waiting for the eviction budget" in m for m in events_of(api, "train"))


def test_a_reservation_is_dropped_once_its_claim_is_gone(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    fragmented(api)
    pending_gpu(api)
    controller = replicas(api, evictions_per_minute=10)
    controller.run_pass()
    assert ledger_entries(api)
    gone(api, "train")
    sync(controller)
    controller.run_pass()
    assert not ledger_entries(api)


def test_a_higher_priority_pod_preempts_a_lower_one_that_is_not_movable(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    for i in range(8):
        api.put("claims", held(f"whole-{i}", f"gpu-{i}"))
        api.put("pods", running(f"job-{i}", f"whole-{i}", owned=False, priority=100 if i != 3 else 10))
    pending_gpu(api, priority=50)
    controller = replicas(api, evictions_per_minute=10)
    controller.run_pass()
    assert api.evicted == ["job-3"]
    assert "the pod has a lower priority" in events_of(api, "job-3", "Preempted")[0]
    gone(api, "whole-3")
    sync(controller)
    controller.run_pass()
    assert devices_of(claims_in(api)["train"]) == [("n1", "gpu-3")]


@pytest.mark.parametrize("priority, spec", [(10, {}), (50, {"preemptionPolicy": "Never"})], ids=["equal", "never"])
def test_no_preemption_at_equal_priority_or_when_the_pod_says_never(h100_slices, replicas, priority, spec):
    api = fake_cluster(h100_slices)
    for i in range(8):
        api.put("claims", held(f"whole-{i}", f"gpu-{i}"))
        api.put("pods", running(f"job-{i}", f"whole-{i}", owned=False, priority=10))
    pending_gpu(api, priority=priority, **spec)
    replicas(api, evictions_per_minute=10).run_pass()
    assert api.evicted == []


def test_preemption_never_goes_past_a_disruption_budget(h100_slices, replicas):
    """kube-scheduler deletes its victims when every choice is refused by a budget; a tenant able
    to use a higher PriorityClass would so disrupt another's pods past their budgets."""
    api = fake_cluster(h100_slices)
    for i in range(8):
        api.put("claims", held(f"whole-{i}", f"gpu-{i}"))
        api.put("pods", running(f"job-{i}", f"whole-{i}", owned=False, priority=10))
    api.budgeted = {f"job-{i}" for i in range(8)}
    pending_gpu(api, priority=50)
    pods = set(api.store["pods"])
    replicas(api, evictions_per_minute=10).run_pass()
    assert api.evicted == [] and set(api.store["pods"]) == pods
    assert not ledger_entries(api)


@pytest.mark.parametrize("across", [False, True], ids=["own namespace only", "across namespaces"])
def test_preemption_takes_other_namespaces_pods_only_when_told_to(h100_slices, replicas, across):
    api = fake_cluster(h100_slices)
    for i in range(8):
        claim, pod = held(f"whole-{i}", f"gpu-{i}"), running(f"job-{i}", f"whole-{i}", owned=False, priority=10)
        claim["metadata"]["namespace"] = pod["metadata"]["namespace"] = "web"  # another tenant's
        api.put("claims", claim)
        api.put("pods", pod)
    pending_gpu(api, priority=50)  # in ml
    replicas(api, evictions_per_minute=10, preempt_across_namespaces=across).run_pass()
    assert len(api.evicted) == across


def test_the_eviction_budget_is_a_sliding_minute():
    budget = EvictionBudget(2)
    budget.spend(0.0)
    budget.spend(30.0)
    assert budget.left(59.9) == 0
    assert budget.left(60.0) == 1  # the first eviction is a minute old
    assert budget.left(90.0) == 2


def test_while_nothing_waits_compaction_empties_the_lightest_gpu_into_a_hole(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    fragmented(api)  # GPUs 6 and 7 each hold one movable 10Gi share
    controller = replicas(api, evictions_per_minute=10, compact=True)
    controller.run_pass()
    assert len(api.evicted) == 1 and api.evicted[0] in ("infer-6", "infer-7")
    assert "its GPU empties" in events_of(api, api.evicted[0], "Compacted")[0]
    assert not ledger_entries(api)  # no reservation: the moved pod's new claim is placed as any other


@pytest.mark.parametrize("busy", ["a claim waits", "a gated pod waits", "a share that may not move"])
def test_compaction_waits_while_anything_waits_and_leaves_a_gpu_something_holds(h100_slices, replicas, busy):
    api = fake_cluster(h100_slices)
    fragmented(api)
    if busy == "a claim waits":
        api.put("claims", opt_in_claim("later", 99))
    elif busy == "a gated pod waits":
        pod = gated_pod("replacement", "")
        pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "t"}]  # claim not made yet
        api.put("pods", pod)
    else:
        for i in (6, 7):  # beside each movable share, one that stays
            api.put("claims", held(f"stays-{i}", f"gpu-{i}-mps"))
            api.put("pods", running(f"stays-{i}", f"stays-{i}"))
    replicas(api, evictions_per_minute=10, compact=True).run_pass()
    assert api.evicted == []


def cpus(pod: dict[str, Any], count: int) -> dict[str, Any]:
    pod["spec"]["containers"] = [{"name": "c", "resources": {"requests": {"cpu": str(count)}}}]
    return pod


def test_a_claim_that_fits_by_its_devices_but_waits_for_cpu_gets_room_made(h100_slices, replicas):
    api = fake_cluster(h100_slices, nodes=2)
    for node in ("n1", "n2"):
        api.store["nodes"][f"/{node}"]["status"] = {"allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110"}}
    # n1: seven GPUs free, but a movable share's pod takes 60 of its 64 CPUs; n2: no GPU free, room
    # beside a share that stays for another share, and CPUs to spare.
    api.put("claims", held("infer", "gpu-0-mps"))
    api.put("pods", cpus(running("infer", "infer", movable=True), 60))
    for i in range(7):
        api.put("claims", held(f"whole-{i}", f"gpu-{i}", node="n2"))
        api.put("pods", running(f"job-{i}", f"whole-{i}", node="n2"))
    api.put("claims", held("stays", "gpu-7-mps", node="n2"))
    api.put("pods", running("stays", "stays", node="n2"))
    pending_gpu(api)
    cpus(api.store["pods"]["ml/train-pod"], 16)
    controller = replicas(api, evictions_per_minute=10)
    controller.run_pass()
    assert api.evicted == ["infer"]
    (reservation,) = ledger_entries(api).values()
    assert reservation.claim == "ml/train" and reservation.reservation


def daemonset_pod(name: str, node: str) -> dict[str, Any]:
    meta = {"name": name, "namespace": "kube-system"}
    meta["ownerReferences"] = [{"kind": "DaemonSet", "name": "ds", "uid": "ds-1", "controller": True}]
    return {"metadata": meta, "spec": {"nodeName": node}, "status": {"phase": "Running"}}


def one_node_to_empty(api: InMemoryControllerApi) -> None:
    """n1: a 10Gi share on each GPU that stays (holes to move into); n2: two movable 10Gi shares
    and a DaemonSet's pod."""
    for i in range(8):
        api.put("claims", held(f"stays-{i}", f"gpu-{i}-mps"))
        api.put("pods", running(f"stays-{i}", f"stays-{i}"))
    for i in range(2):
        api.put("claims", held(f"infer-{i}", f"gpu-{i}-mps", node="n2"))
        api.put("pods", running(f"infer-{i}", f"infer-{i}", movable=True, node="n2"))
    api.put("pods", daemonset_pod("exporter", "n2"))


def emptying_taints(api: InMemoryControllerApi, node: str) -> list[dict[str, Any]]:
    taints = (api.store["nodes"][f"/{node}"].get("spec") or {}).get("taints") or []
    return [t for t in taints if t["key"] == EMPTYING_TAINT]


def test_empty_nodes_taints_a_node_of_movable_shares_then_moves_them_all_onto_a_node_in_use(h100_slices, replicas):
    api = fake_cluster(h100_slices, nodes=2)
    one_node_to_empty(api)
    controller = replicas(api, evictions_per_minute=10, compact=True, empty_nodes=True)
    controller.run_pass()
    assert sorted(api.evicted) == ["infer-0", "infer-1"]  # the DaemonSet's pod stays: it does not keep a node
    [taint] = emptying_taints(api, "n2")
    assert taint["effect"] == "NoSchedule"
    assert all("empty node n2 for the autoscaler: the pod fits on n1" in events_of(api, p, "EmptyingNode")[0]
               for p in api.evicted)  # fmt: skip
    assert emptying_taints(api, "n1") == []


def test_without_empty_nodes_compaction_only_empties_gpus(h100_slices, replicas):
    api = fake_cluster(h100_slices, nodes=2)
    one_node_to_empty(api)
    replicas(api, evictions_per_minute=10, compact=True).run_pass()
    assert len(api.evicted) == 2 and api.taint_writes == 0
    assert all(events_of(api, p, "Compacted") for p in api.evicted)


@pytest.mark.parametrize(
    "keeps", ["a pod without claims", "a share that may not move", "a movable share not yet Running",
              "a movable share not yet bound"]
)  # fmt: skip
def test_a_node_running_anything_else_is_not_emptied(h100_slices, replicas, keeps):
    """Nor is a node about to run a movable share (its claim allocated there, its pod not yet
    Running): moved before it starts, the pod only waits again."""
    api = fake_cluster(h100_slices, nodes=2)
    one_node_to_empty(api)
    if keeps == "a pod without claims":
        api.put("pods", {"metadata": {"name": "web", "namespace": "ml"}, "spec": {"nodeName": "n2"},
                         "status": {"phase": "Running"}})  # fmt: skip
    else:
        api.put("claims", held("young", "gpu-5-mps", node="n2"))
        api.put("pods", running("young", "young", movable=keeps != "a share that may not move", node="n2"))
        pod = api.store["pods"]["ml/young"]
        if keeps == "a movable share not yet Running":
            pod["status"]["phase"] = "Pending"
        elif keeps == "a movable share not yet bound":
            pod["spec"].pop("nodeName")
            pod["status"]["phase"] = "Pending"
    replicas(api, evictions_per_minute=10, compact=True, empty_nodes=True).run_pass()
    assert api.taint_writes == 0  # GPU compaction may still move the shares
    assert all(events_of(api, p, "Compacted") for p in api.evicted)
    assert "young" not in api.evicted


def test_a_claim_that_waits_lifts_the_emptying_taint_and_is_placed_there_not_marked(h100_slices, replicas):
    api = fake_cluster(h100_slices, nodes=2)
    for i in range(8):  # n1 full; n2 free but being emptied
        api.put("claims", held(f"whole-{i}", f"gpu-{i}"))
        api.put("pods", running(f"job-{i}", f"whole-{i}"))
    api.store["nodes"]["/n2"]["spec"] = {"taints": [{"key": EMPTYING_TAINT, "value": "1", "effect": "NoSchedule"}]}
    pending_gpu(api)
    controller = replicas(api, evictions_per_minute=10, compact=True, empty_nodes=True)
    controller.run_pass()
    assert emptying_taints(api, "n2") == []
    assert not (api.get("pods", "ml/train-pod").get("status") or {}).get("conditions")  # not marked unschedulable
    sync(controller)
    controller.run_pass()
    assert devices_of(api.get("claims", "ml/train")) and allocated_node(api.get("claims", "ml/train")) == "n2"


def test_an_emptying_taint_is_lifted_after_its_time_by_this_process_clock(h100_slices, replicas):
    api = fake_cluster(h100_slices, nodes=2)
    api.store["nodes"]["/n2"]["spec"] = {"taints": [{"key": EMPTYING_TAINT, "value": "9", "effect": "NoSchedule"}]}
    controller = replicas(api)
    now = [1000.0]
    emptier = NodeEmptier(api, controller.informers["nodes"], WallClock(offset_s=-86400), clock=lambda: now[0])
    assert emptier.lift(every=False) == 0  # a taint left by an earlier leader: its time starts now
    assert emptier.taint("n1")
    now[0] += EMPTYING_S - 1
    assert emptier.lift(every=False) == 0
    now[0] += 1
    assert emptier.lift(every=False) == 2
    assert emptying_taints(api, "n1") == emptying_taints(api, "n2") == []


@pytest.mark.parametrize(("owner", "evicts"), [("rs-1", False), ("rs-2", True)])
def test_no_room_is_made_by_evicting_the_pending_pods_own_replicaset_siblings(h100_slices, replicas, owner, evicts):
    """A ReplicaSet's pod evicted for its sibling is made again and waits in turn: moving it would
    only go round."""
    api = fake_cluster(h100_slices)
    fragmented(api)  # the movable shares are ReplicaSet rs-1's
    pending_gpu(api)
    pod = api.store["pods"]["ml/train-pod"]
    pod["metadata"]["ownerReferences"] = [{"kind": "ReplicaSet", "name": "rs", "uid": owner, "controller": True}]
    replicas(api, evictions_per_minute=10).run_pass()
    assert bool(api.evicted) is evicts


@pytest.mark.parametrize(("owner", "evicts"), [("rs-7", False), ("rs-9", True)])
def test_a_moved_pods_controller_gets_no_room_made_by_moving_others_for_a_while(h100_slices, replicas, owner, evicts):
    """infer-7 is moved for train; its ReplicaSet's next pod (here one that needs a whole GPU) fits
    nowhere: moving infer-6 for it would only start a chain of moves, one for each pod made again.
    Another controller's pod gets room made as before."""
    api = fake_cluster(h100_slices)
    fragmented(api, shares=3)
    for i in (5, 6, 7):
        api.store["pods"][f"ml/infer-{i}"]["metadata"]["ownerReferences"][0]["uid"] = f"rs-{i}"
    pending_gpu(api)
    controller = replicas(api, evictions_per_minute=10)
    controller.run_pass()
    assert api.evicted == ["infer-7"]
    gone(api, "share-7")
    pending_gpu(api, "again")
    api.store["pods"]["ml/again-pod"]["metadata"]["ownerReferences"] = [
        {"kind": "ReplicaSet", "name": "rs", "uid": owner, "controller": True}
    ]
    sync(controller)
    controller.run_pass()
    assert devices_of(claims_in(api)["train"]) == [("n1", "gpu-7")]
    assert (api.evicted == ["infer-7", "infer-6"]) is evicts
    assert_no_device_given_twice(api)
