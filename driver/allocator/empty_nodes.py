"""Emptying whole nodes, for fleets whose autoscaler removes a node once it is empty (Karpenter,
Cluster Autoscaler): which movable allocations to move so that a node holds nothing. Pure, like
make_room.py: planned on the allocator's own state, every change undone before returning
(docs/allocator.md, "Emptying nodes for the autoscaler").

A node is emptied whole or not at all: every allocation on it moves, so each must be movable, and
the caller says which nodes run nothing else that would keep them (`may_empty`). The moved
allocations go only to nodes that stay in use (they hold something that does not move): never to
an idle node (it would then stay), nor to one emptied before it; a node a move went to is not
emptied afterwards. Nodes that cannot be emptied are tried first, the others only for what fits
none of those (a move onto a node that could have emptied costs that node). Nodes with the fewest
allocations go first (a node for the fewest evictions), then those giving back the least GPU."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from driver.allocator.allocate import SEARCH_STEPS, SearchBudget
from driver.allocator.cluster import ClusterAllocator, Failure
from driver.allocator.make_room import Holder, Move, Scratch, given_back, trying


@dataclass(frozen=True)
class NodeEmptying:
    """Moving `moves` (every allocation on `node`) leaves the node empty."""

    node: str
    moves: tuple[Move, ...]


def emptying_nodes(
    allocator: ClusterAllocator,
    holders: Sequence[Holder],
    may_empty: AbstractSet[str],
    limit: int,
    budget: SearchBudget | None = None,
) -> list[NodeEmptying]:
    """Plans that empty nodes of `may_empty`, at most `limit` moves in all, fewest moves first.
    `holders`: every live allocation, movable or not (a node with one that may not move stays,
    and is a place to move to). Every search spends one `budget` (default: SEARCH_STEPS); once it
    runs out, the plans found so far."""
    budget = budget or SearchBudget(SEARCH_STEPS)
    on_node: dict[str, list[Holder]] = defaultdict(list)
    for holder in holders:
        on_node[holder.node].append(holder)
    candidates = [n for n, held in on_node.items() if n in may_empty and all(h.movable for h in held)]
    candidates.sort(key=lambda n: (len(on_node[n]), sum(given_back(allocator, h) for h in on_node[n]), n))
    emptiable = set(candidates)
    plans: list[NodeEmptying] = []
    emptied: set[str] = set()
    filled: set[str] = set()  # nodes moves went to: not emptied afterwards
    moves = 0
    with trying(allocator) as scratch:
        for node in candidates:
            if budget.exhausted:
                break
            held = on_node[node]
            if moves + len(held) > limit or node in filled:
                continue
            targets = [n for n in allocator.node_order() if n in on_node and n != node and n not in emptied]
            staying = [n for n in targets if n not in emptiable]
            others = [n for n in targets if n in emptiable]
            planned = _move_all(allocator, scratch, held, (staying, others), budget)
            if planned is None:
                continue
            plans.append(NodeEmptying(node, planned))
            emptied.add(node)
            filled.update(move.to.node for move in planned)
            moves += len(planned)
    return plans


def _move_all(
    allocator: ClusterAllocator,
    scratch: Scratch,
    held: Sequence[Holder],
    targets: Sequence[Sequence[str]],
    budget: SearchBudget,
) -> tuple[Move, ...] | None:
    """The holders placed, largest first, each on the first group of `targets` where it fits, then
    released from their node; None (and nothing changed) when one has nowhere to go."""
    mark = scratch.mark()
    planned = []
    for holder in sorted(held, key=lambda h: given_back(allocator, h), reverse=True):
        outcome = None
        for nodes in filter(None, targets):
            outcome = allocator.allocate(holder.claim, nodes=nodes, why=False, budget=budget)
            if not isinstance(outcome, Failure):
                break
        if outcome is None or isinstance(outcome, Failure):
            scratch.undo(mark)
            return None
        scratch.add(outcome.node, outcome.allocation, outcome.claim)
        planned.append(Move(holder, outcome))
    scratch.release_all(held)
    return tuple(planned)
