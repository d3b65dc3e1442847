"""Compaction that pays: the planner's `compaction` on hand-built mock dgx-h100 nodes and on a state
of the packing trace: plans by GPUs freed per eviction, none that pays less than asked, and only
the holders of GPUs that empty are moved."""

from __future__ import annotations

import argparse
import copy
from collections import defaultdict
from collections.abc import Sequence

from bench import make_room as make_room_bench
from bench.allocator import packing_trace
from driver.allocator.cluster import ClusterAllocator
from driver.allocator.make_room import GpuId, Holder, Move, compaction, gpus_of
from tests.support.holders import Cluster


def device(move: Move) -> str:
    return str(move.to.allocation["devices"]["results"][0]["device"])


def in_use(allocator: ClusterAllocator, holders: Sequence[Holder]) -> dict[GpuId, list[Holder]]:
    on_gpu: dict[GpuId, list[Holder]] = defaultdict(list)
    for holder in holders:
        for gpu in gpus_of(allocator, holder.node, holder.allocation):
            on_gpu[gpu].append(holder)
    return on_gpu


def holes() -> Cluster:
    """n1: GPU 0 holds a 60 GiB share and GPU 1 a 40 GiB one, neither movable (holes of 19.5 and
    39.5 GiB to move into); GPUs 2.. are for each test's movable shares."""
    cluster = Cluster("n1")
    cluster.share("n1", 0, 60, movable=False)
    cluster.share("n1", 1, 40, movable=False)
    return cluster


def test_only_plans_that_free_a_gpu_per_eviction_by_default():
    cluster = holes()
    three = [cluster.share("n1", 2, 5) for _ in range(3)]  # 3 evictions for one GPU: does not pay
    lone = cluster.share("n1", 3, 10)
    moves = compaction(cluster.allocator, cluster.holders, limit=4)
    assert [(m.holder, device(m)) for m in moves] == [(lone, "gpu-0-mps")]  # the tightest hole
    # Asked for a third of a GPU per eviction, the three go too, into the holes that are left.
    cheaper = compaction(cluster.allocator, cluster.holders, limit=4, pays=1 / 3)
    assert [m.holder for m in cheaper] == [lone, *three]


def test_the_plans_that_free_more_gpus_per_eviction_go_first():
    cluster = holes()
    [cluster.share("n1", 2, 5) for _ in range(3)]  # the least used GPU, but 3 evictions
    lone = cluster.share("n1", 3, 30)
    pair = [cluster.share("n1", 4, 5), cluster.share("n1", 4, 5)]
    moves = compaction(cluster.allocator, cluster.holders, limit=3, pays=0)
    # Within 3 evictions: the lone share (1 GPU for 1) then the pair (1 for 2): two GPUs, where
    # the least used GPU first would have freed one.
    assert [m.holder for m in moves] == [lone, *pair]
    assert {device(m) for m in moves} <= {"gpu-0-mps", "gpu-1-mps"}


def test_nothing_moves_when_nothing_would_empty():
    cluster = holes()
    cluster.share("n1", 2, 5)
    cluster.share("n1", 2, 70, movable=False)  # the GPU stays in use whatever moves: nothing pays
    cluster.share("n1", 3, 30)
    cluster.share("n1", 3, 20)  # the 30 fits the 39.5 GiB hole, then the 20 fits nowhere: both stay
    assert compaction(cluster.allocator, cluster.holders, pays=0) == []


def test_a_lone_share_with_no_hole_for_it_stays_and_the_next_plan_is_tried():
    cluster = holes()
    cluster.share("n1", 2, 60)  # no GPU in use has 60 GiB free
    small = cluster.share("n1", 3, 10)
    assert [m.holder for m in compaction(cluster.allocator, cluster.holders)] == [small]


def test_the_holders_moved_are_exactly_those_of_the_gpus_that_empty():
    """On the packing trace's state after 200 arrivals (two nodes), with any plan allowed: every
    GPU a move leaves holds nothing afterwards, every GPU a move goes to was in use before."""
    args = argparse.Namespace(nodes=2, events=200, seed=5, budget=0, compaction_moves=0)
    allocator, live = make_room_bench.replay(args, packing_trace(args.events, args.seed))
    holders = [entry.holder for entry in live]
    before = in_use(allocator, holders)
    state = copy.deepcopy(allocator.state)
    moves = compaction(allocator, holders, limit=12, pays=0)
    assert moves and allocator.state == state  # planning changes nothing
    make_room_bench.apply_moves(allocator, live, {id(m.holder): m.to for m in moves})
    after = in_use(allocator, [entry.holder for entry in live])
    left = {gpu for m in moves for gpu in gpus_of(allocator, m.holder.node, m.holder.allocation)}
    went = {gpu for m in moves for gpu in gpus_of(allocator, m.to.node, m.to.allocation)}
    assert left and not left & after.keys()  # emptied, each of them
    assert went <= before.keys() - left  # into holes on GPUs in use, none of those emptied
    moved = {id(m.holder) for m in moves}
    assert all(id(h) in moved for gpu in left for h in before[gpu])  # every holder of an emptied GPU
