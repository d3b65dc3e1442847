"""Emptying whole nodes for the autoscaler: the planner's `emptying_nodes` on hand-built mock
dgx-h100 nodes. A node goes whole or not at all, only onto nodes that stay in use, fewest moves
first, and planning leaves the allocator as found."""

from __future__ import annotations

import copy

from driver.allocator.empty_nodes import emptying_nodes
from tests.support.holders import Cluster

EVERY_NODE = frozenset({"n1", "n2", "n3"})


def full(cluster: Cluster, node: str) -> None:
    """Every GPU of the node held whole by a pod that may not move: no room on it."""
    for gpu in range(8):
        cluster.whole(node, gpu)


def test_a_node_of_movable_shares_empties_onto_a_node_in_use_and_planning_changes_nothing():
    cluster = Cluster("n1", "n2")
    cluster.landing("n1")
    shares = [cluster.share("n2", 0, 20), cluster.share("n2", 1, 30)]
    state = copy.deepcopy(cluster.allocator.state)
    [plan] = emptying_nodes(cluster.allocator, cluster.holders, EVERY_NODE, limit=10)
    assert plan.node == "n2"
    assert {m.holder for m in plan.moves} == set(shares)
    assert {m.to.node for m in plan.moves} == {"n1"}
    assert cluster.allocator.state == state


def test_a_whole_gpu_moves_to_a_free_gpu_of_a_node_in_use():
    cluster = Cluster("n1", "n2")
    for gpu in range(4):
        cluster.whole("n1", gpu)  # GPUs 4-7 of n1 are free, the node is in use
    whole = cluster.whole("n2", 0, movable=True)
    [plan] = emptying_nodes(cluster.allocator, cluster.holders, EVERY_NODE, limit=10)
    [move] = plan.moves
    assert move.holder is whole and move.to.node == "n1"


def test_a_node_holding_anything_that_may_not_move_stays():
    cluster = Cluster("n1", "n2")
    cluster.landing("n1")
    cluster.share("n2", 0, 10)
    cluster.share("n2", 1, 10, movable=False)
    assert emptying_nodes(cluster.allocator, cluster.holders, EVERY_NODE, limit=10) == []


def test_only_the_nodes_the_caller_may_empty():
    cluster = Cluster("n1", "n2")
    cluster.landing("n1")
    cluster.share("n2", 0, 10)
    assert emptying_nodes(cluster.allocator, cluster.holders, frozenset({"n1"}), limit=10) == []


def test_an_idle_node_is_never_a_place_to_move_to():
    cluster = Cluster("n1", "n2", "n3")  # n3 holds nothing: moving there would keep a node all the same
    full(cluster, "n1")
    cluster.share("n2", 0, 10)
    assert emptying_nodes(cluster.allocator, cluster.holders, EVERY_NODE, limit=10) == []


def test_fewest_moves_first_within_the_limit():
    cluster = Cluster("n1", "n2", "n3")
    cluster.landing("n1")
    three = [cluster.share("n2", gpu, 10) for gpu in range(3)]
    one = cluster.share("n3", 0, 10)
    [plan] = emptying_nodes(cluster.allocator, cluster.holders, EVERY_NODE, limit=3)
    assert plan.node == "n3" and [m.holder for m in plan.moves] == [one]  # n2's three would pass the limit
    both = emptying_nodes(cluster.allocator, cluster.holders, EVERY_NODE, limit=4)
    assert [p.node for p in both] == ["n3", "n2"]
    assert {m.holder for m in both[1].moves} == set(three)
    assert all(m.to.node == "n1" for p in both for m in p.moves)


def test_a_node_a_move_went_to_is_not_emptied_afterwards():
    cluster = Cluster("n1", "n2", "n3")
    full(cluster, "n1")
    cluster.share("n2", 0, 10)
    cluster.share("n3", 0, 10)
    # n2's share can only go to n3, which then stays: one node emptied, not a swap of the two.
    [plan] = emptying_nodes(cluster.allocator, cluster.holders, EVERY_NODE, limit=10)
    assert plan.node == "n2" and [m.to.node for m in plan.moves] == ["n3"]


def test_a_node_whose_last_holder_fits_nowhere_is_left_whole():
    cluster = Cluster("n1", "n2")
    for gpu in range(8):
        cluster.share("n1", gpu, 60, movable=False)  # 19.5 GiB left on each GPU of n1
    cluster.share("n2", 0, 10)
    cluster.share("n2", 1, 40)  # fits no hole on n1: the 10 GiB one does not move alone
    state = copy.deepcopy(cluster.allocator.state)
    assert emptying_nodes(cluster.allocator, cluster.holders, EVERY_NODE, limit=10) == []
    assert cluster.allocator.state == state
