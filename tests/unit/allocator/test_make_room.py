"""The make-room planner on hand-built clusters of mock dgx-h100 nodes: which movable allocations
it evicts, in what order, where they go again, and that planning leaves the allocator as found."""

from __future__ import annotations

import argparse
import copy
from dataclasses import replace
from fractions import Fraction
from typing import Any

import pytest

from bench import make_room as make_room_bench
from bench.allocator import packing, packing_trace
from driver.allocator.cluster import Placement
from driver.allocator.make_room import Holder, Plan, compaction, make_room
from driver.scheduling.nodefit import NodeFacts, NodeRoom, PodNeeds
from tests.support.allocation import claim, exactly
from tests.support.holders import Cluster


def devices_of(plan: Plan) -> list[str]:
    return [r["device"] for p in plan.placements for r in p.allocation["devices"]["results"]]


def whole_gpus(count: int = 1, name: str = "pending") -> Any:
    return claim(name, exactly("gpu.fgpu.dev", count=count))


def apply(cluster: Cluster, plan: Plan) -> None:
    """What the controller does with a plan: the victims go, the pending claim and the moves land."""
    for victim in plan.victims:
        cluster.allocator.release(victim.node, victim.allocation)
    for placement in (*plan.placements, *plan.moves):
        cluster.allocator.commit(placement)


def overdrawn(cluster: Cluster) -> list[str]:
    """Counters drawn below zero: two allocations on one GPU's room."""
    return [
        f"{pool.id}/{counter_set}"
        for pools in cluster.allocator.snapshot.pools.values()
        for pool in pools
        for counter_set, counters in cluster.allocator.state.counters_left(pool).items()
        if any(value < 0 for value in counters.values())
    ]


def test_fewest_victims_first_then_least_given_back_then_youngest():
    cluster = Cluster("n1", "n2")
    for gpu in range(4):
        cluster.whole("n1", gpu)
    pair = [cluster.share("n1", 4, 5), cluster.share("n1", 4, 5)]  # two victims: last
    big = cluster.share("n1", 5, 40)
    old = cluster.share("n1", 6, 10, started=1)
    young = cluster.share("n1", 7, 10, started=2)
    cluster.landing("n2")
    plans = make_room(cluster.allocator, whole_gpus(), cluster.holders)
    assert [p.victims for p in plans] == [(young,), (old,), (big,), tuple(pair)]
    assert [p.cost[0] for p in plans] == [1, 1, 1, 2]
    assert devices_of(plans[0]) == ["gpu-7"] and plans[0].placements[0].node == "n1"


def two_lone_shares() -> tuple[Cluster, Holder, Holder]:
    """n1: six whole GPUs taken for good, a 5 GiB share alone on GPU 6, a 20 GiB one on GPU 7;
    n2: room for shares only. A whole GPU fits once either share goes."""
    cluster = Cluster("n1", "n2")
    for gpu in range(6):
        cluster.whole("n1", gpu)
    small, large = cluster.share("n1", 6, 5), cluster.share("n1", 7, 20)
    cluster.landing("n2")
    return cluster, small, large


def test_a_refused_plan_leaves_the_next_which_places_the_claim_and_its_victims():
    cluster, first, second = two_lone_shares()
    plans = make_room(cluster.allocator, whole_gpus(), cluster.holders)
    assert [p.victims for p in plans] == [(first,), (second,)]
    # The first eviction is refused (a PodDisruptionBudget): the next plan is applied instead.
    taken = plans[1]
    apply(cluster, taken)
    assert devices_of(taken) == ["gpu-7"]
    # The 20 GiB share moves next to the share whose eviction was refused: room that stayed.
    assert [m.allocation["devices"]["results"][0]["device"] for m in taken.moves] == ["gpu-6-mps"]
    assert overdrawn(cluster) == []
    assert first.allocation["devices"]["results"][0]["device"] == "gpu-6-mps"  # untouched, still there


def test_planning_again_with_a_refused_victim_kept_in_place_finds_the_others():
    cluster, refused, other = two_lone_shares()
    kept = [replace(h, movable=False) if h is refused else h for h in cluster.holders]
    assert [p.victims for p in make_room(cluster.allocator, whole_gpus(), kept)] == [(other,)]


def test_a_gang_that_needs_several_nodes():
    cluster = Cluster("n1", "n2", "n3")
    for node in ("n1", "n2"):
        for gpu in range(6):
            cluster.whole(node, gpu)
        for gpu in (6, 7):
            cluster.share(node, gpu, 10)
    cluster.landing("n3")
    gang = [whole_gpus(2, "worker-0"), whole_gpus(2, "worker-1")]
    plans = make_room(cluster.allocator, gang, cluster.holders)
    assert plans, "the gang fits once both nodes' shares move"
    best = plans[0]
    assert sorted(p.node for p in best.placements) == ["n1", "n2"]
    assert len(best.victims) == 4 and {m.node for m in best.moves} == {"n3"}
    apply(cluster, best)
    assert overdrawn(cluster) == []


def test_nothing_movable_no_plan():
    cluster = Cluster("n1", "n2")
    for gpu in range(7):
        cluster.whole("n1", gpu)
    cluster.share("n1", 7, 5, movable=False)
    cluster.landing("n2")
    assert make_room(cluster.allocator, whole_gpus(), cluster.holders) == []


def test_no_plan_when_the_claim_would_not_fit_even_with_everything_movable_gone():
    cluster = Cluster("n1", "n2")
    for gpu in range(6):
        cluster.whole("n1", gpu)
    cluster.share("n1", 6, 5)
    cluster.share("n1", 7, 5)
    cluster.landing("n2")
    assert make_room(cluster.allocator, whole_gpus(3), cluster.holders) == []
    assert make_room(cluster.allocator, [whole_gpus(2, "a"), whole_gpus(1, "b")], cluster.holders) == []


def test_a_claim_that_fits_already_needs_no_victims():
    cluster = Cluster("n1")
    cluster.share("n1", 0, 5)
    plans = make_room(cluster.allocator, whole_gpus(), cluster.holders)
    assert [p.victims for p in plans] == [()] and plans[0].cost == (0, 0, 0)


def test_planning_leaves_the_allocator_as_found():
    cluster = Cluster("n1", "n2")
    for gpu in range(5):
        cluster.whole("n1", gpu)
    for gpu in (5, 6, 7):
        cluster.share("n1", gpu, 10)
        cluster.share("n1", gpu, 20)
    cluster.share("n2", 0, 5)
    cluster.share("n2", 1, 40)
    state, order = copy.deepcopy(cluster.allocator.state), cluster.allocator.node_order()
    left = {
        p.id: cluster.allocator.state.counters_left(p) for ps in cluster.allocator.snapshot.pools.values() for p in ps
    }
    assert make_room(cluster.allocator, whole_gpus(3), cluster.holders)
    assert make_room(cluster.allocator, [whole_gpus(8, "a"), whole_gpus(1, "b")], cluster.holders)
    assert compaction(cluster.allocator, cluster.holders)
    assert cluster.allocator.state == state and cluster.allocator.node_order() == order
    after = {
        p.id: cluster.allocator.state.counters_left(p) for ps in cluster.allocator.snapshot.pools.values() for p in ps
    }
    assert after == left


def test_victims_moved_must_fit_elsewhere_not_in_the_room_they_made():
    cluster = Cluster("n1")
    for gpu in range(7):
        cluster.whole("n1", gpu)
    victim = cluster.share("n1", 7, 5)
    # Killed rather than moved, evicting it makes the room; moved, it has nowhere else to go.
    killed = make_room(cluster.allocator, whole_gpus(), cluster.holders, move=False)
    assert [p.victims for p in killed] == [(victim,)] and killed[0].moves == ()
    assert make_room(cluster.allocator, whole_gpus(), cluster.holders) == []


def test_compaction_empties_the_lightest_gpu_into_a_hole_elsewhere():
    cluster = Cluster("n1")
    for _ in range(3):
        cluster.share("n1", 0, 10)
    lone = cluster.share("n1", 1, 5)
    cluster.share("n1", 2, 60, movable=False)  # not movable: its GPU is a hole to fill, never emptied
    moves = compaction(cluster.allocator, cluster.holders)
    # The lone share goes into the fullest hole; GPU 0's three shares have nowhere to go whole.
    assert [(m.holder, m.to.allocation["devices"]["results"][0]["device"]) for m in moves] == [(lone, "gpu-2-mps")]
    assert compaction(cluster.allocator, cluster.holders, limit=0) == []


def test_the_bench_replays_bench_allocators_packing_trace_and_keeps_its_eviction_budget():
    small = argparse.Namespace(
        nodes=2, events=120, seed=3, budget=50, compaction_moves=2, departures=True, lifetimes=False
    )
    arrivals = packing_trace(small.events, small.seed)
    # Same arrivals and departures as `python -m bench.allocator packing`: the same GPUs in use.
    assert (
        make_room_bench.run("binpack", small, arrivals)["mean_gpus_used"] == packing(small)["binpack"]["mean_gpus_used"]
    )
    compacted = make_room_bench.run("compaction", small, arrivals)
    assert 0 < compacted["evictions"] <= small.budget * small.events / 1000
    crowded = argparse.Namespace(**{**vars(small), "nodes": 1, "seed": 1})  # claims fail: room is made
    made = make_room_bench.run("make-room", crowded, packing_trace(small.events, 1))
    assert made["made_room"] > 0 and made["evictions"] >= made["made_room"]


# --- with the nodes' room for pods: CPU, memory, pod count ------------------------------------------

ROOMY = {"cpu": 64, "memory": 512, "pods": 110}  # memory in GiB: only the sums matter here


class Pods:
    """The claims' pods (one each) and the nodes' room for them, as NodeRoom is built from them."""

    def __init__(self, **allocatable: dict[str, int]) -> None:
        self.nodes = [
            NodeFacts(node, allocatable={k: Fraction(v) for k, v in a.items()}) for node, a in allocatable.items()
        ]
        self.pods_of: dict[str, list[PodNeeds]] = {}
        self.running: list[tuple[str, PodNeeds]] = []

    def of(self, owner: Holder | Any, **requests: int) -> None:
        """The claim's pod and its requests; running on the holder's node if `owner` is a Holder."""
        c = owner.claim if isinstance(owner, Holder) else owner
        pod = PodNeeds(f"ns/{c.name}-pod", {k: Fraction(v) for k, v in requests.items()})
        self.pods_of[c.key] = [pod]
        if isinstance(owner, Holder):
            self.running.append((owner.node, pod))

    def room(self) -> NodeRoom:
        return NodeRoom(self.nodes, self.pods_of, self.running)


def crowded(policy: str = "binpack", n1: dict[str, int] = ROOMY, n3_cpu: int = 64) -> tuple[Cluster, Pods]:
    """n1: GPUs free for the holders a test puts there; n2: every GPU taken for good; n3: room for
    shares only, with `n3_cpu` CPUs. The holders the test adds on n1 need their pods too."""
    cluster = Cluster("n1", "n2", "n3", policy=policy)
    for gpu in range(8):
        cluster.whole("n2", gpu)
    cluster.landing("n3")
    pods = Pods(n1=n1, n2=ROOMY, n3={**ROOMY, "cpu": n3_cpu})
    for holder in cluster.holders:
        pods.of(holder)
    return cluster, pods


def pending_pod(pods: Pods) -> Any:
    pending = whole_gpus()
    pods.of(pending, cpu=16, memory=64)
    return pending


@pytest.mark.parametrize("lacks", ["cpu", "memory", "pods"])
@pytest.mark.parametrize("policy", ["binpack", "fragmentation"])
def test_a_claim_that_fits_by_its_devices_gets_victims_whose_pods_give_the_room_back(lacks, policy):
    cluster, pods = crowded(policy, n1={**ROOMY, "pods": 2} if lacks == "pods" else ROOMY)
    hog = cluster.share("n1", 0, 10)  # seven GPUs stay free: what n1 lacks is what its pod takes
    pods.of(hog, **{"cpu": {"cpu": 60}, "memory": {"memory": 500}, "pods": {}}[lacks])
    if lacks == "pods":
        pods.running.append(("n1", PodNeeds("ns/daemon")))  # the node's other pod slot
    pending = pending_pod(pods)
    room = pods.room()
    left = {node: room.left(node) for node in ("n1", "n2", "n3")}
    assert [p.victims for p in make_room(cluster.allocator, pending, cluster.holders)] == [()]  # by devices alone
    (plan,) = make_room(cluster.allocator, pending, cluster.holders, room=room)
    assert plan.victims == (hog,) and plan.placements[0].node == "n1"
    assert [m.node for m in plan.moves] == ["n3"]  # where its pod has room too
    assert {node: room.left(node) for node in left} == left  # the caller's room is read, never changed
    apply(cluster, plan)
    room.give_back(Placement(hog.claim, hog.node, hog.allocation))
    for placement in (*plan.placements, *plan.moves):
        assert room.fits(placement.claim, placement.node)
        room.take(placement)
    assert overdrawn(cluster) == []


@pytest.mark.parametrize("n3_cpu, victims", [(32, ["smaller"]), (16, [])], ids=["one fits", "none fits"])
def test_a_victim_whose_pod_would_not_fit_elsewhere_is_not_chosen(n3_cpu, victims):
    cluster, pods = crowded(n1={**ROOMY, "cpu": 80}, n3_cpu=n3_cpu)
    # Either holder's CPU makes room for the pending pod's 16; the younger one goes first by cost,
    # but its pod's 40 CPUs fit on no other node.
    younger, smaller = cluster.share("n1", 0, 10, started=2), cluster.share("n1", 1, 10, started=1)
    pods.of(younger, cpu=40)
    pods.of(smaller, cpu=30)
    pending = pending_pod(pods)
    plans = make_room(cluster.allocator, pending, cluster.holders, room=pods.room())
    named = {id(younger): "younger", id(smaller): "smaller"}
    assert [named[id(v)] for p in plans for v in p.victims] == victims
    assert all(m.node == "n3" for p in plans for m in p.moves)
