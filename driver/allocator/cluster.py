"""Allocation across nodes: which node a claim goes to (fullest first under binpack), and gangs of
claims placed all or none. Pure: a snapshot of slices, classes and allocations in, results out."""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from fractions import Fraction
from typing import Any, Protocol

from driver.allocator.allocate import (
    SEARCH_STEPS,
    AllocationError,
    DeviceOrder,
    NodeAllocator,
    SearchBudget,
    SearchBudgetExceeded,
    SearchOrderError,
    SelectorResults,
)
from driver.allocator.explain import explain
from driver.allocator.fragmentation import (
    Choice,
    Fragmentation,
    Needs,
    NodeKind,
    NodeView,
    RequestKey,
    Unit,
    devices_asked,
    request_key,
    units_of,
)
from driver.allocator.lifetimes import distance, nearest_first
from driver.allocator.model import Claim, Device, DeviceClass, Failure, Placement, Slice
from driver.allocator.policies import DEFAULT_POLICY, Policy
from driver.allocator.pools import Node, Pool, gather_pools
from driver.allocator.ranking import Entry, Position, Preferred, RankedNodes, Rankings
from driver.allocator.scoring import device_score, order_for
from driver.allocator.state import AllocatedState
from driver.allocator.water_level import SIZED, Room, demand_to_come, level
from driver.claims.tenancy import Tenant
from driver.common.quantity import Amount

SELECTOR_RESULTS_LIMIT = 1 << 21  # entries; past it a slice update starts them afresh (they are a cache)
# A node's share used (_measure): a Fraction where a counter is fractional, else a float.
Usage = float | Fraction
# fragmentation, where kube-scheduler places the pods without claims: claims observed between two
# countings of the level it will leave the nodes' rooms at (a count reads every node's room), and on
# larger clusters one for every FLOOD_NODES nodes: a claim moves the level by its share of the
# cluster, less the more nodes there are, while a count costs more.
FLOOD_EVERY = 64
FLOOD_NODES = 20
SCAN_LIMIT = 8  # binpack: nodes with part-used GPUs tried for a placement that opens none


PoolId = tuple[str, str]
HeldResult = tuple[dict[str, Any], Tenant | None]  # a result, and whose share it is (None: no share, or not known)


class Snapshot:
    """Slices and nodes, gathered into each node's pools; kept current slice by slice (`update`).

    A pool whose slices all name one node concerns that node only; others (all nodes, node
    selectors, per-device placement) are offered to every node to match, so a change to one of
    those gathers every node again (rare: fgpu publishes node-local pools)."""

    def __init__(self, slices: Iterable[Slice], nodes: Iterable[Node]) -> None:
        self.nodes: dict[str, Node] = {n.name: n for n in nodes}
        self.pools: dict[str, list[Pool]] = {}  # node -> the pools it sees
        self.nodes_of_pool: dict[PoolId, list[str]] = {}  # who sees a pool
        self.selector_results: SelectorResults = {}  # shared by all nodes' allocators, never stale
        self._slices: dict[PoolId, dict[str, Slice]] = defaultdict(dict)  # pool -> slice name -> slice
        self._owner: dict[PoolId, str] = {}  # pool -> its one node, or "" when shared
        self._local: dict[str, set[PoolId]] = defaultdict(set)  # node -> its node-local pools
        self._shared: set[PoolId] = set()
        for slice_ in slices:
            self._slices[slice_.driver, slice_.pool][slice_.name] = slice_
        for pool in self._slices:
            self._classify(pool)
        for name in self.nodes:
            self._gather(name)

    @classmethod
    def from_slices(cls, slices: list[Slice], nodes: Iterable[Node] = ()) -> Snapshot:
        """Nodes given, plus a bare one for every node a slice names."""
        known = {n.name: n for n in nodes}
        for slice_ in slices:
            for name in _named_nodes(slice_):
                known.setdefault(name, Node(name))
        return cls(slices, [known[name] for name in sorted(known)])

    def update(self, added: Iterable[Slice], removed: Iterable[Slice]) -> set[str]:
        """Slices added or changed (by name) and slices deleted: only their pools are gathered
        again, for the nodes that see them. Returns those nodes."""
        pools: set[PoolId] = set()
        for slice_ in removed:
            self._slices[slice_.driver, slice_.pool].pop(slice_.name, None)
            pools.add((slice_.driver, slice_.pool))
        for slice_ in added:
            self._slices[slice_.driver, slice_.pool][slice_.name] = slice_
            pools.add((slice_.driver, slice_.pool))
            for name in _named_nodes(slice_):
                self.nodes.setdefault(name, Node(name))
        if len(self.selector_results) > SELECTOR_RESULTS_LIMIT:
            self.selector_results.clear()  # values of slices long gone pile up; what is current comes back
        nodes: set[str] = set()
        for pool in pools:
            nodes.update(self._classify(pool))
        if "" in nodes:  # a shared pool changed: any node may see it
            nodes = set(self.nodes)
        for name in nodes:
            self._gather(name)
        return nodes

    def _classify(self, pool: PoolId) -> set[str]:
        """Records whose pool it is (one node's, or shared); returns its owners before and after."""
        before = self._owner.pop(pool, None)
        if before:
            self._local[before].discard(pool)
        self._shared.discard(pool)
        slices = self._slices.get(pool)
        if not slices:
            self._slices.pop(pool, None)
            return {name for name in (before,) if name is not None}
        names = {s.placement.node_name for s in slices.values()}
        after = names.pop() if len(names) == 1 and not any(s.per_device_placement for s in slices.values()) else ""
        self._owner[pool] = after
        (self._local[after] if after else self._shared).add(pool)
        return {name for name in (before, after) if name is not None}

    def _gather(self, node: str) -> None:
        for pool in self.pools.pop(node, ()):
            seen_by = self.nodes_of_pool.get(pool.id, [])
            if node in seen_by:
                seen_by.remove(node)
            if not seen_by:
                self.nodes_of_pool.pop(pool.id, None)
        slices = [s for pool in (*self._local.get(node, ()), *self._shared) for s in self._slices[pool].values()]
        pools = gather_pools(slices, self.nodes[node]) if node in self.nodes else []
        if pools:
            self.pools[node] = pools
            for pool in pools:
                self.nodes_of_pool.setdefault(pool.id, []).append(node)


def _named_nodes(slice_: Slice) -> set[str]:
    return {slice_.placement.node_name, *(d.placement.node_name for d in slice_.devices)} - {""}


_UNKEPT: Any = object()  # a view's score not kept


class PodRoom(Protocol):
    """Whether the pods that use a claim can run on a node (driver/scheduling/nodefit.py), and what the
    placements made take from the nodes: the allocator stays about devices. demand and signature
    is what fit reads of a claim's pods as one value (equal values: equal fit), for the
    fragmentation policy to learn the mix of claims by."""

    def fits(self, claim: Claim, node: str) -> bool: ...
    def admits(self, claim: Claim, node: str) -> bool: ...
    def left(self, node: str) -> Mapping[str, float]: ...
    def allocatable(self, node: str) -> Mapping[str, float]: ...
    def open_to_any_pod(self, node: str) -> bool: ...
    def needs(self, claim: Claim) -> Mapping[str, float]: ...
    def take(self, placement: Placement) -> None: ...
    def give_back(self, placement: Placement) -> None: ...
    def why_not(self, claim: Claim, nodes: Sequence[str]) -> str: ...
    def demand(self, claim: Claim) -> Hashable: ...


@dataclasses.dataclass(frozen=True)
class _Scoring:
    """fragmentation: what scoring one claim on a node reads, the same for every node."""

    claim: Claim
    key: RequestKey
    needs: Needs
    ask: int  # Fragmentation.asked(key, needs): what a view keeps the claim's scores by
    room: PodRoom | None
    hosting: set[str] | None  # the nodes with GPUs enough of a kind the request selects


class ClusterAllocator:
    def __init__(
        self,
        snapshot: Snapshot,
        classes: dict[str, DeviceClass],
        state: AllocatedState,
        policy: Policy = DEFAULT_POLICY,
        lifetime_hints: bool = True,
    ) -> None:
        """`lifetime_hints`: a share whose claim says when it is expected to end (lifetimes.py) goes,
        among the placements the policy scores alike, to the GPU expected to empty nearest then
        (docs/allocator.md, "Shares that end together"); off, the hints are not read."""
        self.snapshot, self.classes, self.state, self.policy = snapshot, classes, state, policy
        self.lifetime_hints = lifetime_hints
        self._order = order_for(policy)
        self.nodes = snapshot.nodes  # shared: nodes the snapshot learns of are ours too
        self._usage: dict[str, Usage] = {}
        self._used: set[str] = set()  # nodes whose usage is not 0 (most are 0 in a large cluster)
        self._ranked: list[tuple[Usage, str]] = []  # the used nodes by (usage, fullest first under binpack), name
        self._sign = 1 if policy == "spread" else -1  # fragmentation breaks its ties in binpack's order
        self._names: list[str] | None = None  # the nodes by name, until nodes come or go
        self._candidates: dict[str, dict[Any, Any]] = {}  # node -> what NodeAllocator caches for it
        self._no_fit: dict[str, set[Hashable]] = {}  # node -> search keys of claims its devices cannot take now
        self._partial: dict[str, bool] = {}  # a GPU (counter set) part used: room without opening one
        self._tenanted: set[str] = set()  # nodes with shares that have tenants: who asks changes what fits
        self._fragmentation = Fragmentation() if policy == "fragmentation" else None
        self._views: dict[str, NodeView | None] = {}  # fragmentation: node -> its GPUs' states
        # fragmentation: node -> its GPUs and the positions of those this claim should take
        self._prefer: dict[str, Preferred] = {}
        self._rankings = Rankings()  # fragmentation: the order of requests asked again, kept
        self._units: dict[str, list[Unit]] = {}  # fragmentation: node -> its GPUs, as counted in its census
        self._unit_kinds: dict[str, tuple[Hashable, ...]] = {}  # fragmentation: node -> its GPUs' kinds
        self._hosting: dict[Hashable, set[str]] = {}  # fragmentation: request -> nodes with GPUs enough of its kind
        self._flood_at = 0  # fragmentation: claims observed when the rooms' level is next counted
        for name in snapshot.pools:
            self._measure(name)
            self._count_units(name)

    def _count_units(self, node: str) -> None:
        """The fragmentation policy's census of the cluster's GPUs, kept as nodes' slices change."""
        if self._fragmentation is None:
            return
        self._fragmentation.count_units(self._units.pop(node, []), -1)
        self._unit_kinds.pop(node, None)
        self._hosting.clear()
        found = units_of(self.snapshot.pools.get(node, []))
        if found:
            self._units[node] = [unit for _, unit in found]
            self._unit_kinds[node] = tuple(unit.kind for unit in self._units[node])
            self._fragmentation.count_units(self._units[node], 1)

    def _measure(self, node: str) -> None:
        """How full a node is: the share of its counters drawn and of its uncounted devices taken.
        Called whenever its allocations change, so what was cached for it goes too."""
        self._candidates.pop(node, None)
        self._no_fit.pop(node, None)
        self._views.pop(node, None)
        self._rankings.touch(node)
        used: Amount = 0
        total: Amount = 0
        partial = tenanted = False
        for pool in self.snapshot.pools.get(node, ()):
            available = self.state.counters_left(pool)
            partial = partial or any(self.state.shared.get(d.id) for d in pool.devices)
            tenanted = tenanted or (bool(self.state.tenants) and any(d.id in self.state.tenants for d in pool.devices))
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
        self._rank(node, used / total if total else 0.0)
        self._partial[node] = partial
        (self._tenanted.add if tenanted else self._tenanted.discard)(node)

    def _rank(self, node: str, usage: Usage) -> None:
        """The node's usage now (0: none, or gone), kept sorted for node_order."""
        old = self._usage.get(node, 0.0)
        if old:
            del self._ranked[bisect.bisect_left(self._ranked, (self._sign * old, node))]
        if usage:
            bisect.insort(self._ranked, (self._sign * usage, node))
        self._usage[node] = usage
        (self._used.add if usage else self._used.discard)(node)

    def _cost(self, node: str, allocation: dict[str, Any]) -> tuple[int, int, float]:
        """How much a placement spends, lowest best: GPUs (counter sets) it starts using that nothing
        used before, the size of what it rules out there, and how much of its GPUs stays free."""
        cache = self._candidates.setdefault(node, {})
        allocator = self.node_allocator(node, cache=cache)
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

    def usage(self, node: str) -> Usage:
        """How full the node is (0..1): the share of its counters drawn and uncounted devices taken."""
        return self._usage.get(node, 0.0)

    def node_order(self) -> list[str]:
        """Nodes by (usage, fullest first under binpack), then name: only the used ones are sorted
        for each claim, the idle ones keep their order by name."""
        if self._names is None:
            self._names = sorted(self._usage)
        if self.policy == "first-fit":
            return list(self._names)
        used = [name for _, name in self._ranked]
        before = bisect.bisect_left(self._ranked, (0.0, ""))  # the used nodes that go before idle ones
        idle = list(itertools.filterfalse(self._used.__contains__, self._names))
        return used[:before] + idle + used[before:]

    def node_allocator(
        self, node: str, order: DeviceOrder | None = None, cache: dict[Any, Any] | None = None
    ) -> NodeAllocator:
        pools, results = self.snapshot.pools[node], self.snapshot.selector_results
        return NodeAllocator(self.nodes[node], pools, self.state, self.classes, order, cache, results)

    def allocate_on(
        self, node: str, claims: Sequence[Claim], budget: SearchBudget | None = None
    ) -> list[dict[str, Any]] | None:
        """The claims' allocation on the node in the policy's order. Where that order meets an
        error upstream's order might not (SearchOrderError), the node is searched again in
        upstream's order, which ends exactly as upstream does: a claim kube-scheduler would
        allocate is never refused because our order tried another device first. Within `budget`
        (default: SEARCH_STEPS), else SearchBudgetExceeded."""
        return self._search(node, claims, self._fit_key(node, claims), budget or SearchBudget(SEARCH_STEPS))

    def _fit_key(self, node: str, claims: Sequence[Claim]) -> Hashable:
        """What a search on the node reads of the claims (claims with equal keys fit alike): their
        shapes, and where the node's shares have tenants their namespaces too. Not their uids: a
        claim being placed holds no shares, so where its class's tenancy is Claim it may join none,
        whichever claim it is."""
        shapes = tuple(claim.search_key for claim in claims)
        return (shapes, tuple(claim.namespace for claim in claims)) if node in self._tenanted else shapes

    def _search(
        self, node: str, claims: Sequence[Claim], key: Hashable, budget: SearchBudget
    ) -> list[dict[str, Any]] | None:
        """allocate_on, remembering a search that found nothing until the node's allocations
        change: the search is complete, so nothing is found in any order, and a cluster that is
        full is asked for the same shapes on the same nodes again and again. A search the budget
        cut raises before it is remembered: it is not complete."""
        no_fit = self._no_fit.setdefault(node, set())
        if key in no_fit:
            return None
        result = self._search_in_order(node, claims, budget)
        if result is None:
            no_fit.add(key)
        return result

    def _search_in_order(self, node: str, claims: Sequence[Claim], budget: SearchBudget) -> list[dict[str, Any]] | None:
        order = self._order
        cache: dict[Any, Any] | None = self._candidates.setdefault(node, {})
        end = self._end(claims)
        if end is not None and order is not None:  # this claim's own order: not one to cache either
            order, cache = order_for(self.policy, end), None
        units, positions = self._prefer.get(node, ((), ()))
        if positions:  # this claim's own order: not one to cache for the next
            order, cache = _preferring([units[i] for i in positions], order), None
        try:
            return self.node_allocator(node, order, cache).allocate(claims, budget)
        except SearchOrderError:
            if self._order is None:
                raise
            return self.node_allocator(node).allocate(claims, budget)

    def update_slices(self, added: Iterable[Slice], removed: Iterable[Slice]) -> None:
        """Slices added, changed or deleted: the nodes that see their pools are measured again
        (their caches go with it); no other node is touched."""
        for node in self.snapshot.update(added, removed):
            if node not in self._usage or node not in self.snapshot.pools:
                self._names = None  # a node comes or goes
            self._count_units(node)
            if node in self.snapshot.pools:
                self._measure(node)
            else:
                self._rank(node, 0.0)
                for cached in (self._usage, self._candidates, self._no_fit, self._partial, self._views):
                    cached.pop(node, None)
                self._tenanted.discard(node)
                self._rankings.touch(node)

    def pods_changed(self, nodes: Iterable[str]) -> None:
        """What these nodes hold for pods changed while their devices did not (a pod without
        claims bound, finished, deleted or resized; allocatable changed): what the policy read of
        their room is read again at the next placement. Nothing else kept for a node reads its
        room (the search is about devices), so nothing else goes."""
        for node in nodes:
            view = self._views.get(node)
            if view is not None:
                view.room_changed()
            self._rankings.touch(node)

    def allocate(
        self,
        claim: Claim,
        nodes: Sequence[str] | None = None,
        room: PodRoom | None = None,
        why: bool = True,
        budget: SearchBudget | None = None,
    ) -> Placement | Failure:
        """The best node's allocation for one claim (not yet committed), or why none fits (an empty
        reason without `why`: for callers that only count failures); with a room, only on nodes
        where the claim's pods can run. The search on every node spends one `budget` (default:
        SEARCH_STEPS); when it runs out the claim fails at once, saying so (budget.exhausted).

        Under binpack the cheapest placement (see _cost) among the first feasible node and up to
        SCAN_LIMIT more with part-used GPUs: best fit across nodes, not only within one. Under
        fragmentation, nodes in the order of the rise in fragmentation (fragmentation.py)."""
        result = self._allocate(claim, nodes, room, why, budget)
        if isinstance(result, Failure) and nodes is None and self._fragmentation is not None:
            # fits nowhere: a rare shape the mix has not learned yet enters it now (fragmentation.py)
            demand = room.demand(claim) if room is not None else None
            self._fragmentation.waits(claim, demand, functools.partial(self._node_kinds, room))
        return result

    def _allocate(
        self,
        claim: Claim,
        nodes: Sequence[str] | None,
        room: PodRoom | None,
        why: bool,
        budget: SearchBudget | None,
    ) -> Placement | Failure:
        # Whether the claim's pods fit a node, asked once a node: the room stays as it is meanwhile.
        pods_fit = functools.cache(functools.partial(room.fits, claim)) if room is not None else None
        budget = budget or SearchBudget(SEARCH_STEPS)
        ordered = self._by_fragmentation(claim, nodes, room) if self._fragmentation is not None else nodes
        errors: list[str] = []
        unfit: list[str] = []  # nodes the claim's pods cannot run on
        best: tuple[tuple[int, int, float], Placement] | None = None
        end = self._end((claim,))
        found: list[tuple[tuple[int, int, float], Placement]] = []  # with a hint: each node's placement
        scanned = 0
        order: Iterator[str] = iter(ordered if ordered is not None else self.node_order())
        while (node := next(order, None)) is not None:
            if best is not None and scanned >= SCAN_LIMIT:
                break
            key = self._fit_key(node, (claim,))
            if not why and key in self._no_fit.get(node, ()):
                continue  # its devices cannot take it: whether its pods could is only asked to explain
            if pods_fit is not None and not pods_fit(node):
                unfit.append(node)
                continue
            try:
                result = self._search(node, [claim], key, budget)
            except SearchBudgetExceeded as error:
                return Failure(claim, str(error))
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
            if best is None:
                order = filter(self._partial.get, order)  # from here on only nodes with part-used GPUs
            if best is None or cost < best[0]:
                best = (cost, placement)
            if end is not None:
                found.append((cost, placement))
            scanned += 1
        if found:
            return self._ending_nearest(found, end)
        if best is not None:
            return best[1]
        if not why:
            return Failure(claim, "")
        if room is not None and unfit:
            reason = room.why_not(claim, unfit)
            if len(unfit) == len(ordered if ordered is not None else self.snapshot.pools):
                return Failure(claim, reason)
            return Failure(claim, f"{errors[0] if errors else self._explain(claim)}; and for its pods: {reason}")
        if errors:
            return Failure(claim, errors[0])
        return Failure(claim, self._explain(claim))

    def _end(self, claims: Sequence[Claim]) -> float | None:
        """When the one claim being placed is expected to end, where hints are read; else None."""
        return claims[0].expected_end if self.lifetime_hints and len(claims) == 1 else None

    def _empties_in(self, devices: Iterable[Device], end: float) -> float:
        """How far from `end` the GPU of these devices is expected to empty (inf: not known)."""
        return distance(end, self.state.expected_empty(device.id for device in devices))

    def _ending_nearest(self, found: list[tuple[tuple[int, int, float], Placement]], end: float | None) -> Placement:
        """binpack across nodes, for a claim with a hint: of the placements costing as the cheapest
        does (its free share within lifetimes.TOLERANCE), the one whose shares' GPUs empty nearest to
        its end (first found among equals, as without a hint)."""
        assert end is not None

        def how_far(option: tuple[tuple[int, int, float], Placement]) -> float:
            pools = {pool.id: pool for pool in self.snapshot.pools[option[1].node]}
            shares = [
                pools[r["driver"], r["pool"]].device_index().get(r["device"])
                for r in option[1].allocation["devices"]["results"]
                if r.get("shareID") is not None and (r["driver"], r["pool"]) in pools
            ]
            return max((self._empties_in((d,), end) for d in shares if d is not None), default=math.inf)

        ranked = sorted(found, key=lambda option: option[0])
        return nearest_first(ranked, lambda o: o[0][:2], lambda o: float(o[0][2]), how_far)[0][1]

    def _view(self, node: str) -> NodeView | None:
        """The node's GPUs and their states now, for the fragmentation policy (None: a device draws
        from several counter sets, which the policy does not model)."""
        assert self._fragmentation is not None
        if node not in self._views:
            pools = self.snapshot.pools.get(node, [])
            units = units_of(pools)
            view = None
            if units is not None:
                left = {pool.id: self.state.counters_left(pool) for pool in pools}
                states = [unit.state(self.state, left[pool.id].get(unit.counter_set, {})) for pool, unit in units]
                view = self._fragmentation.view([unit for _, unit in units], states)
            self._views[node] = view
        return self._views[node]

    def _by_fragmentation(
        self,
        claim: Claim,
        nodes: Sequence[str] | None,
        room: PodRoom | None,
    ) -> Sequence[str] | RankedNodes:
        """The nodes by the rise in fragmentation the claim's best placement there causes, its pods
        counted (ties in binpack's order); nodes the model sees no room on last, for the search to
        try all the same. The GPUs picked on each node are what its device order takes first
        (_prefer). A request asked again over every node keeps its order from claim to claim
        (ranking.py)."""
        assert self._fragmentation is not None
        learned = self._fragmentation
        key = request_key(claim)
        self._prefer = {}
        if key is None:
            return list(nodes if nodes is not None else self.node_order())
        demand = room.demand(claim) if room is not None else None
        needs = tuple(sorted(room.needs(claim).items())) if room is not None else ()
        learned.observe(claim, demand, needs, functools.partial(self._node_kinds, room))
        if room is not None and learned.observed >= self._flood_at and not learned.places_claimless():
            self._flood_at = learned.observed + max(FLOOD_EVERY, len(self._units) // FLOOD_NODES)
            self._flood(room)
        end = self._end((claim,))
        hosting = self._hosting_nodes(claim, key) if key else None  # a claim without devices: every node
        scoring = _Scoring(claim, key, needs, learned.asked(key, needs), room, hosting)
        if nodes is None and end is None and self._rankings.asked_before(scoring.ask):
            return self._from_ranking(scoring)
        scored: list[tuple[float, int, str]] = []
        unscored: list[str] = []
        near: dict[str, tuple[tuple[int, float], ...]] = {}  # with a hint: a node's GPUs scoring alike
        for position, node in enumerate(nodes if nodes is not None else self.node_order()):
            found = self._scored(node, scoring)
            if found is None:
                unscored.append(node)
                continue
            view, choice = found
            scored.append((choice.score, position, node))
            self._prefer[node] = (view.units, choice.units)
            if end is not None and len(choice.near) > 1:
                near[node] = choice.near
        scored.sort()
        if end is not None and scored:
            scored = self._ending_units(scored, near, end)
        return [node for _, _, node in scored] + unscored

    def _scored(self, node: str, scoring: _Scoring) -> tuple[NodeView, Choice] | None:
        """fragmentation: the node's view and the claim's best choice on it; None where the policy
        sees no room (no state of its GPUs could take it, or no view of them)."""
        assert self._fragmentation is not None
        if scoring.hosting is not None and node not in scoring.hosting:
            return None
        view = self._views[node] if node in self._views else self._view(node)
        if view is None:
            return None
        # what the view keeps, looked up here: most nodes, most claims (score() does the same)
        choice = view.scored.get(scoring.ask, _UNKEPT) if view.version == self._fragmentation.version else _UNKEPT
        if choice is _UNKEPT:
            allocator = functools.partial(self.node_allocator, node)
            choice = self._fragmentation.score(
                allocator, view, scoring.room, node, scoring.claim, scoring.key, scoring.needs, scoring.ask
            )
        return None if choice is None else (view, choice)

    def _from_ranking(self, scoring: _Scoring) -> RankedNodes:
        """_by_fragmentation's order over every node, from the request's ranking: the nodes touched
        since it was last used scored again (every node for a new one)."""
        assert self._fragmentation is not None
        ranking, touched = self._rankings.ranking(scoring.ask, self._fragmentation.version, len(self._usage))
        if touched is None:
            entries: dict[str, Entry] = {}
            prefer: dict[str, Preferred] = {}
            for node in self._usage:
                entries[node], preferred = self._entry(node, scoring)
                if preferred is not None:
                    prefer[node] = preferred
            ranking.fill(entries, prefer)
        for node in touched or ():
            if node in self._usage:
                ranking.place(node, *self._entry(node, scoring))
            else:
                ranking.place(node, None, None)  # gone
        self._prefer = ranking.prefer
        return ranking.order()

    def _entry(self, node: str, scoring: _Scoring) -> tuple[Entry, Preferred | None]:
        """The node's entry in a ranking: (rise in F, position) and the units its placement should
        take where the policy scores it, else its position alone."""
        position, found = self._position(node), self._scored(node, scoring)
        if found is None:
            return position, None
        view, choice = found
        return (choice.score, *position), (view.units, choice.units)

    def _position(self, node: str) -> Position:
        """The node's place in node_order(), as a key: used nodes by (sign x usage), then by name;
        idle ones at 0."""
        usage = self._usage.get(node, 0.0)
        return (self._sign * usage if usage else 0.0, node)

    def _ending_units(
        self, scored: list[tuple[float, int, str]], near: dict[str, tuple[tuple[int, float], ...]], end: float
    ) -> list[tuple[float, int, str]]:
        """fragmentation, for a claim with a hint: on each node, of the GPUs whose rise in F is within
        lifetimes.TOLERANCE of the best (Choice.near), the one expected to empty nearest to its end
        (the node then scores as that GPU does); across nodes, of those scoring within it of the
        best, the node whose pick is nearest. Equals and unknowns keep the policy's order."""
        how_far: dict[str, float] = {}
        for i, (_, position, node) in enumerate(scored):
            options = near.get(node)
            if not options:
                continue
            units = self._prefer[node][0]
            unit, rise, how_far[node] = self._nearest_unit(units, options, end)
            self._prefer[node] = (units, (unit,))
            scored[i] = (rise, position, node)
        scored.sort()
        return nearest_first(scored, _alike, lambda s: s[0], lambda s: how_far.get(s[2], math.inf))

    def _nearest_unit(
        self, units: Sequence[Unit], options: Sequence[tuple[int, float]], end: float
    ) -> tuple[int, float, float]:
        """Of a node's GPUs scoring alike (position, rise in F; best first), the one expected to
        empty nearest to `end`: its position, rise and distance."""
        far = {position: self._empties_in(units[position].devices, end) for position, _ in options}
        position, rise = nearest_first(options, _alike, lambda o: o[1], lambda o: far[o[0]])[0]
        return position, rise, far[position]

    def _hosting_nodes(self, claim: Claim, key: RequestKey) -> set[str]:
        """The nodes with as many GPUs of a kind the request selects as it asks for; kept until
        slices change."""
        found = self._hosting.get(key)
        if found is None:
            assert self._fragmentation is not None
            selecting = self._fragmentation.selecting
            found = self._hosting[key] = {
                node
                for node, units in self._units.items()
                if selecting(functools.partial(self.node_allocator, node), units, claim, key) >= devices_asked(key)
            }
        return found

    def _flood(self, room: PodRoom) -> None:
        """fragmentation, where kube-scheduler places the pods without claims: the level their pods
        still to come will leave the nodes' rooms at (water_level.py), from what the rooms and
        GPUs hold now; on the nodes those pods can reach (a taint keeps them off the others)."""
        assert self._fragmentation is not None
        rooms = {node: Room(room.left(node), room.allocatable(node)) for node in self._units}
        used = {
            name: sum(r.allocatable.get(name, 0.0) - r.left.get(name, 0.0) for r in rooms.values()) for name in SIZED
        }
        free = taken = 0.0
        for node, units in self._units.items():
            view = self._view(node)
            gpus = self._fragmentation.free_gpus(view) if view is not None else 0.0
            free, taken = free + gpus, taken + len(units) - gpus
        per_gpu = self._fragmentation.claims_per_gpu(self._node_kinds(room))
        reached = [found for node, found in rooms.items() if room.open_to_any_pod(node)]  # where those pods go
        water = level(reached, demand_to_come(used, per_gpu, taken, free))
        for node in self._fragmentation.flood(water, self._views):
            self._rankings.touch(node)

    def _node_kinds(self, room: PodRoom | None) -> list[NodeKind]:
        """The cluster's nodes grouped by their GPUs and what they hold for pods (fragmentation's
        supply of shapes; without a room, nothing is known of their pods)."""
        count: Counter[Hashable] = Counter()
        first: dict[Hashable, str] = {}
        for node, kinds in self._unit_kinds.items():
            allocatable = room.allocatable(node) if room is not None else {}
            key = (kinds, tuple(sorted(allocatable.items())))
            count[key] += 1
            first.setdefault(key, node)
        return [
            NodeKind(
                tuple(self._units[node]),
                room.allocatable(node) if room is not None else {},
                count[key],
                functools.partial(self.node_allocator, node),
            )
            for key, node in first.items()
        ]

    def _explain(self, claim: Claim) -> str:
        return explain(self, claim)

    def commit(self, placement: Placement) -> None:
        self.add(placement.node, placement.allocation, placement.claim)

    def add(self, node: str, allocation: dict[str, Any], holder: Claim | None = None) -> None:
        """Count an allocation (one of ours, or one made elsewhere: node "" re-measures every node
        that sees its pools), with the claim that holds it where known (its shares' tenants);
        release, given the same, is the reverse."""
        self.state.add_allocation(allocation, holder)
        self._changed(node, allocation)

    def release(self, node: str, allocation: dict[str, Any], holder: Claim | None = None) -> None:
        self.state.remove_allocation(allocation, holder)
        self._changed(node, allocation)

    def recount(
        self, gone: Sequence[HeldResult], new: Sequence[HeldResult], ends: Mapping[str, float] | None = None
    ) -> None:
        """Results of any claims that are gone and that are new, each with its share's tenant (None:
        none, or not known), as release and add count them; each node they touch re-measured once.
        `ends`: when the new shares' claims are expected to end, by claim uid (lifetimes.py)."""
        for result, tenant in gone:
            self.state.remove_result(result, tenant)
        for result, tenant in new:
            self.state.add_result(result, tenant, (ends or {}).get(tenant.claim_uid) if tenant is not None else None)
        self._changed("", {"devices": {"results": [result for result, _ in (*gone, *new)]}})

    def _changed(self, node: str, allocation: dict[str, Any]) -> None:
        """Re-measure every node that sees a pool the allocation touched (more than one where a
        pool is offered to several nodes)."""
        nodes = {node}
        for result in (allocation.get("devices") or {}).get("results") or ():
            nodes.update(self.snapshot.nodes_of_pool.get((result.get("driver"), result.get("pool")), ()))
        for name in nodes & self._usage.keys():
            self._measure(name)

    def allocate_gang(
        self, claims: Sequence[Claim], room: PodRoom | None = None, budget: SearchBudget | None = None
    ) -> list[Placement] | Failure:
        """Every claim placed, or none: each claim in turn (largest first) on its best node, with
        the ones before it counted (their devices, and their pods in the room); the first that
        fails undoes the rest. One `budget` (default: SEARCH_STEPS) for all the members: a gang
        of many hard claims is no more search than one."""
        placed: list[Placement] = []
        budget = budget or SearchBudget(SEARCH_STEPS)
        for claim in sorted(claims, key=_size, reverse=True):
            outcome = self.allocate(claim, room=room, budget=budget)
            if isinstance(outcome, Failure):
                for placement in reversed(placed):
                    self.release(placement.node, placement.allocation, placement.claim)
                    if room is not None:
                        room.give_back(placement)
                return Failure(claim, f"gang cannot be placed whole: {outcome.claim.key}: {outcome.reason}")
            self.commit(outcome)
            if room is not None:
                room.take(outcome)
            placed.append(outcome)
        return placed


def _preferring(units: Sequence[Unit], then: DeviceOrder | None) -> DeviceOrder:
    """Devices on `units` first (in their order), then the rest in `then`'s order."""
    rank = {id(device): i for i, unit in enumerate(units) for device in unit.devices}

    def ordered(allocator: NodeAllocator, devices: list[Device]) -> list[Device]:
        rest = then(allocator, devices) if then is not None else devices
        return sorted(rest, key=lambda d: rank.get(id(d), len(rank)))

    return ordered


def _size(claim: Claim) -> int:
    return sum(alternatives[0].count or 1 for alternatives in claim.requests)


def _alike(_: object) -> tuple[()]:
    """What fragmentation's scores share exactly: nothing (only the rise in F counts)."""
    return ()
