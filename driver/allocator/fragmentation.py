"""The `fragmentation` placement policy: the node and GPU whose choice least raises the expected
fragmentation for the claims the cluster sees, learned online (FGD, Weng et al. ATC '23, is given
that mix in advance; this policy counts it from the claims it is asked to place), with what a
node's CPU and memory left can still feed counted too (FGD checks only whether one pod fits).

Model (scoring only: feasibility stays with the search, which tries the nodes in this order):
- a unit is one GPU: a counter set and the devices drawing from it (a device without counters is
  a unit of its own); its free share is what its counters have left, or where shares use it, the
  smallest share of a capacity (compute, memory, clients) left on them;
- a claim's shape is its one request (class, selectors, count, capacity) with the pods' demand
  (PodRoom.demand, PodRoom.needs) its claims have most often; a less common demand is a shape of
  its own where the nodes that could run it (free GPUs for the request, room for the pods when
  empty) hold under SCARCE_SUPPLY of the GPUs those running the common one hold (a CPU size only
  the largest nodes have); the mix is the shapes seen, each weighed by its count of claims times
  its supply weight (below), the heaviest up to MIX_SHARE of that weight (FGD's "typical pods", to
  95%); learned again at 16, 32, 64, ... claims, and at once when a claim of a shape not in it
  fits no node (Fragmentation.waits: a rare shape is often first seen waiting);
- a prior for shapes not seen yet: per kind of node with several GPUs, a claim for all of them
  whose pods take WHOLE_NODE_SHARE of its CPU and memory, counted as WHOLE_NODE_PRIOR claims and
  weighed by its supply, where no other kind of node runs that claim (a kind another one stands
  in for keeps nothing only it offers). Where a few nodes are larger than the rest, their own
  whole-node claim fits them alone and weighs most, so they are filled last until the claims seen
  outweigh the prior; the largest pods, however late they first come, find them empty (openb in
  time: 8-GPU pods asking 120 CPUs, which only the 39 G3 nodes run, arrive after the cluster
  filled). Whoever
  places the pods without claims: where kube-scheduler does, it fills some nodes kept empty with
  their CPU, and then the whole-node claim no longer fits them, so they are no longer kept;
- supply: a shape whose pods fit nodes holding under SCARCE_SUPPLY of the GPUs its request could
  use weighs (those GPUs / the GPUs of the nodes its pods fit) times more: its nodes are few, so
  ruling one out costs more than its count says;
- a unit is a fragment for a shape when no device on it could take the shape's request; every
  free unit of a node is one when the shape cannot run there at all (too few units, or its pods
  do not fit the node's room);
- stranded: the node's free share beyond what as many of the shape's pods as its room still takes
  would use (copies x count x the share of a unit one device of it takes), for shapes that can
  use the node's units: free GPUs whose CPU has gone to other pods;
- F(node) = sum over the mix of weight x (free share of the units that are fragments for it +
  stranded). A claim goes to the node and units whose choice, its pods counted, raises F least
  (ties: a GPU in use before a free one, then best fit; nodes in binpack's order). A claim without
  devices goes where its pods raise F least;
- scarcity: F does not see that some GPUs are all that restricted shapes (a request's own
  selectors, e.g. a GPU model) can use. Taking a unit's free share costs SCARCITY_WEIGHT x that
  share x the unit's scarcity: the sum over the restricted shapes that select a device of its kind
  of their weight over the share of the cluster's units they select (their supply). With no
  restricted shape in the mix it is 0 and F alone decides.

Scores are kept by unit states (interned) and room copies, the node's room answers by demand, and
a claim whose pods leave every copy count as it was (within the node's slack) reuses them, so a
claim costs a look-up per node where nothing changed."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from driver.allocator.allocate import NodeAllocator, compiled_selectors
from driver.allocator.capacity import consumption, fits
from driver.allocator.lifetimes import TOLERANCE
from driver.allocator.model import Claim, Device, Request
from driver.allocator.pools import Pool
from driver.allocator.state import AllocatedState
from driver.allocator.water_level import SIZED, capped
from driver.common.quantity import Amount

MIX_SHARE = 0.99  # the heaviest shapes up to this share of the weight (FGD takes 95%)
MIX_SHAPES = 48  # at most: a long tail costs scoring time and weighs little
MAX_COUNTED = 100_000  # claims remembered as counted in the mix
FIRST_LEARN = 16  # claims seen before the mix is first learned; then at each doubling
# Scarcity against F: 16 on the openb gpuspec33 trace (a quarter of the cluster, seeds 42-43:
# 2 gives 9.1/11.5% unallocated, 8 gives 6.1/7.9, 16 and 64 give 5.9/7.5; BENCHMARKS.md, openb).
SCARCITY_WEIGHT = 16.0
COPIES_LIMIT = 1024  # pods of one shape a node's room is asked to take at most
# A request's less common pods' demand is a shape of its own where the nodes that can run it hold
# under this share of the GPUs that can run its most common one (openb multigpu50: 8-GPU pods of
# 120 cores, which only 128-core nodes run, beside the 64-core ones; BENCHMARKS.md, openb).
SCARCE_SUPPLY = 0.5
# The prior for shapes not seen yet (see the module's doc): a claim for each kind of node's GPUs and
# this share of its CPU and memory, counted as this many claims (openb in time, a quarter of the
# cluster, seeds 42-51: GPU-hours waited 9.7 with it and the mix by weight, 25.6 before both, FGD 12.7;
# docs/benchmarks/openb.md).
WHOLE_NODE_SHARE = 0.9
WHOLE_NODE_PRIOR = 1.0
# A level the rooms are capped at (water_level.py) is taken again where it moved by this share of
# allocatable: each new level counts the rooms it caps otherwise again.
LEVEL_STEP = 0.02
# Nodes alike (the same GPU states, room and copies) share what is scored on them (room_copies): at
# most this many kinds are remembered, then they are forgotten and learned again (memory).
ALIKE_LIMIT = 8192
PODS = "pods"  # the pod count, as PodRoom.needs and PodRoom.left name it

# request_key: () for a claim without requests, else (class, selectors, count, capacity asked, sorted).
RequestKey = tuple[()] | tuple[str, tuple[str, ...], int, tuple[tuple[str, Amount], ...]]
Needs = tuple[tuple[str, float], ...]  # what a claim's pods request together, sorted (PodRoom.needs)
# A unit's state (Unit.state): counters left (in Unit.counters' order), the shared devices' consumption
# (device index -> sorted amounts), the devices taken whole (indices).
UnitState = tuple[tuple[Amount, ...], tuple[tuple[int, tuple[tuple[str, Amount], ...]], ...], tuple[int, ...]]


class ScoredRoom(Protocol):
    """What the policy reads of a PodRoom (driver/scheduling/nodefit.py's NodeRoom): what a node admits and
    has left, what a claim's pods need, and their demand as one hashable value (equal values:
    equal fit)."""

    def admits(self, claim: Claim, node: str) -> bool: ...
    def left(self, node: str) -> Mapping[str, float]: ...
    def allocatable(self, node: str) -> Mapping[str, float]: ...
    def open_to_any_pod(self, node: str) -> bool: ...
    def needs(self, claim: Claim) -> Mapping[str, float]: ...
    def demand(self, claim: Claim) -> Hashable: ...


def request_key(claim: Claim) -> RequestKey | None:
    """The device request a shape stands for: () for a claim without requests; None for claims
    the model does not describe (several requests, firstAvailable, admin access, All)."""
    if not claim.requests:
        return ()
    if len(claim.requests) > 1 or len(claim.requests[0]) > 1:
        return None
    request = claim.requests[0][0]
    if request.mode != "ExactCount" or request.admin_access:
        return None
    return request.class_name, request.selectors, request.count, tuple(sorted((request.capacity or {}).items()))


def devices_asked(key: RequestKey) -> int:
    """How many devices the key's request asks for (the key of a claim with a request, not ())."""
    assert key, "a claim without requests asks for no devices"
    return key[2]


@dataclass
class Unit:
    """One GPU of a node: its counter set (full values) and the devices that draw from it."""

    counters: dict[str, Amount]
    devices: list[Device]
    counter_set: str = ""  # "" for a device without counters
    _kind: Hashable = field(default=None, init=False, repr=False, compare=False)

    def state(self, state: AllocatedState, left: dict[str, Amount]) -> UnitState:
        used = tuple(
            (i, tuple(sorted(state.shared[d.id].items()))) for i, d in enumerate(self.devices) if d.id in state.shared
        )
        taken = tuple(i for i, d in enumerate(self.devices) if d.id in state.exclusive)
        return tuple(left.get(name, 0) for name in self.counters), used, taken

    @property
    def kind(self) -> Hashable:
        """What units of equal kind share: counters and device shapes; kept once read (a unit is
        read once all its devices are in). Not functools.cached_property: on Python 3.11 its first
        read of any unit takes one lock shared by every unit, which the writers' threads contend."""
        if self._kind is None:
            self._kind = tuple(self.counters.items()), tuple(id(d.shape) for d in self.devices)
        return self._kind


def units_of(pools: Sequence[Pool]) -> list[tuple[Pool, Unit]] | None:
    """The node's GPUs, or None where a device draws from several counter sets (no unit model)."""
    found: list[tuple[Pool, Unit]] = []
    for pool in pools:
        by_set: dict[str, Unit] = {name: Unit(dict(c), [], name) for name, c in pool.counter_sets.items()}
        for device in pool.devices:
            if len(device.consumes) > 1:
                return None
            if device.consumes:
                by_set[device.consumes[0][0]].devices.append(device)
            else:
                found.append((pool, Unit({}, [device])))
        found.extend((pool, unit) for unit in by_set.values() if unit.devices)
    return found


def free_share(unit: Unit, state: UnitState) -> float:
    left, used, taken = state
    if used:
        return min(_capacity_left(unit.devices[i], dict(amounts)) for i, amounts in used)
    if not unit.counters:
        return 0.0 if taken else 1.0
    full = sum(unit.counters.values())
    return float(sum(left) / full) if full else 0.0


def _capacity_left(device: Device, used: dict[str, Amount]) -> float:
    """The smallest share of a capacity left on a shared device."""
    return min(
        (float((cap.value - used.get(name, 0)) / cap.value) for name, cap in device.capacity.items() if cap.value),
        default=0.0,
    )


def takes(unit: Unit, state: UnitState, index: int, request: Request) -> dict[str, Amount] | None:
    """What device `index` of the unit would consume for the request in that state, or None."""
    device = unit.devices[index]
    left, used, taken = state
    if index in taken:
        return None
    in_use = dict(used).get(index)
    drawn = dict(zip(unit.counters, left, strict=True))
    counters_ok = all(drawn.get(n, 0) >= v for _, c in device.consumes for n, v in c.items()) and (
        unit.counters or not taken
    )
    if not device.allow_multiple_allocations:
        return {} if in_use is None and counters_ok else None
    consumed = consumption(request.capacity, device.capacity)
    if consumed is None:
        return None
    if in_use is not None:
        return consumed if fits(consumed, device.capacity, dict(in_use)) else None
    return consumed if counters_ok and fits(consumed, device.capacity) else None


def after(unit: Unit, state: UnitState, index: int, consumed: dict[str, Amount]) -> UnitState:
    """The unit's state with device `index` taken (a share consuming `consumed`)."""
    left, used, taken = state
    device = unit.devices[index]
    if not device.allow_multiple_allocations:
        draws = {n: v for _, c in device.consumes for n, v in c.items()}
        return tuple(v - draws.get(n, 0) for n, v in zip(unit.counters, left, strict=True)), used, (*taken, index)
    shares = dict(used)
    if index not in shares:
        draws = {n: v for _, c in device.consumes for n, v in c.items()}
        left = tuple(v - draws.get(n, 0) for n, v in zip(unit.counters, left, strict=True))
    amounts = dict(shares.get(index, ()))
    for name, value in consumed.items():
        amounts[name] = amounts.get(name, 0) + value
    shares[index] = tuple(sorted(amounts.items()))
    return left, tuple(sorted(shares.items())), taken


@dataclass(frozen=True)
class NodeKind:
    """Nodes alike for the supply of shapes: their GPUs and what they hold for pods."""

    units: tuple[Unit, ...]
    allocatable: Mapping[str, float]  # PodRoom.allocatable: nothing where no pod can run
    count: int
    allocator: Callable[[], NodeAllocator]  # one such node's


@dataclass
class Shape:
    key: RequestKey
    demand: Hashable
    claim: Claim  # one claim of this shape: what PodRoom.fits is asked about
    needs: Needs = ()  # what its pods request together
    weight: float = 0.0


@dataclass
class NodeView:
    """A node's units, their states (as interned ids) now, and how many of each of the mix's
    shapes' pods its room takes (for `version` of the mix); dropped when the node's allocations
    change, its room counted again when what the node holds for pods changes (room_changed)."""

    units: list[Unit]
    ids: tuple[int, ...]
    copies: tuple[int, ...] = ()  # per shape of the mix: how many of its pods the room takes (counted up to enough)
    version: int = -1
    left: Mapping[str, float] = field(default_factory=dict)  # the room's resources left
    allocatable: Mapping[str, float] = field(default_factory=dict)  # the room's, where Fragmentation.water caps it
    slack: dict[str, float] = field(default_factory=dict)  # resource -> what a claim may take leaving `copies` as is
    # what the two below keep is shared by the views counted alike (Fragmentation._scored_alike)
    after: dict[Needs, tuple[int, ...]] = field(default_factory=dict)  # a claim's pods' needs -> copies after
    scored: dict[int, Choice | None] = field(default_factory=dict)  # this mix's choices by Fragmentation.asked
    hosts: dict[RequestKey, bool] = field(default_factory=dict)  # request -> enough units could take it

    def room_changed(self) -> None:
        """A pod without claims came, went or was resized, or the node's allocatable changed: the
        room's copies (and the scores read from them) are counted again when next asked, the
        units' states (the devices did not change) are kept."""
        self.version = -1  # counted for no mix: room_copies counts them afresh


@dataclass
class Choice:
    score: float
    units: tuple[int, ...]  # positions in NodeView.units the placement should use
    # One device asked: the units whose rise in F is within lifetimes.TOLERANCE of the best, best
    # first (the claim's expected end picks among them, cluster.py); its own state's, not the claim's.
    near: tuple[tuple[int, float], ...] = ()  # position, score


@dataclass
class Fragmentation:
    """The learned mix and what is kept by unit state; one per ClusterAllocator."""

    seen: Counter[tuple[RequestKey, Hashable]] = field(default_factory=Counter)
    examples: dict[tuple[RequestKey, Hashable], Claim] = field(default_factory=dict)
    needs: dict[tuple[RequestKey, Hashable], Needs] = field(default_factory=dict)
    mix: list[Shape] = field(default_factory=list)
    observed: int = 0
    version: int = 0
    _learn_at: int = FIRST_LEARN
    _ids: dict[Hashable, int] = field(default_factory=dict)  # (unit kind, state) -> id
    _states: list[tuple[Unit, UnitState, float]] = field(default_factory=list)  # id -> unit, state, free share
    _usable: dict[tuple[int, RequestKey], int | None] = field(default_factory=dict)  # -> device index
    _vectors: dict[int, tuple[bool, ...]] = field(default_factory=dict)  # id -> usable by each mix shape
    _unusables: dict[int, tuple[float, ...]] = field(default_factory=dict)  # id -> free share each can't use
    _amounts: dict[Hashable, float] = field(default_factory=dict)
    # (unit ids, room left, allocatable, copies) -> the memos (NodeView.after, NodeView.scored) of
    # the views counted so for this mix and level
    _alike: dict[Hashable, tuple[dict[Needs, tuple[int, ...]], dict[int, Choice | None]]] = field(default_factory=dict)
    _choices: dict[Hashable, Choice | None] = field(default_factory=dict)
    _matches: dict[Hashable, tuple[bool, ...]] = field(default_factory=dict)  # (unit kind, request) -> per device
    census: dict[Hashable, tuple[Unit, int]] = field(default_factory=dict)  # the cluster's units: kind -> one, count
    _scarcity: dict[Hashable, float] = field(default_factory=dict)  # unit kind -> scarcity (this mix and census)
    _shares: dict[tuple[Hashable, RequestKey], float | None] = field(default_factory=dict)  # -> share of a unit
    _shares_by_kinds: dict[tuple[Hashable, ...], list[float | None]] = field(default_factory=dict)  # _shares_on's
    _asks: dict[tuple[RequestKey, Needs], int] = field(default_factory=dict)
    _counted: set[tuple[str, str]] = field(default_factory=set)  # claims counted in the mix: key, uid
    _waited: set[tuple[RequestKey | None, Hashable]] = field(default_factory=set)  # shapes waits() asked about
    # Where pods without claims are placed by kube-scheduler: resource -> the share of a node's
    # allocatable its room keeps at most once they have come (water_level.py); empty: not capped.
    water: dict[str, float] = field(default_factory=dict)

    def asked(self, key: RequestKey, needs: Needs) -> int:
        """A request and its pods' needs as one small number (views keep scores by it)."""
        return self._asks.setdefault((key, needs), len(self._asks))

    def observe(
        self, claim: Claim, demand: Hashable, needs: Needs, kinds: Callable[[], Sequence[NodeKind]] = tuple
    ) -> None:
        """Count a claim asked about, once: a claim that waits is asked about again each pass, and
        making room asks about the claims it would move; counting those again would weigh the mix
        towards what waits. `needs`: what its pods request (sorted pairs, PodRoom.needs); `kinds`:
        the cluster's nodes, read when the mix is learned."""
        key = request_key(claim)
        if key is None or (claim.key, claim.uid) in self._counted:
            return
        if len(self._counted) >= MAX_COUNTED:  # bounded: a claim long gone may count again, no harm
            self._counted.clear()
        self._counted.add((claim.key, claim.uid))
        shape = (key, demand)
        self.seen[shape] += 1
        if shape not in self.examples:
            self.examples[shape] = claim
            self.needs[shape] = needs
        self.observed += 1
        if self.observed >= self._learn_at:
            self._learn_at *= 2
            self.learn(kinds())

    def waits(self, claim: Claim, demand: Hashable, kinds: Callable[[], Sequence[NodeKind]] = tuple) -> None:
        """A claim (observed) fits no node: where its shape is not in the mix but would be, learned
        now, the mix is learned at once rather than at the next doubling. A rare shape that only a
        few nodes run is first seen when it waits, and until it weighs in the mix other claims keep
        filling the nodes it needs as they empty. Asked once per shape."""
        shape = (request_key(claim), demand)
        if shape[0] is None or shape not in self.seen or shape in self._waited:
            return
        self._waited.add(shape)
        if any((s.key, s.demand) == shape for s in self.mix):
            return
        mix = self._mix_from(kinds())
        if any((s.key, s.demand) == shape for s in mix):
            self._adopt(mix)

    def learn(self, kinds: Sequence[NodeKind] = ()) -> None:
        """The mix from the counts so far (`kinds`: the cluster's nodes, for scarce demands and
        supply, see the module's doc; none: each request with its most common demand, weighed by
        its count); what was kept for the old mix goes."""
        self._adopt(self._mix_from(kinds))

    def _mix_from(self, kinds: Sequence[NodeKind]) -> list[Shape]:
        demands: dict[RequestKey, Counter[Hashable]] = {}
        for (key, demand), count in self.seen.items():
            if key:
                demands.setdefault(key, Counter())[demand] += count
        counted: list[tuple[float, Shape, float]] = []  # claims, shape, supply weight
        for key, by_demand in demands.items():
            main = self._shape(key, by_demand.most_common(1)[0][0])  # the pods such claims most often have
            hosts = self._kinds_taking(kinds, main)
            usable = sum(gpus for gpus, _ in hosts)
            fit = {
                demand: sum(gpus for gpus, held in hosts if _how_many(held, self.needs[key, demand]) >= 1)
                for demand in by_demand
            }
            rest = sum(by_demand.values())
            for demand, count in by_demand.items():
                if demand != main.demand and fit[demand] < SCARCE_SUPPLY * fit[main.demand]:
                    counted.append((count, self._shape(key, demand), supply_weight(fit[demand], usable)))
                    rest -= count
            counted.append((rest, main, supply_weight(fit[main.demand], usable)))
        counted.extend(self._whole_nodes(kinds))
        total = sum(claims for claims, _, _ in counted)
        weighed = sum(claims * weight for claims, _, weight in counted)
        counted.sort(key=lambda c: -c[0] * c[2])  # by weight: a scarce shape of few claims weighs in
        mix: list[Shape] = []
        covered = 0.0
        for claims, shape, weight in counted[:MIX_SHAPES]:
            if covered >= MIX_SHARE * weighed:
                break
            shape.weight = claims / total * weight
            mix.append(shape)
            covered += claims * weight
        return mix

    def _adopt(self, mix: list[Shape]) -> None:
        """The mix in use from now on; what was kept for the old one goes."""
        self.mix = mix
        self.version += 1
        self._vectors.clear()
        self._unusables.clear()
        self._amounts.clear()
        self._alike.clear()
        self._choices.clear()
        self._scarcity.clear()
        self._shares.clear()
        self._shares_by_kinds.clear()

    def _whole_nodes(self, kinds: Sequence[NodeKind]) -> list[tuple[float, Shape, float]]:
        """The prior (see the module's doc): per kind of node with several GPUs, a claim for all of
        them whose pods take WHOLE_NODE_SHARE of its CPU and memory, counted as WHOLE_NODE_PRIOR
        claims and weighed by its supply, where that claim fits no other kind (openb, seeds 42-51,
        arrival only: 4.34% unallocated at 100% arrived, 4.37 with a prior for every kind); none
        until a claim for whole GPUs (no capacity, no selectors) was seen, whose class and request
        it copies. Kept where kube-scheduler places the pods without claims too (openb in time as
        deployed, a quarter of the cluster, seeds 42-44: 36.4, 26.2 and 9.0 GPU-hours waited with
        it, 69.6, 70.4 and 32.5 without; the level, water_level.py, keeps what it strands in the
        arrival-only replay small)."""
        whole: Counter[RequestKey] = Counter()
        for (key, _), count in self.seen.items():
            if key and not key[1] and not key[3]:
                whole[key] += count
        if not whole:
            return []
        common = whole.most_common(1)[0][0]
        example = next(claim for (key, _), claim in self.examples.items() if key == common)
        shapes = []
        for index, kind in enumerate(kinds):
            if len(kind.units) < 2 or not kind.allocatable:
                continue
            request = dataclasses.replace(example.requests[0][0], count=len(kind.units), selectors=())
            sized = [(name, value * WHOLE_NODE_SHARE) for name, value in kind.allocatable.items() if name in SIZED]
            needs: Needs = tuple(sorted([*sized, (PODS, 1.0)]))
            claim = dataclasses.replace(example, name=f"whole-node-{index}", uid="", requests=((request,),))
            shape = Shape(request_key(claim) or (), ("whole node", needs), claim, needs)
            hosts = self._kinds_taking(kinds, shape)
            fitting = [gpus for gpus, held in hosts if _how_many(held, needs) >= 1]
            if len(fitting) > 1:
                continue
            fit = sum(fitting)
            shapes.append((WHOLE_NODE_PRIOR, shape, supply_weight(fit, sum(gpus for gpus, _ in hosts))))
        return shapes

    def _shape(self, key: RequestKey, demand: Hashable) -> Shape:
        return Shape(key, demand, self.examples[key, demand], self.needs[key, demand])

    def _kinds_taking(self, kinds: Sequence[NodeKind], shape: Shape) -> list[tuple[int, Mapping[str, float]]]:
        """Per kind of node whose GPUs, free, could take the shape's request: its GPUs and what it
        holds for pods."""
        return [
            (kind.count * len(kind.units), kind.allocatable)
            for kind in kinds
            if sum(1 for unit in kind.units if self.share(kind.allocator, unit, shape) is not None)
            >= devices_asked(shape.key)
        ]

    def places_claimless(self) -> bool:
        """Whether pods without claims are placed here too (claims without requests seen)."""
        return any(key == () for key, _ in self.seen)

    def claims_per_gpu(self, kinds: Sequence[NodeKind]) -> dict[str, float]:
        """What the claims seen ask of a node for their pods per GPU they take (SIZED resources;
        GPUs: devices asked x the share of a unit one takes on the first kind of node whose GPUs can
        take it; shapes no kind's GPUs can take are left out)."""
        asked: dict[str, float] = {}
        gpus = 0.0
        for (key, demand), count in self.seen.items():
            if not key:
                continue
            shape = self._shape(key, demand)
            shares = (self.share(k.allocator, u, shape) for k in kinds for u in k.units[:1])
            share = next((found for found in shares if found), None)
            if share is None:
                continue
            gpus += count * devices_asked(key) * share
            for name, value in shape.needs:
                if name in SIZED:
                    asked[name] = asked.get(name, 0.0) + count * value
        return {name: value / gpus for name, value in asked.items()} if gpus else {}

    def free_gpus(self, view: NodeView) -> float:
        """The free share of the view's units, summed."""
        return sum(self._states[u][2] for u in view.ids)

    def flood(self, water: Mapping[str, float], views: Mapping[str, NodeView | None]) -> list[str]:
        """A new level for the rooms (see `water`), taken where it moved by LEVEL_STEP or more. Of
        the `views` (by node), those whose room the new level caps otherwise are counted again when
        next asked (room_changed): their nodes are returned. A room under both levels keeps its
        copies and scores, as does all a claim leaves of it (the views' copies change for a level of
        other resources: every view counted again, under a new version)."""
        if water.keys() != self.water.keys():
            self.water = dict(water)
            self.version += 1
            self._alike.clear()
            return []
        if not any(abs(water[n] - v) >= LEVEL_STEP for n, v in self.water.items()):
            return []
        old, self.water = self.water, dict(water)
        self._alike.clear()  # what was scored under the old level
        recapped = []
        for node, view in views.items():
            if view is not None and view.version == self.version and view.allocatable and self._recapped(view, old):
                view.room_changed()
                recapped.append(node)
        return recapped

    def _recapped(self, view: NodeView, old: Mapping[str, float]) -> bool:
        """Whether the view's room capped at the level now differs from it capped at `old`."""
        return capped(view.left, view.allocatable, old) != capped(view.left, view.allocatable, self.water)

    def count_units(self, units: Sequence[Unit], sign: int) -> None:
        """A node's units in (sign 1) or out (-1) of the census: what was scored against the old one
        goes (scarcity weighs each unit by the census), a new version for every view."""
        for unit in units:
            example, count = self.census.get(unit.kind, (unit, 0))
            if count + sign:
                self.census[unit.kind] = (example, count + sign)
            else:
                del self.census[unit.kind]
        self._scarcity.clear()
        self._choices.clear()
        self._alike.clear()
        self.version += 1

    # --- units ----------------------------------------------------------------------------------

    def view(self, units: list[Unit], states: list[UnitState]) -> NodeView:
        return NodeView(units, tuple(self._id(unit, state) for unit, state in zip(units, states, strict=True)))

    def _id(self, unit: Unit, state: UnitState) -> int:
        key = (unit.kind, state)
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = len(self._states)
            self._states.append((unit, state, free_share(unit, state)))
        return found

    def _usable_device(
        self, allocator: Callable[[], NodeAllocator], uid: int, claim: Claim, key: RequestKey
    ) -> int | None:
        """The first device of the unit that could take the claim's one request in that state."""
        memo = (uid, key)
        if memo not in self._usable:
            unit, state, _ = self._states[uid]
            request = claim.requests[0][0]
            matching = self._matching(allocator, unit, claim, key)
            self._usable[memo] = next(
                (i for i, ok in enumerate(matching) if ok and takes(unit, state, i, request) is not None), None
            )
        return self._usable[memo]

    def _matching(
        self, allocator: Callable[[], NodeAllocator], unit: Unit, claim: Claim, key: RequestKey
    ) -> tuple[bool, ...]:
        """Which of the unit's devices the request selects, kept by the unit's kind (devices of
        one shape answer alike unless a selector reads what each keeps apart, such as its uuid:
        scoring only, the search evaluates every device)."""
        memo = (unit.kind, key)
        found = self._matches.get(memo)
        if found is None:
            node_allocator = allocator()
            selectors = compiled_selectors(node_allocator.classes, claim.requests[0][0], claim)
            found = self._matches[memo] = tuple(node_allocator.selectable(d, selectors) for d in unit.devices)
        return found

    def selecting(
        self, allocator: Callable[[], NodeAllocator], units: Sequence[Unit], claim: Claim, key: RequestKey
    ) -> int:
        """How many of the units have a device the request selects."""
        return sum(1 for unit in units if any(self._matching(allocator, unit, claim, key)))

    def scarcity(self, allocator: Callable[[], NodeAllocator], unit: Unit) -> float:
        """How much the mix's restricted shapes need units of this kind (see the module's doc)."""
        found = self._scarcity.get(unit.kind)
        if found is None:
            total = sum(count for _, count in self.census.values())
            found = 0.0
            for shape in self.mix:
                if shape.key and shape.key[1] and self._selects(allocator, unit, shape):  # restricted, to this kind
                    supply = sum(n for example, n in self.census.values() if self._selects(allocator, example, shape))
                    found += shape.weight * total / max(supply, 1)
            self._scarcity[unit.kind] = found
        return found

    def _selects(self, allocator: Callable[[], NodeAllocator], unit: Unit, shape: Shape) -> bool:
        return any(self._matching(allocator, unit, shape.claim, shape.key))

    def _vector(self, allocator: Callable[[], NodeAllocator], uid: int) -> tuple[bool, ...]:
        found = self._vectors.get(uid)
        if found is None:
            found = self._vectors[uid] = tuple(
                not shape.key or self._usable_device(allocator, uid, shape.claim, shape.key) is not None
                for shape in self.mix
            )
        return found

    def _unusable(self, allocator: Callable[[], NodeAllocator], uid: int) -> tuple[float, ...]:
        """Per shape of the mix, the unit's free share where the shape cannot use it, else 0."""
        found = self._unusables.get(uid)
        if found is None:
            free = self._states[uid][2]
            found = self._unusables[uid] = tuple(0.0 if ok else free for ok in self._vector(allocator, uid))
        return found

    def share(self, allocator: Callable[[], NodeAllocator], unit: Unit, shape: Shape) -> float | None:
        """The share of a free unit of this kind that one device of the shape's request takes, or
        None where the request can use none of its devices."""
        memo = (unit.kind, shape.key)
        if memo not in self._shares:
            fresh: UnitState = (tuple(unit.counters.values()), (), ())
            request, found = shape.claim.requests[0][0], None
            for index, selected in enumerate(self._matching(allocator, unit, shape.claim, shape.key)):
                consumed = takes(unit, fresh, index, request) if selected else None
                if consumed is not None:
                    found = 1.0 - free_share(unit, after(unit, fresh, index, consumed))
                    break
            self._shares[memo] = found
        return self._shares[memo]

    def _shares_on(self, allocator: Callable[[], NodeAllocator], ids: tuple[int, ...]) -> list[float | None]:
        """Per shape of the mix, the share of a unit of the node's it takes per device (None: none);
        kept by the node's kinds of unit (its units' states do not matter)."""
        units = {self._states[u][0].kind: self._states[u][0] for u in ids}
        kinds = tuple(units)
        shares = self._shares_by_kinds.get(kinds)
        if shares is None:
            shares = self._shares_by_kinds[kinds] = []
            for shape in self.mix:
                found = None
                if shape.key:
                    found = next((f for f in (self.share(allocator, u, shape) for u in units.values()) if f), None)
                shares.append(found)
        return shares

    def room_copies(
        self, allocator: Callable[[], NodeAllocator], view: NodeView, room: ScoredRoom | None, node: str
    ) -> tuple[int, ...]:
        """Per shape of the mix, how many of its pods the node's room takes, counted only up to as
        many as would use all the node's free share (more change nothing in F, and fewer distinct
        values keep more scores shared); kept with the view until the mix changes."""
        if view.version == self.version:
            return view.copies
        view.left = room.left(node) if room is not None else {}
        view.allocatable = {}
        if room is not None and self.water and room.open_to_any_pod(node):  # where the level reaches
            view.allocatable = room.allocatable(node)
        left = capped(view.left, view.allocatable, self.water) if view.allocatable else view.left
        total = self.free_gpus(view)
        # slack stays what the uncapped room may give: the level caps what is left, not what is taken
        copies, slack = [], dict(view.left)
        for shape, share in zip(self.mix, self._shares_on(allocator, view.ids), strict=True):
            count = 0
            if room is None or room.admits(shape.claim, node):
                enough = max(1, math.ceil(total / (share * devices_asked(shape.key)) - 1e-9)) if share else 1
                count = min(enough, _how_many(left, shape.needs))
                for name, value in shape.needs:
                    slack[name] = min(slack.get(name, 0.0), view.left.get(name, 0.0) - count * value)
            copies.append(count)
        view.copies, view.slack, view.version = tuple(copies), slack, self.version
        view.after, view.scored = self._scored_alike(view)
        return view.copies

    def _scored_alike(self, view: NodeView) -> tuple[dict[Needs, tuple[int, ...]], dict[int, Choice | None]]:
        """The memos of a view just counted: those of the views counted alike (what copies_after and
        score find depends on nothing else: the slack too follows from the room and copies), so
        each kind of node is scored once per claim shape, not each node (most nodes of a kind are
        empty or full alike)."""
        alike = (view.ids, tuple(view.left.items()), tuple(view.allocatable.items()), view.copies)
        found = self._alike.get(alike)
        if found is None:
            if len(self._alike) >= ALIKE_LIMIT:
                self._alike.clear()
            found = self._alike[alike] = ({}, {})
        return found

    def copies_after(self, view: NodeView, needs: Needs) -> tuple[int, ...]:
        """view.copies once a claim's pods (`needs`, sorted pairs) run on the node (room_copies first)."""
        found = view.after.get(needs)
        if found is None:
            if all(value <= view.slack.get(name, 0.0) + 1e-9 for name, value in needs):
                found = view.copies
            else:
                left = dict(view.left)
                for name, value in needs:
                    left[name] = left.get(name, 0.0) - value
                if view.allocatable:
                    left = capped(left, view.allocatable, self.water)
                many: dict[Needs, int] = {}  # shapes differing only in devices share their pods' needs
                counts = []
                for shape, count in zip(self.mix, view.copies, strict=True):
                    if count and shape.needs not in many:
                        many[shape.needs] = _how_many(left, shape.needs)
                    counts.append(min(count, max(0, many[shape.needs])) if count else 0)
                found = tuple(counts)
            view.after[needs] = found
        return found

    def amount(self, allocator: Callable[[], NodeAllocator], ids: tuple[int, ...], copies: tuple[int, ...]) -> float:
        """F: the mix's weighted free share on units that are fragments for it, and (stranding) the
        free share beyond what as many pods of the shape as the room takes would use. It does not
        depend on the units' order: summed in one order (sorted ids), units of a state score alike
        to the last bit wherever they sit."""
        ids = tuple(sorted(ids))
        memo = (ids, copies)
        found = self._amounts.get(memo)
        if found is not None:
            return found
        total = sum(self._states[u][2] for u in ids)
        # per shape: how many of the units could take it, and the free share of those that could not
        usable = _column_sums([self._vector(allocator, u) for u in ids], len(self.mix))
        unusable = _column_sums([self._unusable(allocator, u) for u in ids], len(self.mix))
        shares = self._shares_on(allocator, ids)
        amount = 0.0
        for j, (shape, count, share) in enumerate(zip(self.mix, copies, shares, strict=True)):
            stranded = max(0.0, total - count * devices_asked(shape.key) * share) if share else 0.0
            if not count:
                amount += shape.weight * (total + stranded)
            elif shape.key:
                wasted = total if usable[j] < devices_asked(shape.key) else unusable[j]
                amount += shape.weight * (wasted + stranded)
        self._amounts[memo] = amount
        return amount

    # --- choosing -------------------------------------------------------------------------------

    def score(
        self,
        allocator: Callable[[], NodeAllocator],
        view: NodeView,
        room: ScoredRoom | None,
        node: str,
        claim: Claim,
        key: RequestKey,
        needs: Needs,
        ask: int,
    ) -> Choice | None:
        """choose() with the room's copies before and after the claim's pods, kept with the view
        by `ask` (asked(key, needs))."""
        if view.version == self.version and ask in view.scored:
            return view.scored[ask]
        if key and not self._hosts_request(allocator, view, claim, key):
            if view.version == self.version:
                view.scored[ask] = None
            return None  # what choose() finds, without the room's copies
        copies = self.room_copies(allocator, view, room, node)
        choice = view.scored[ask] = self.choose(allocator, view, copies, self.copies_after(view, needs), claim, key)
        return choice

    def _hosts_request(
        self, allocator: Callable[[], NodeAllocator], view: NodeView, claim: Claim, key: RequestKey
    ) -> bool:
        """Whether enough of the node's units could take the request (kept with the view)."""
        found = view.hosts.get(key)
        if found is None:
            usable = sum(1 for uid in view.ids if self._usable_device(allocator, uid, claim, key) is not None)
            found = view.hosts[key] = usable >= devices_asked(key)
        return found

    def choose(
        self,
        allocator: Callable[[], NodeAllocator],
        view: NodeView,
        copies: tuple[int, ...],
        copies_after: tuple[int, ...],
        claim: Claim,
        key: RequestKey,
    ) -> Choice | None:
        """The claim's best units on the node and the rise in F once it and its pods are there (the
        room's copies before and after them), or None where no unit could take it (the search may
        still find room: such nodes are tried last); kept by node state. `allocator`: the node's,
        made only when what is asked is not kept already."""
        memo = (view.ids, copies, copies_after, key)
        if memo in self._choices:
            return self._choices[memo]
        before = self.amount(allocator, view.ids, copies)
        choice: Choice | None = None
        if not key:  # no devices: what its pods take from the room
            choice = Choice(self.amount(allocator, view.ids, copies_after) - before, ())
        else:
            # Each unit that could take the request: (rise in F + scarcity cost, position, state
            # after, scarcity cost), best first (ties: a GPU in use before a free one, then the
            # least left after it: best fit).
            # A unit's option follows from its state alone (F does not depend on the units' order),
            # so the units of a state (a node's free GPUs, say) are scored once.
            options: list[tuple[float, int, int, float]] = []
            by_state: dict[int, tuple[float, int, float] | None] = {}
            for position, uid in enumerate(view.ids):
                if uid not in by_state:
                    by_state[uid] = self._option(allocator, view.ids, position, claim, key, copies_after, before)
                found = by_state[uid]
                if found is not None:
                    rise, new, cost = found
                    options.append((rise, position, new, cost))
            free = [self._states[u][2] for u in view.ids]
            options.sort(key=lambda o: (o[0], free[o[1]] == 1.0, self._states[o[2]][2], o[1]))
            count = devices_asked(key)
            if len(options) >= count:
                ids_after = list(view.ids)
                for _, position, new, _ in options[:count]:
                    ids_after[position] = new
                chosen = tuple(position for _, position, _, _ in options[:count])
                scarcity = sum(cost for *_, cost in options[:count])
                score = (
                    options[0][0]
                    if count == 1
                    else self.amount(allocator, tuple(ids_after), copies_after) - before + scarcity
                )
                near = tuple((p, rise) for rise, p, _, _ in options if rise <= options[0][0] + TOLERANCE)
                choice = Choice(score, chosen, near if count == 1 else ())
        self._choices[memo] = choice
        return choice

    def _option(
        self,
        allocator: Callable[[], NodeAllocator],
        ids: tuple[int, ...],
        position: int,
        claim: Claim,
        key: RequestKey,
        copies_after: tuple[int, ...],
        before: float,
    ) -> tuple[float, int, float] | None:
        """The claim on the unit at `position` (choose()): the rise in F plus the scarcity cost, the
        unit's state after and that cost; None where the unit could not take it."""
        uid = ids[position]
        index = self._usable_device(allocator, uid, claim, key)
        if index is None:
            return None
        unit, state, free_before = self._states[uid]
        new = self._id(unit, after(unit, state, index, takes(unit, state, index, claim.requests[0][0]) or {}))
        cost = SCARCITY_WEIGHT * (free_before - self._states[new][2]) * self.scarcity(allocator, unit)
        ids_after = (*ids[:position], new, *ids[position + 1 :])
        return self.amount(allocator, ids_after, copies_after) - before + cost, new, cost


def supply_weight(fit: int, usable: int) -> float:
    """A shape's weight per claim: usable / fit where its pods fit nodes holding under SCARCE_SUPPLY
    of the GPUs its request could use (`fit`, `usable`: GPUs), else 1."""
    return usable / fit if 0 < fit < SCARCE_SUPPLY * usable else 1.0


def _column_sums(rows: Sequence[tuple[float, ...]], width: int) -> list[float]:
    """Per column of `rows` (each `width` long), its sum (zip and sum in C: amount()'s inner loop)."""
    return [sum(column) for column in zip(*rows, strict=True)] if rows else [0.0] * width


def _how_many(left: Mapping[str, float], needs: Needs) -> int:
    """How many times `needs` fits in `left` (a large number where it asks for nothing)."""
    return min((int(left.get(name, 0.0) // value + 1e-9) for name, value in needs), default=COPIES_LIMIT)
