"""What the nodes would have left for pods once a plan's evictions and placements are made, for
the make-room planner (driver/allocator/make_room.py): the caller's room (a PodRoom) read as it
is, the pods of the allocations the planner releases given back and of those it adds taken,
counted here alone, so that planning never changes the caller's room.

Counted by sums: a claim's pods fit a node when what they request together (`needs`, the pod
count included) is within what the node has left, less what the plan took there, plus what it
gave back; what the node admits (taints, affinity, kube-scheduler's refusals) is the caller's
room's word. A pod counted on a node already (it uses another claim placed there) is counted
again: planning may refuse a plan it need not, never take one whose pods would not run."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence

from driver.allocator.cluster import Placement, PodRoom
from driver.allocator.fragmentation import PODS
from driver.allocator.model import Claim

ROUNDING = 1e-9  # sums of floats given back and taken again: not a resource's worth


class PlannedRoom:
    """A PodRoom over `room`: take and give_back change only this one's count of each node."""

    def __init__(self, room: PodRoom) -> None:
        self.room = room
        self._change: defaultdict[str, dict[str, float]] = defaultdict(dict)  # node -> resource -> more left

    def fits(self, claim: Claim, node: str) -> bool:
        if not self.room.admits(claim, node):
            return False
        left = self.left(node)
        return all(
            value <= left.get(name, 0.0) + ROUNDING
            for name, value in self.room.needs(claim).items()
            if name != PODS or PODS in left  # a node that sets no pod count takes any
        )

    def admits(self, claim: Claim, node: str) -> bool:
        return self.room.admits(claim, node)

    def left(self, node: str) -> Mapping[str, float]:
        change = self._change.get(node) or {}
        return {name: value + change.get(name, 0.0) for name, value in self.room.left(node).items()}

    def allocatable(self, node: str) -> Mapping[str, float]:
        return self.room.allocatable(node)

    def open_to_any_pod(self, node: str) -> bool:
        return self.room.open_to_any_pod(node)

    def needs(self, claim: Claim) -> Mapping[str, float]:
        return self.room.needs(claim)

    def take(self, placement: Placement) -> None:
        self._count(placement, -1.0)

    def give_back(self, placement: Placement) -> None:
        self._count(placement, 1.0)

    def _count(self, placement: Placement, sign: float) -> None:
        change = self._change[placement.node]
        for name, value in self.room.needs(placement.claim).items():
            change[name] = change.get(name, 0.0) + sign * value

    def why_not(self, claim: Claim, nodes: Sequence[str]) -> str:
        return self.room.why_not(claim, nodes)

    def demand(self, claim: Claim) -> Hashable:
        return self.room.demand(claim)
