"""Making room: which movable allocations to evict so that a pending claim (or a whole gang) fits,
and which to move so that GPUs empty (compaction: the plans that free the most GPUs per eviction
first, none that frees fewer than PAYS). Pure: plans are made on the allocator's own state and
every change is undone before returning (the state is left exactly as found); nothing here evicts,
the caller does (docs/allocator.md, "Making room: the planner").

Cost of a plan, lowest first: fewest victims, then least GPU given back, then youngest.

Search, for one claim: per node with movable allocations, those allocations are grouped by the GPU
(counter set) they sit on; from each such GPU as a seed, whole GPU groups are released, seed first
then cheapest first, until the claim fits on the node (greedy), then each victim is put back where
the claim still fits without it (prune), leaving a set where every victim is needed. That is at
most G seeds x (G + V) node searches a node (G GPUs, V movable allocations on it), on at most
NODES_SEARCHED nodes where room can be made at all (fullest first; any other node costs one
search): O(min(N, NODES_SEARCHED) G (G + V) + N) node searches. A gang: its members largest first,
each planned so on the state the members before it leave, starting from each of the first
member's cheapest plans. Victims that are moved (not killed) must fit again elsewhere with the
pending placements and their own old places both counted: never back into the room they made.

With the nodes' room for pods (a PodRoom: CPU, memory, pod count, what each node admits), "fits"
means by devices and by room: a claim whose devices fit a node but whose pods do not gets victims
whose pods, given back, make the room, and moved victims must find room for their pods too. The
planner counts that on its own copy (planned_room.py): the caller's room is never changed."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from driver.allocator.allocate import SEARCH_STEPS, AllocationError, SearchBudget, SearchBudgetExceeded
from driver.allocator.cluster import ClusterAllocator, Failure, Placement, PodRoom
from driver.allocator.model import Claim
from driver.allocator.planned_room import PlannedRoom
from driver.common.quantity import QuantityError, format_amount, parse_quantity

PLANS = 4  # plans returned: the next is tried when an eviction is refused (a PodDisruptionBudget)
SEEDS_PER_NODE = 8  # GPUs a node's greedy search starts from
NODES_SEARCHED = 16  # nodes, fullest first, where the claim fits with movable allocations gone
COMPACTION_MOVES = 4  # moves one compaction call may plan
PAYS = 1.0  # GPUs a compaction plan must free per move: one GPU for each eviction

GpuId = tuple[str, str, str]  # driver, pool, counter set: one GPU
Cost = tuple[int, float, float]


@dataclass(frozen=True, eq=False)  # by identity: the same claim's allocation is one holder
class Holder:
    """A live allocation: its claim, where it is, whether it may be moved (the pod is movable and
    recreated by a controller), and when it started (larger is younger)."""

    claim: Claim
    node: str
    allocation: dict[str, Any]
    movable: bool
    started: float


@dataclass(frozen=True)
class Plan:
    """Evict `victims`; then `placements` place the pending claim(s); `moves` (when victims are
    moved rather than killed) are where the victims fit again, with the placements counted."""

    victims: tuple[Holder, ...]
    placements: tuple[Placement, ...]
    moves: tuple[Placement, ...]
    cost: Cost


@dataclass(frozen=True)
class Move:
    holder: Holder
    to: Placement


class Scratch:
    """Adds and releases made while planning, undone in reverse order: an add and a release are
    exact inverses on the allocator's state (whole numbers and fractions, counted shares and their
    tenants: each allocation with the claim that holds it). With a room, the holder's pods are
    taken and given back with its devices (`pods`: unless the allocation is no claim's own)."""

    def __init__(self, allocator: ClusterAllocator, room: PlannedRoom | None = None) -> None:
        self.allocator, self.room = allocator, room
        self._undo: list[tuple[Placement, bool, bool]] = []  # what changed, whether added, with its pods

    def add(self, node: str, allocation: dict[str, Any], holder: Claim, pods: bool = True) -> None:
        self._step(Placement(holder, node, allocation), True, pods)

    def release(self, node: str, allocation: dict[str, Any], holder: Claim) -> None:
        self._step(Placement(holder, node, allocation), False, True)

    def _step(self, placement: Placement, add: bool, pods: bool) -> None:
        self._change(placement, add, pods)
        self._undo.append((placement, add, pods))

    def _change(self, placement: Placement, add: bool, pods: bool) -> None:
        change = self.allocator.add if add else self.allocator.release
        change(placement.node, placement.allocation, placement.claim)
        if pods and self.room is not None:
            (self.room.take if add else self.room.give_back)(placement)

    def release_all(self, holders: Sequence[Holder]) -> None:
        for holder in holders:
            self.release(holder.node, holder.allocation, holder.claim)

    def mark(self) -> int:
        return len(self._undo)

    def undo(self, mark: int = 0) -> None:
        while len(self._undo) > mark:
            placement, added, pods = self._undo.pop()
            self._change(placement, not added, pods)


@contextmanager
def trying(allocator: ClusterAllocator, room: PlannedRoom | None = None) -> Iterator[Scratch]:
    scratch = Scratch(allocator, room)
    try:
        yield scratch
    finally:
        scratch.undo()


def _results(allocation: dict[str, Any]) -> list[dict[str, Any]]:
    return (allocation.get("devices") or {}).get("results") or []


def gpus_of(allocator: ClusterAllocator, node: str, allocation: dict[str, Any]) -> set[GpuId]:
    """The GPUs (counter sets) an allocation's devices draw from."""
    pools = {pool.id: pool for pool in allocator.snapshot.pools.get(node, ())}
    gpus: set[GpuId] = set()
    for result in _results(allocation):
        pool = pools.get((result.get("driver", ""), result.get("pool", "")))
        device = pool.device_index().get(result.get("device", "")) if pool else None
        if pool is not None and device is not None:
            gpus.update((*pool.id, counter_set) for counter_set, _ in device.consumes)
    return gpus


def given_back(allocator: ClusterAllocator, holder: Holder) -> float:
    """GPUs an allocation holds: a device's share of its GPU's counters, a share's largest part of
    its device's capacity."""
    pools = {pool.id: pool for pool in allocator.snapshot.pools.get(holder.node, ())}
    total = 0.0
    for result in _results(holder.allocation):
        pool = pools.get((result.get("driver", ""), result.get("pool", "")))
        device = pool.device_index().get(result.get("device", "")) if pool else None
        if pool is None or device is None or result.get("adminAccess"):
            continue
        if result.get("shareID") is not None:
            parts = [0.0]
            for name, value in (result.get("consumedCapacity") or {}).items():
                capacity = device.capacity.get(name)
                try:
                    parts.append(float(parse_quantity(value)) / capacity.value if capacity and capacity.value else 0)
                except QuantityError:
                    continue
            total += max(parts)
            continue
        for counter_set, counters in device.consumes:
            full = sum(pool.counter_sets.get(counter_set, {}).values(), 0)
            total += float(sum(counters.values(), 0)) / full if full else 0
    return total


def _cost(allocator: ClusterAllocator, victims: Sequence[Holder]) -> Cost:
    return len(victims), round(sum(given_back(allocator, v) for v in victims), 6), -sum(v.started for v in victims)


def _size(claim: Claim) -> int:
    return sum(alternatives[0].count or 1 for alternatives in claim.requests)


def _fits_on(
    allocator: ClusterAllocator, node: str, claim: Claim, budget: SearchBudget, room: PlannedRoom | None
) -> dict[str, Any] | None:
    """The claim's allocation on the node, if it fits (its pods too, with a room); the budget
    running out ends the planning."""
    if room is not None and not room.fits(claim, node):
        return None
    try:
        result = allocator.allocate_on(node, [claim], budget)
    except SearchBudgetExceeded:
        raise
    except AllocationError:
        return None
    return result[0] if result else None


def _node_options(
    allocator: ClusterAllocator,
    node: str,
    claim: Claim,
    movable: Sequence[Holder],
    budget: SearchBudget,
    room: PlannedRoom | None,
) -> list[tuple[tuple[Holder, ...], Placement]]:
    """Victim sets on one node after which the claim fits there, each with no victim to spare."""

    def fits() -> dict[str, Any] | None:
        return _fits_on(allocator, node, claim, budget, room)

    with trying(allocator, room) as scratch:
        scratch.release_all(movable)
        if fits() is None:
            return []  # not even with every movable allocation gone
    by_gpu: dict[GpuId, list[Holder]] = defaultdict(list)
    for holder in movable:
        for gpu in gpus_of(allocator, node, holder.allocation):
            by_gpu[gpu].append(holder)
    ordered = sorted(by_gpu, key=lambda gpu: (_cost(allocator, by_gpu[gpu]), gpu))
    options: dict[frozenset[int], tuple[tuple[Holder, ...], Placement]] = {}
    for seed in ordered[:SEEDS_PER_NODE]:
        with trying(allocator, room) as scratch:
            released: list[Holder] = []
            for gpu in [seed, *(g for g in ordered if g != seed)]:
                group = [h for h in by_gpu[gpu] if h not in released]
                scratch.release_all(group)
                released.extend(group)
                if fits() is not None:
                    break
            else:
                continue
            for holder in sorted(released, key=lambda h: _cost(allocator, [h]), reverse=True):
                mark = scratch.mark()
                scratch.add(holder.node, holder.allocation, holder.claim)
                if fits() is None:
                    scratch.undo(mark)  # needed: it goes
                else:
                    released.remove(holder)
            allocation = fits()
            if allocation is not None:
                options.setdefault(frozenset(map(id, released)), (tuple(released), Placement(claim, node, allocation)))
    return list(options.values())


def _claim_options(
    allocator: ClusterAllocator,
    claim: Claim,
    movable: Sequence[Holder],
    budget: SearchBudget,
    room: PlannedRoom | None,
) -> list[tuple[tuple[Holder, ...], Placement]]:
    """Every node's victim sets for one claim, cheapest first; no victims when it fits already.
    With a room, only nodes that admit the claim's pods are searched."""
    outcome = allocator.allocate(claim, room=room, why=False, budget=budget)  # only whether it fits
    if isinstance(outcome, Placement):
        return [((), outcome)]
    by_node: dict[str, list[Holder]] = defaultdict(list)
    for holder in movable:
        by_node[holder.node].append(holder)
    options = []
    searched = 0
    admitted = (name for name in allocator.node_order() if room is None or room.admits(claim, name))
    for node in (name for name in admitted if name in by_node):
        found = _node_options(allocator, node, claim, by_node[node], budget, room)
        options.extend(found)
        searched += bool(found)
        if searched >= NODES_SEARCHED:
            break
    return sorted(options, key=lambda option: (_cost(allocator, option[0]), option[1].node))


def _gang_options(
    allocator: ClusterAllocator,
    claims: Sequence[Claim],
    movable: Sequence[Holder],
    limit: int,
    budget: SearchBudget,
    room: PlannedRoom | None,
) -> list[tuple[tuple[Holder, ...], tuple[Placement, ...]]]:
    """Victims and placements for every member, largest first, from each of the first member's
    `limit` cheapest options; each later member takes its cheapest option on what is left."""
    first, *rest = sorted(claims, key=_size, reverse=True)
    found: dict[frozenset[int], tuple[tuple[Holder, ...], tuple[Placement, ...]]] = {}
    for victims, placement in _claim_options(allocator, first, movable, budget, room)[:limit]:
        with trying(allocator, room) as scratch:
            scratch.release_all(victims)
            scratch.add(placement.node, placement.allocation, placement.claim)
            chosen, placed = list(victims), [placement]
            for claim in rest:
                options = _claim_options(allocator, claim, [h for h in movable if h not in chosen], budget, room)
                if not options:
                    break
                more, where = options[0]
                scratch.release_all(more)
                scratch.add(where.node, where.allocation, where.claim)
                chosen.extend(more)
                placed.append(where)
            else:
                found.setdefault(frozenset(map(id, chosen)), (tuple(chosen), tuple(placed)))
    return list(found.values())


def _rest_of_shared(allocator: ClusterAllocator, holder: Holder) -> dict[str, Any]:
    """A share taking what is left of each shared device the holder has a share of: a share
    placed on a device in use draws no counters, so only this keeps moves off it."""
    pools = {pool.id: pool for pool in allocator.snapshot.pools.get(holder.node, ())}
    results = []
    for result in _results(holder.allocation):
        pool = pools.get((result.get("driver", ""), result.get("pool", "")))
        device = pool.device_index().get(result.get("device", "")) if pool else None
        if device is None or result.get("shareID") is None:
            continue
        left = allocator.state.capacity_left(device)
        consumed = {name: format_amount(value) for name, value in left.items() if value > 0}
        results.append({**result, "shareID": f"{result['shareID']}-rest", "consumedCapacity": consumed})
    return {"devices": {"results": results}}


def _moves(
    allocator: ClusterAllocator,
    victims: Sequence[Holder],
    placements: Sequence[Placement],
    budget: SearchBudget,
    room: PlannedRoom | None,
) -> tuple[Placement, ...] | None:
    """Where the victims fit again, largest first, with the pending placements on top of the
    state as it is (victims still in their old places, their pods still counted there): never
    into the room they made."""
    with trying(allocator, room) as scratch:
        for placement in placements:
            scratch.add(placement.node, placement.allocation, placement.claim)
        for victim in victims:
            scratch.add(victim.node, _rest_of_shared(allocator, victim), victim.claim, pods=False)
        moves = []
        for victim in sorted(victims, key=lambda v: given_back(allocator, v), reverse=True):
            outcome = allocator.allocate(victim.claim, room=room, why=False, budget=budget)
            if isinstance(outcome, Failure):
                return None
            scratch.add(outcome.node, outcome.allocation, outcome.claim)
            moves.append(outcome)
        return tuple(moves)


def make_room(
    allocator: ClusterAllocator,
    pending: Claim | Sequence[Claim],
    holders: Sequence[Holder],
    move: bool = True,
    limit: int = PLANS,
    budget: SearchBudget | None = None,
    room: PodRoom | None = None,
) -> list[Plan]:
    """Up to `limit` plans, cheapest first, after each of which the pending claim (or every
    member of a gang) fits; with `move`, only plans whose victims fit again elsewhere. None when
    nothing movable would make room; one with no victims when it fits already. A caller whose
    eviction of a victim is refused takes the next plan that does not name it, or plans again with
    that victim not movable. Every search of the planning spends one `budget` (default:
    SEARCH_STEPS); none when it runs out (budget.exhausted): a plan of an unfinished search may
    evict more than the claim needs. With `room` (what the nodes have left for pods), the pending
    pods and the moved victims' pods must fit there too, and victims whose pods' room lets the
    pending pods fit are chosen as victims whose devices do; `room` is read, never changed."""
    claims = [pending] if isinstance(pending, Claim) else list(pending)
    movable = [h for h in holders if h.movable]
    if not claims:
        return []
    budget = budget or SearchBudget(SEARCH_STEPS)
    planned = PlannedRoom(room) if room is not None else None
    options: list[tuple[tuple[Holder, ...], tuple[Placement, ...]]]
    try:
        if len(claims) == 1:
            found = _claim_options(allocator, claims[0], movable, budget, planned)
            options = [(victims, (placement,)) for victims, placement in found]
        else:
            options = _gang_options(allocator, claims, movable, limit, budget, planned)
    except SearchBudgetExceeded:
        return []
    plans = []
    for victims, placements in sorted(options, key=lambda option: _cost(allocator, option[0])):
        moves = _moves(allocator, victims, placements, budget, planned) if move and victims else ()
        if budget.exhausted:
            return []
        if moves is None:
            continue
        plans.append(Plan(victims, placements, moves, _cost(allocator, victims)))
        if len(plans) >= limit:
            break
    return plans


@dataclass(frozen=True, eq=False)
class _Emptying:
    """Moving `holders` empties the GPUs `frees` (every holder on them goes): one compaction plan,
    worth its GPUs freed per eviction."""

    holders: tuple[Holder, ...]
    frees: frozenset[GpuId]
    size: float  # GPU given back: smaller plans take less of the holes later arrivals could use

    @property
    def pays(self) -> float:
        return len(self.frees) / len(self.holders)


def _emptyings(allocator: ClusterAllocator, holders: Sequence[Holder], pays: float) -> list[_Emptying]:
    """For each GPU whose every holder may move, the plan that moves them, if it frees at least
    `pays` GPUs per move; best paying first, then fewest moves, then smallest."""
    gpus = {id(h): gpus_of(allocator, h.node, h.allocation) for h in holders}
    on_gpu: dict[GpuId, list[Holder]] = defaultdict(list)
    for holder in holders:
        for gpu in gpus[id(holder)]:
            on_gpu[gpu].append(holder)
    found: dict[frozenset[int], _Emptying] = {}
    for group in on_gpu.values():
        if not all(h.movable for h in group):
            continue
        ids = frozenset(map(id, group))
        # A holder on several GPUs frees each of them that nothing outside the group holds.
        frees = frozenset(g for h in group for g in gpus[id(h)] if ids.issuperset(map(id, on_gpu[g])))
        plan = _Emptying(tuple(group), frees, sum(given_back(allocator, h) for h in group))
        if plan.pays >= pays and ids not in found:
            found[ids] = plan
    return sorted(found.values(), key=lambda p: (-p.pays, len(p.holders), p.size, min(p.frees)))


def compaction(
    allocator: ClusterAllocator,
    holders: Sequence[Holder],
    limit: int = COMPACTION_MOVES,
    budget: SearchBudget | None = None,
    pays: float = PAYS,
) -> list[Move]:
    """Moves, at most `limit`, that empty GPUs into holes on GPUs already in use, the plans that
    free the most GPUs per move first (a GPU whose one holder moves before one whose three do),
    and none that frees fewer than `pays` GPUs per move: a move that pays less waits, its eviction
    kept for a plan that pays. Only the holders of a GPU that empties move (a GPU is emptied whole
    or not at all; one holding anything not movable stays), never onto a GPU nothing used, never
    onto one being emptied, and no GPU a move went to is emptied afterwards. Every search spends
    one `budget` (default: SEARCH_STEPS); once it runs out, the moves found so far."""
    budget = budget or SearchBudget(SEARCH_STEPS)
    moves: list[Move] = []
    moved: set[int] = set()
    emptied: set[GpuId] = set()
    filled: set[GpuId] = set()  # GPUs moves went to: not emptied afterwards
    with trying(allocator) as scratch:
        for plan in _emptyings(allocator, holders, pays):
            if budget.exhausted:
                break
            if len(moves) + len(plan.holders) > limit or plan.frees & filled or moved & set(map(id, plan.holders)):
                continue
            planned = _empty(allocator, scratch, plan, emptied, budget)
            if planned is None:
                continue
            moves.extend(planned)
            moved.update(id(m.holder) for m in planned)
            emptied.update(plan.frees)
            filled.update(g for m in planned for g in gpus_of(allocator, m.to.node, m.to.allocation))
    return moves


def _empty(
    allocator: ClusterAllocator, scratch: Scratch, plan: _Emptying, emptied: set[GpuId], budget: SearchBudget
) -> list[Move] | None:
    """The plan's holders placed again, largest first, on GPUs in use other than those it and the
    plans before it empty; None (and nothing changed) when one has nowhere to go. Each is placed
    with its old place still held, so it goes only where the allocator would rather put it than
    its own GPU (searched with its own GPU emptied first, moves paid less on the packing trace:
    docs/benchmarks/make-room.md, "Compaction that pays")."""
    mark = scratch.mark()
    planned = []
    for holder in sorted(plan.holders, key=lambda h: given_back(allocator, h), reverse=True):
        outcome = allocator.allocate(holder.claim, why=False, budget=budget)
        if isinstance(outcome, Failure) or _opens(allocator, outcome):
            break
        targets = gpus_of(allocator, outcome.node, outcome.allocation)
        if not targets or targets & (emptied | plan.frees):
            break
        scratch.add(outcome.node, outcome.allocation, outcome.claim)
        planned.append(Move(holder, outcome))
    else:
        scratch.release_all(plan.holders)
        return planned
    scratch.undo(mark)
    return None


def _opens(allocator: ClusterAllocator, placement: Placement) -> bool:
    """Whether a placement draws on a GPU nothing draws on yet."""
    pools = {pool.id: pool for pool in allocator.snapshot.pools.get(placement.node, ())}
    for driver, pool_name, counter_set in gpus_of(allocator, placement.node, placement.allocation):
        pool = pools[driver, pool_name]
        if allocator.state.counters_left(pool).get(counter_set) == pool.counter_sets.get(counter_set):
            return True
    return False
