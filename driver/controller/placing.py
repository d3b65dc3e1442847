"""Placing: the waiting claims, one unit (a claim, or a whole gang) at a time, handed to the writers.

A pass computes placements one unit at a time and hands each to a pool of writers (writes.py), so
writes overlap with the search and with each other (at most MAX_IN_FLIGHT units, controller.py).
Lone claims go first, in creation order, then gangs, all or none once every member exists: our
labelled gangs (driver/scheduling/opt_in.py), then PodGroups with a gang policy (groups.py), in the
order driver/scheduling/units.py gives. A claim that cannot be placed gets an Event (reporter.py)
and waits for the next pass; the units that fit nowhere are left in the pass for making_room.py.
Each unit searches within a budget from its namespace's share of the pass (search_shares.py): a
unit whose search ran out fails (no room is made for it: its search did not finish), and the
units of a namespace whose share is spent wait for the next pass."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from driver.allocator.allocate import SearchBudget
from driver.allocator.cluster import Failure, Placement
from driver.allocator.model import Claim, ObjectError, claim_from_object
from driver.controller import metrics
from driver.controller.allocators import AllocatorCache
from driver.controller.groups import Groups
from driver.controller.pass_context import Pass
from driver.controller.refusals import pods_by_claim, released
from driver.controller.replica import Replica
from driver.controller.reporter import Reporter
from driver.controller.search_shares import share_spent
from driver.controller.writes import ClaimWriter, Unit
from driver.kube.informer import object_key
from driver.scheduling.nodefit import NodeRoom
from driver.scheduling.opt_in import GANG_LABEL, gang_label, pending
from driver.scheduling.units import (
    Gang,
    Group,
    Lone,
    gang_incomplete,
    group_absent,
    group_incomplete,
    group_size_unreadable,
    group_unplaced,
    size_unreadable,
    units,
)

log = logging.getLogger(__name__)
ABSORB_S = 2.0  # how long a pass goes on placing lone claims that arrive while its writes are out
Waiting = tuple[dict[str, Any], Claim]  # a waiting claim: its object, and the claim read from it


class Placer:
    """Places a pass's waiting claims on its allocator and hands each unit to `writer`. `room`:
    what the nodes have left for the pods (fit.py), as of the moment it is called."""

    def __init__(
        self,
        replica: Replica,
        allocators: AllocatorCache,
        writer: ClaimWriter,
        reporter: Reporter,
        room: Callable[[], NodeRoom],
    ) -> None:
        self._replica, self._allocators, self._writer, self._reporter = replica, allocators, writer, reporter
        self._room = room
        self._informers = replica.informers

    def place(self, current: Pass, waiting: list[dict[str, Any]]) -> None:
        """Place and hand out the waiting claims; while their writes are out (up to ABSORB_S), lone
        claims that arrive are placed too, on the same allocator and ledger versions, instead of
        waiting for the next pass. Gang members that arrive wait for it."""
        started = time.perf_counter()
        handled = {object_key(c) for c in waiting}
        room = self._room()
        in_flight = self._submit(current, waiting, room)
        version = self._informers["claims"].version
        while time.perf_counter() - started < ABSORB_S and not self._replica.stale.is_set() and self._replica.acting():
            if not wait(in_flight, timeout=0.02, return_when=FIRST_COMPLETED).not_done:
                break
            if self._informers["claims"].version == version:
                continue
            version = self._informers["claims"].version
            arrived = [c for c in self._replica.waiting() if object_key(c) not in handled and not gang_label(c)]
            if arrived:  # a PodGroup's members wait for the next pass too
                groups = self._replica.groups()
                arrived = [c for c in arrived if groups.of_claim(c) is None]
            if not arrived:
                continue
            handled.update(object_key(c) for c in arrived)
            # The pods that came with the claims; what this pass took of the nodes stays.
            room.pods_of = self._replica.rooms.claim_pods(
                self._informers["pods"].items(), self._informers["claims"].items()
            )
            in_flight += self._submit(current, arrived, room)
        wait(in_flight)
        log.debug("pass: %d claims placed and written in %.3f s", len(handled), time.perf_counter() - started)
        for future in in_flight:
            if future.exception() is not None:
                log.error("writing a unit failed", exc_info=future.exception())
                self._replica.stale.set()

    def _submit(self, current: Pass, waiting: list[dict[str, Any]], room: NodeRoom) -> list[Future[None]]:
        writers = self._replica.writers
        return [writers.submit(self._writer.write_unit, unit) for unit in self._units(current, waiting, room)]

    def _units(self, current: Pass, waiting: list[dict[str, Any]], room: NodeRoom) -> Iterator[Unit]:
        """Placements, one unit at a time (lone claims first, in creation order, then gangs); stops
        as soon as a write has failed or this replica no longer leads."""
        groups = self._replica.groups()
        for unit in units(self._readable(waiting), _claim_of, lambda item: groups.of_claim(item[0])):
            self._replica.progress.beat()
            if isinstance(unit, Lone):
                obj, claim = unit.member
                if (placement := self._place_one(current, claim, obj, room)) is not None:
                    yield Unit([placement], {claim.key: obj})
                continue
            if self._replica.stopped():
                return
            if isinstance(unit, Gang):
                placed = self._place_gang(current, unit, room)
            else:
                placed = self._place_group(current, groups, unit, room)
            if placed is not None:
                yield placed

    def _readable(self, waiting: list[dict[str, Any]]) -> Iterator[Waiting]:
        """The waiting claims read, one by one as they are asked for (those that cannot be read
        reported); ends as soon as a write has failed or this replica no longer leads."""
        for obj in waiting:
            if self._replica.stopped():
                return
            try:
                yield obj, claim_from_object(obj)
            except ObjectError as error:
                self._reporter.report(obj, f"cannot read the claim: {error}")

    def _budget(self, current: Pass, objects: list[dict[str, Any]]) -> SearchBudget | None:
        """A unit's search budget, or None (said on its claims) when its namespace has spent its
        share of the pass."""
        namespace = objects[0]["metadata"]["namespace"]
        budget = current.shares.budget(namespace)
        if budget is None:
            for obj in objects:
                self._reporter.report(obj, share_spent(namespace), warning=False, why="SearchShareSpent")
        return budget

    def _place_one(self, current: Pass, claim: Claim, obj: dict[str, Any], room: NodeRoom) -> Placement | None:
        if (budget := self._budget(current, [obj])) is None:
            return None
        started = time.perf_counter()
        allocator = current.allocator
        aside = self._allocators.set_aside(allocator, [obj], current.reserved)
        outcome = allocator.allocate(claim, room=room, budget=budget)
        metrics.ALLOCATION_SECONDS.observe(time.perf_counter() - started)
        if isinstance(outcome, Failure):
            aside.put_back()
            metrics.ALLOCATIONS.labels(_failed(budget)).inc()
            self._reporter.report(obj, outcome.reason)
            if not budget.exhausted:
                current.unplaced.append([obj])
            return None
        allocator.commit(outcome)
        room.take(outcome)
        self._allocators.count([(obj, outcome)])
        return outcome

    def _place_gang(self, current: Pass, gang: Gang[Waiting], room: NodeRoom) -> Unit | None:
        members = [claim for _, claim in gang.members]
        objects = {c.key: self._informers["claims"].get(c.key) for c in members}
        if (unreadable := size_unreadable(gang)) is not None:
            for obj in objects.values():
                self._reporter.report(obj, unreadable)
            return None
        present = {key: obj for key, obj in objects.items() if obj is not None}
        if len(present) < len(objects):
            return None  # deleted since the pass began
        allocated = [c for c in self._gang_claims(gang.name) if not pending(c)]
        if (incomplete := gang_incomplete(gang, len(allocated))) is not None:
            for obj in objects.values():
                self._reporter.report(obj, incomplete, warning=False)
            return None
        if (budget := self._budget(current, list(present.values()))) is None:
            return None
        aside = self._allocators.set_aside(current.allocator, list(present.values()), current.reserved)
        outcome = current.allocator.allocate_gang(members, room, budget)
        if isinstance(outcome, Failure):
            aside.put_back()
            metrics.GANGS.labels(_failed(budget)).inc()
            for obj in present.values():
                self._reporter.report(obj, outcome.reason)
            if not allocated and not budget.exhausted:
                current.unplaced.append(list(present.values()))
            if allocated and len(allocated) < gang.size and not self._any_released(allocated):
                # Members left allocated by an interrupted pass: all or none, so give them back.
                # Not once their pods are let go: a member kube-scheduler gave back (refusals.py)
                # leaves the rest running or binding, and only its own claim to place again.
                self._writer.take_back(allocated)
            return None
        self._allocators.count((present[p.claim.key], p) for p in outcome)
        return Unit(outcome, present, kept=allocated)

    def _place_group(self, current: Pass, groups: Groups, group: Group[Waiting], room: NodeRoom) -> Unit | None:
        """A PodGroup's gang, or an operator's (groups.py): the opt-in claims of its members (pods
        with every claim made), all or none, once minCount members exist; nothing placed before."""
        members = [claim for _, claim in group.members]
        state, podgroup = groups.state(group.name), groups.podgroup(group.name)
        objects = {c.key: self._informers["claims"].get(c.key) for c in members}
        if not groups.exists(group.name) or state.size == 0 or state.present < state.size:
            if not groups.exists(group.name):
                reason = group_absent(group.name, self._informers["podgroups"].absent)
            elif state.size == 0:  # an operator's pods whose gang size cannot be read
                reason = group_size_unreadable(group.name)
            else:
                reason = group_incomplete(group.name, state.present, state.size)
            self._reporter.report_group(podgroup, objects.values(), reason, warning=False)
            return None
        placing = [c for c in members if c.key in state.pending]
        present = {c.key: obj for c in placing if (obj := objects[c.key]) is not None}
        if not placing or len(present) < len(state.pending):
            return None  # a claim was deleted since, or cannot be read (reported): none then
        if (budget := self._budget(current, list(present.values()))) is None:
            return None
        aside = self._allocators.set_aside(current.allocator, list(present.values()), current.reserved)
        outcome = current.allocator.allocate_gang(placing, room, budget)
        if isinstance(outcome, Failure):
            aside.put_back()
            metrics.GANGS.labels(_failed(budget)).inc()
            self._reporter.report_group(
                podgroup, present.values(), group_unplaced(group.name, state.size, outcome.reason)
            )
            if not state.allocated and not budget.exhausted:
                current.unplaced.append(list(present.values()))
            if state.allocated and not state.whole and not state.released:
                # Members left allocated by an interrupted pass, none let go: all or none.
                self._writer.take_back(state.allocated)
            return None
        self._allocators.count((present[p.claim.key], p) for p in outcome)
        # Members written earlier are fenced first (writes.py) while the group's pods wait for them.
        return Unit(outcome, present, kept=[] if state.released else state.allocated)

    def _any_released(self, claims: list[dict[str, Any]]) -> bool:
        pods_of = pods_by_claim(self._informers["pods"].items())
        return any(released(pods_of.get(object_key(c), [])) for c in claims)

    def _gang_claims(self, gang: str) -> list[dict[str, Any]]:
        namespace, name = gang.split("/", 1)
        return [
            c
            for c in self._informers["claims"].items()
            if c["metadata"].get("namespace") == namespace
            and (c["metadata"].get("labels") or {}).get(GANG_LABEL) == name
        ]


def _claim_of(item: Waiting) -> Claim:
    return item[1]


def _failed(budget: SearchBudget) -> str:
    """A failed unit's metrics label: its search ran out, or it fits nowhere."""
    return "search-budget" if budget.exhausted else "unschedulable"
