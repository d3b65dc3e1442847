"""Making room: evict movable (or lower-priority) pods so that a claim or gang that fits nowhere
can be placed, and hold the freed devices for it (docs/allocator.md, "Making room").

Opt-in (`--make-room`). After a pass, each unit that could not be placed (a claim, or a gang's
waiting members) is planned for on the pass's allocator (driver/allocator/make_room.py: fewest
victims, then least GPU given back, then youngest; victims that are moved must fit again
elsewhere), with what the nodes have left for pods (the pass's room: CPU, memory, pod count): a
claim that fits a node by its devices but not by its pods' CPU or memory gets victims whose pods
give that room back, and moved victims need room for their pods too. A plan that needs more
evictions than the budget has left this minute is not carried out. Carrying one out: first the freed
devices are reserved for the pending claim in the pools' ledgers (the fence: a replica whose view
is stale fails that write, and no eviction follows), then each victim's pods are evicted through
the Eviction API. A PodDisruptionBudget that refuses an eviction fails the plan: its reservation
is dropped, the claim is spared for a while and the next plan is tried; when every plan is refused,
nothing is evicted. Unlike kube-scheduler, preemption never goes past a budget (tenants are
adversaries: a PriorityClass one may use is no licence to disrupt another's pods beyond what its
budget allows), and it takes pods of the pending claim's own namespace only, unless
`preempt_across_namespaces` (--preempt-across-namespaces). Movable pods consented to be moved:
they are taken from any namespace. The planning spends the unit's search budget, from its
namespace's share of the pass (search_shares.py).

A pod moved (evicted) by fgpu is made again by its controller as a new pod with a new claim, which
the pass places where it fits; the room its plan counted on for it is not held (its claim does not
exist yet), so an arrival may take it first. Within MOVED_S of a move, the moved pod's controller
(its ReplicaSet, Job...) gets no room made by moving others, and none of its pods is moved to make
room for another: the new pod fits where it fits or waits for a node like any other. Without this,
each moved pod made room for itself by moving another, a chain the eviction budget alone ended.
Compaction may move it again once it runs (victims.py): nothing waits for that room. The minute is
this replica's: a new leader does not know it, and at worst makes room once for such a pod.

A reservation is counted by every pass as held (so nothing else is placed on the devices while
the evicted pods terminate), set aside when its own claim is placed, and dropped once the claim is
gone or allocated, or when it expires (writes.py, resolve_undecided)."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from driver.allocator.allocate import SearchBudget
from driver.allocator.cluster import ClusterAllocator
from driver.allocator.empty_nodes import emptying_nodes
from driver.allocator.make_room import COMPACTION_MOVES, Plan, compaction, make_room
from driver.allocator.model import ObjectError, claim_from_object
from driver.controller import metrics
from driver.controller.emptying import NodeEmptier
from driver.controller.ledger import RESERVED_KEY, PoolId, entries_for, entries_of, entry_results, pool_of
from driver.controller.pass_context import Pass
from driver.controller.refusals import pods_by_claim
from driver.controller.replica import Replica
from driver.controller.reporter import Reporter
from driver.controller.victims import Candidate, EvictionBudget, candidates, may_preempt, owners, priority
from driver.kube.errors import KubeError
from driver.kube.informer import object_key
from driver.scheduling.nodefit import NodeRoom

log = logging.getLogger(__name__)
RESERVED_S = 300.0  # how long freed devices wait for their claim: its pod is placed within a pass
SPARED_S = 15.0  # how long a claim whose eviction a budget refused is left out of plans
MOVED_S = 60.0  # how long a moved pod's controller neither has room made by moves nor is moved for another


class RoomMaker:
    """Makes room for the units a pass could not place, and compacts while nothing waits; keeps
    the claims whose eviction a budget refused out of plans a while. `room`: what the nodes have
    left for the pods (fit.py), as of the moment it is called."""

    def __init__(
        self,
        replica: Replica,
        budget: EvictionBudget | None,
        reporter: Reporter,
        room: Callable[[], NodeRoom],
        preempt_across_namespaces: bool = False,
        emptier: NodeEmptier | None = None,
    ) -> None:
        """`budget`: None turns making room off. `emptier`: compaction empties whole nodes first."""
        self._replica, self._budget, self._reporter, self._room = replica, budget, reporter, room
        self._across, self._emptier = preempt_across_namespaces, emptier
        self._api, self._informers, self._ledgers = replica.api, replica.informers, replica.ledgers
        self._spared: dict[str, float] = {}  # claim uid -> until (time.monotonic()): an eviction was refused
        self._moved: dict[str, float] = {}  # owner uid -> until (time.monotonic()): one of its pods was evicted

    def reservations(self) -> dict[str, list[dict[str, Any]]]:
        """Claim uid -> the device results reserved for it in the ledgers (as of this pass)."""
        held: dict[str, list[dict[str, Any]]] = {}
        for ledger in self._ledgers.objects():
            if any(RESERVED_KEY in text for text in (ledger.get("data") or {}).values()):  # most have none
                for uid, entry in entries_of(ledger).items():
                    if entry.reservation:
                        held.setdefault(uid, []).extend(entry_results(pool_of(ledger), entry))
        return held

    # --- planning and carrying out --------------------------------------------------------------

    def make_room(self, current: Pass) -> None:
        """For each unit that fit nowhere this pass, in order: the cheapest plan that can be
        carried out now."""
        if self._budget is None or not current.unplaced:
            return
        now = time.monotonic()
        self._spared, self._moved = _unexpired(self._spared, now), _unexpired(self._moved, now)
        pods_of = pods_by_claim(self._informers["pods"].items())
        room = self._room()
        for objects in current.unplaced:
            if self._replica.stopped():
                return
            if any(o["metadata"].get("uid") in current.reserved for o in objects):
                continue  # room is being made: its victims are on their way out
            search = current.shares.budget(objects[0]["metadata"]["namespace"])
            if search is None:
                continue  # its namespace searched as long as a pass allows: the next pass plans
            self._replica.progress.beat()
            self._make_room_for(current.allocator, objects, pods_of, room, search)

    def _make_room_for(
        self,
        allocator: ClusterAllocator,
        objects: list[dict[str, Any]],
        pods_of: dict[str, list[dict[str, Any]]],
        room: NodeRoom,
        search: SearchBudget,
    ) -> None:
        try:
            claims = [claim_from_object(o) for o in objects]
        except ObjectError:
            return
        pending_pods = [p for o in objects for p in pods_of.get(object_key(o), [])]
        if not pending_pods:
            return  # nothing would run on the room made
        moved = set(self._moved)  # moves of this pass included
        if owners(pending_pods) & moved:
            return  # a moved pod made again: it goes where it fits, or waits for a node
        rank = max(priority(p) for p in pending_pods)
        claim_objects = self._informers["claims"].items()
        within = None if self._across else objects[0]["metadata"]["namespace"]
        for preempt in (False, True):
            if preempt and not may_preempt(pending_pods):
                return
            found = candidates(claim_objects, pods_of, rank, preempt, set(self._spared), within=within,
                               owners_kept=owners(pending_pods) | moved)  # fmt: skip
            by_holder = {id(c.holder): c for c in found}
            holders = [c.holder for c in found]
            # The room is the planner's to read: a plan's pending pods run where it places them,
            # on room its victims' pods give back if need be, and moved victims' pods fit too.
            plans = [
                plan
                for plan in make_room(allocator, claims, holders, move=not preempt, budget=search, room=room)
                if plan.victims
            ]
            if search.exhausted:
                self._tell(objects, f"no room made: {search.reason(claims)}", warning=True)
                return
            if plans:
                self._carry_out(plans, objects, by_holder)
                return

    def _carry_out(self, plans: list[Plan], objects: list[dict[str, Any]], by_holder: dict[int, Candidate]) -> None:
        """The first plan whose evictions all go; a refused one is undone as far as it can be.
        Never past a disruption budget: when every plan is refused, nothing more is evicted."""
        assert self._budget is not None
        for plan in plans:
            victims = [by_holder[id(v)] for v in plan.victims]
            if any(v.holder.claim.uid in self._spared for v in victims):
                continue
            pods = [p for v in victims for p in v.pods]
            if len(pods) > self._budget.left(time.monotonic()):
                self._tell(objects, f"room can be made by evicting {len(pods)} pod(s); waiting for the eviction budget")
                return
            if not self._reserve(plan, objects):
                return
            if self._evict(victims, plan, objects) is None:
                return
            self._unreserve(self._reserved_by(plan, objects))
            if self._replica.stale.is_set():
                return

    def _reserve(self, plan: Plan, objects: list[dict[str, Any]]) -> bool:
        """Hold the plan's devices for its claims in the ledgers; all or none."""
        until = time.time() + RESERVED_S
        by_key = {object_key(o): o for o in objects}
        written: list[tuple[PoolId, str]] = []
        for placement in plan.placements:
            obj = by_key[placement.claim.key]
            uid = obj["metadata"]["uid"]
            for pool, entry in entries_for(obj, placement.allocation, until).items():
                if not (self._replica.acting() and self._ledgers.change(pool, add={uid: entry})):
                    self._unreserve(written)
                    return False
                written.append((pool, uid))
        return True

    def _unreserve(self, reserved: list[tuple[PoolId, str]]) -> None:
        for pool, uid in reserved:
            if self._replica.acting():
                self._ledgers.change(pool, remove=[uid])

    def _reserved_by(self, plan: Plan, objects: list[dict[str, Any]]) -> list[tuple[PoolId, str]]:
        by_key = {object_key(o): o for o in objects}
        return [
            (pool, by_key[p.claim.key]["metadata"]["uid"])
            for p in plan.placements
            for pool in entries_for(by_key[p.claim.key], p.allocation)
        ]

    def _evict(self, victims: list[Candidate], plan: Plan, objects: list[dict[str, Any]]) -> str | None:
        """Evict every victim's pods: None when all went; the refusal otherwise ("" when the
        API server failed rather than a budget refusing)."""
        names = ", ".join(object_key(p) for v in victims for p in v.pods)
        target = ", ".join(sorted({p.node for p in plan.placements}))
        for victim in victims:
            reason = "Preempted" if victim.preempted else "EvictedToMakeRoom"
            for pod in victim.pods:
                refused = self._evict_pod(victim, pod)
                if refused:
                    self._tell(objects, f"eviction of pod {object_key(pod)} refused: {refused}", warning=True)
                if refused is not None:
                    return refused
                metrics.EVICTIONS.labels("preemption" if victim.preempted else "movable").inc()
                why = "has a lower priority" if victim.preempted else "is movable"
                message = f"evicted by fgpu to make room for claim(s) {_keys(objects)} on {target} (the pod {why})"
                self._reporter.event("v1", "Pod", pod, reason, message, True)
        self._tell(objects, f"making room on {target}: evicted pod(s) {names}; devices reserved for the claim")
        return None

    def _evict_pod(self, victim: Candidate, pod: dict[str, Any]) -> str | None:
        """Evict one of a victim's pods: None when it goes (the budget spent), else why not: a
        budget's refusal (the victim's claim is then spared a while; nothing was disrupted, so the
        budget is not spent), or "" when the API server failed."""
        assert self._budget is not None
        meta = pod["metadata"]
        try:
            refused = self._api.evict_pod(meta["namespace"], meta["name"])
        except KubeError as error:
            log.warning("cannot evict pod %s: %s", object_key(pod), error)
            return ""
        if refused is not None:
            self._spared[victim.holder.claim.uid] = time.monotonic() + SPARED_S
            metrics.EVICTIONS.labels("refused").inc()
            return refused or "refused by a disruption budget"
        now = time.monotonic()
        self._budget.spend(now)
        self._moved.update(dict.fromkeys(owners([pod]), now + MOVED_S))
        return None

    def compact(self, allocator: ClusterAllocator) -> None:
        """Nothing waits: with an emptier, first empty whole nodes onto nodes that stay in use
        (emptying.py; the planner's `emptying_nodes`), for the autoscaler to remove; then, when no
        node was emptied, move movable pods off lightly used GPUs into holes on GPUs in use, so
        that whole GPUs are free for the next large claim (the planner's `compaction`). Both within
        the eviction budget. The moved pods' new claims are placed as any other (no reservation):
        a pass after the moves waits until nothing waits again."""
        assert self._budget is not None
        left = self._budget.left(time.monotonic())
        if left < 1:
            return
        pods_of = pods_by_claim(self._informers["pods"].items())
        claims = self._informers["claims"].items()
        found = candidates(claims, pods_of, sys.maxsize, False, set(self._spared), held_too=True)
        by_holder = {id(c.holder): c for c in found}
        if self._emptier is not None and self._empty_nodes(allocator, found, by_holder, left):
            return  # the allocator's state is as before those moves: GPUs are compacted on the next
        for move in compaction(allocator, [c.holder for c in found], min(left, COMPACTION_MOVES)):
            message = f"evicted by fgpu to compact: its GPU empties, and the pod fits on {move.to.node}"
            if not self._move(by_holder[id(move.holder)], "compaction", "Compacted", message):
                return

    def _empty_nodes(
        self, allocator: ClusterAllocator, found: list[Candidate], by_holder: dict[int, Candidate], left: int
    ) -> bool:
        """Empty the nodes that may be (each tainted first); whether any was begun."""
        assert self._emptier is not None
        movable = {p["metadata"].get("uid") for c in found if c.holder.movable for p in c.pods}
        may_empty = self._emptier.may_empty(self._informers["pods"].items(), movable)
        if not may_empty:
            return False
        begun = False
        for plan in emptying_nodes(allocator, [c.holder for c in found], may_empty, left):
            if not self._emptier.taint(plan.node):
                continue
            begun = True
            for move in plan.moves:
                to = move.to.node
                message = f"evicted by fgpu to empty node {plan.node} for the autoscaler: the pod fits on {to}"
                if not self._move(by_holder[id(move.holder)], "emptying", "EmptyingNode", message):
                    return True  # refused: the node stays tainted until the taint expires or something waits
        return begun

    def _move(self, victim: Candidate, reason: str, event: str, message: str) -> bool:
        """Evict a movable victim's pods, telling each; whether all went."""
        for pod in victim.pods:
            if self._evict_pod(victim, pod) is not None:
                return False
            metrics.EVICTIONS.labels(reason).inc()
            self._reporter.event("v1", "Pod", pod, event, message, False)
        return True

    def _tell(self, objects: list[dict[str, Any]], message: str, warning: bool = False) -> None:
        for obj in objects:
            self._reporter.report(obj, message, warning, why="MakingRoom")


def _unexpired(until_by_key: dict[str, float], now: float) -> dict[str, float]:
    return {key: until for key, until in until_by_key.items() if until > now}


def _keys(objects: list[dict[str, Any]]) -> str:
    return ", ".join(object_key(o) for o in objects)
