"""Allocation across nodes: which node a claim goes to (fullest first under binpack), and gangs of
claims placed all or none. Pure: a snapshot of slices, classes and allocations in, results out."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from driver.allocator.allocate import AllocationError, NodeAllocator
from driver.allocator.model import Claim, DeviceClass, Slice
from driver.allocator.pools import Node, Pool, gather_pools
from driver.allocator.scoring import Policy, device_score, order_for
from driver.allocator.state import AllocatedState

SCAN_LIMIT = 8  # binpack: nodes with part-used GPUs tried for a placement that opens none


@dataclass(frozen=True)
class Placement:
    claim: Claim
    node: str
    allocation: dict[str, Any]


@dataclass(frozen=True)
class Failure:
    claim: Claim
    reason: str


@dataclass
class Snapshot:
    """Slices and nodes, gathered into each node's pools once; devices keep their selector results."""

    slices: list[Slice]
    nodes: list[Node]
    pools: dict[str, list[Pool]] = field(default_factory=dict)
    nodes_of_pool: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # who sees a pool

    def __post_init__(self) -> None:
        # A pool whose slices all name one node concerns that node only; others (all nodes, node
        # selectors, per-device placement) are offered to every node to match.
        by_pool: dict[tuple[str, str], list[Slice]] = defaultdict(list)
        for slice_ in self.slices:
            by_pool[slice_.driver, slice_.pool].append(slice_)
        local: dict[str, list[Slice]] = defaultdict(list)
        shared: list[Slice] = []
        for pool_slices in by_pool.values():
            names = {s.placement.node_name for s in pool_slices}
            if len(names) == 1 and "" not in names and not any(s.per_device_placement for s in pool_slices):
                local[names.pop()].extend(pool_slices)
            else:
                shared.extend(pool_slices)
        for node in self.nodes:
            pools = gather_pools(local.get(node.name, []) + shared, node)
            if pools:
                self.pools[node.name] = pools
                for pool in pools:
                    self.nodes_of_pool.setdefault(pool.id, []).append(node.name)

    @classmethod
    def from_slices(cls, slices: list[Slice], nodes: Iterable[Node] = ()) -> Snapshot:
        """Nodes given, plus a bare one for every node a slice names."""
        known = {n.name: n for n in nodes}
        for slice_ in slices:
            for name in [slice_.placement.node_name, *(d.placement.node_name for d in slice_.devices)]:
                if name and name not in known:
                    known[name] = Node(name)
        return cls(slices, [known[name] for name in sorted(known)])


class ClusterAllocator:
    def __init__(
        self,
        snapshot: Snapshot,
        classes: dict[str, DeviceClass],
        state: AllocatedState,
        policy: Policy = "binpack",
    ) -> None:
        self.snapshot, self.classes, self.state, self.policy = snapshot, classes, state, policy
        self._order = order_for(policy)
        self.nodes = {n.name: n for n in snapshot.nodes}
        self._usage: dict[str, float] = {}
        self._candidates: dict[str, dict[Any, Any]] = {}  # node -> what NodeAllocator caches for it
        self._partial: dict[str, bool] = {}  # a GPU (counter set) part used: room without opening one
        for name in snapshot.pools:
            self._measure(name)

    def _measure(self, node: str) -> None:
        """How full a node is: the share of its counters drawn and of its uncounted devices taken.
        Called whenever its allocations change, so what was cached for it goes too."""
        self._candidates.pop(node, None)
        used = total = 0
        partial = False
        for pool in self.snapshot.pools.get(node, ()):
            available = self.state.counters_left(pool)
            partial = partial or any(self.state.shared.get(d.id) for d in pool.devices)
            for set_name, counters in pool.counter_sets.items():
                drawn = sum(value - available[set_name][name] for name, value in counters.items())
                full = sum(counters.values())
                partial = partial or 0 < drawn < full
                total += full
                used += drawn
            for device in pool.devices:
                if not device.consumes:
                    total += 1
                    used += self.state.is_allocated(device.id)
        self._usage[node] = used / total if total else 0.0
        self._partial[node] = partial

    def _cost(self, node: str, allocation: dict[str, Any]) -> tuple[int, int, float]:
        """How much a placement spends, lowest best: GPUs (counter sets) it starts using that nothing
        used before, the size of what it rules out there, and how much of its GPUs stays free."""
        cache = self._candidates.setdefault(node, {})
        allocator = NodeAllocator(self.nodes[node], self.snapshot.pools[node], self.state, self.classes, cache=cache)
        pools = {pool.id: pool for pool in self.snapshot.pools[node]}
        opened: set[tuple[str, str, str]] = set()
        ruled_out, left = 0, 0.0
        for result in allocation["devices"]["results"]:
            pool = pools.get((result["driver"], result["pool"]))
            device = pool.device_index().get(result["device"]) if pool else None
            if pool is None or device is None or result.get("adminAccess"):
                continue
            touched, ruled, free = device_score(allocator, device)
            ruled_out, left = ruled_out + ruled, left + free
            if touched:
                opened.update((*device.id[:2], counter_set) for counter_set, _ in device.consumes)
        return len(opened), ruled_out, left

    def node_order(self) -> list[str]:
        if self.policy == "first-fit":
            return sorted(self._usage)
        sign = -1 if self.policy == "binpack" else 1
        return sorted(self._usage, key=lambda name: (sign * self._usage[name], name))

    def allocate_on(self, node: str, claims: Sequence[Claim]) -> list[dict[str, Any]] | None:
        cache = self._candidates.setdefault(node, {})
        pools = self.snapshot.pools[node]
        return NodeAllocator(self.nodes[node], pools, self.state, self.classes, self._order, cache).allocate(claims)

    def allocate(self, claim: Claim, nodes: Sequence[str] | None = None) -> Placement | Failure:
        """The best node's allocation for one claim (not yet committed), or why none fits.

        Under binpack the cheapest placement (see _cost) among the first feasible node and up to
        SCAN_LIMIT more with part-used GPUs: best fit across nodes, not only within one."""
        errors: list[str] = []
        best: tuple[tuple[int, int, float], Placement] | None = None
        scanned = 0
        for node in nodes if nodes is not None else self.node_order():
            if best is not None and scanned >= SCAN_LIMIT:
                break
            if best is not None and not self._partial.get(node):
                continue
            try:
                result = self.allocate_on(node, [claim])
            except AllocationError as error:
                errors.append(str(error))
                continue
            if result is None:
                continue
            placement = Placement(claim, node, result[0])
            if self.policy != "binpack":
                return placement
            cost = self._cost(node, placement.allocation)
            if cost == (0, 0, 0):
                return placement  # a perfect fit: nothing better exists
            if best is None or cost < best[0]:
                best = (cost, placement)
            scanned += 1
        if best is not None:
            return best[1]
        if errors:
            return Failure(claim, errors[0])
        from driver.allocator.explain import explain  # explain builds on this module

        return Failure(claim, explain(self, claim))

    def commit(self, placement: Placement) -> None:
        self.add(placement.node, placement.allocation)

    def add(self, node: str, allocation: dict[str, Any]) -> None:
        """Count an allocation (one of ours, or one made elsewhere: node "" re-measures every node
        that sees its pools); release is the reverse."""
        self.state.add_allocation(allocation)
        self._changed(node, allocation)

    def release(self, node: str, allocation: dict[str, Any]) -> None:
        self.state.remove_allocation(allocation)
        self._changed(node, allocation)

    def _changed(self, node: str, allocation: dict[str, Any]) -> None:
        """Re-measure every node that sees a pool the allocation touched (more than one where a
        pool is offered to several nodes)."""
        nodes = {node}
        for result in (allocation.get("devices") or {}).get("results") or ():
            nodes.update(self.snapshot.nodes_of_pool.get((result.get("driver"), result.get("pool")), ()))
        for name in nodes & self._usage.keys():
            self._measure(name)

    def allocate_gang(self, claims: Sequence[Claim]) -> list[Placement] | Failure:
        """Every claim placed, or none: each claim in turn (largest first) on its best node, with
        the ones before it counted; the first that fails undoes the rest."""
        placed: list[Placement] = []
        for claim in sorted(claims, key=_size, reverse=True):
            outcome = self.allocate(claim)
            if isinstance(outcome, Failure):
                for placement in reversed(placed):
                    self.release(placement.node, placement.allocation)
                return Failure(claim, f"gang cannot be placed whole: {outcome.claim.key}: {outcome.reason}")
            self.commit(outcome)
            placed.append(outcome)
        return placed


def _size(claim: Claim) -> int:
    return sum(alternatives[0].count or 1 for alternatives in claim.requests)
