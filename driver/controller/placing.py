"""Placing: the waiting claims, one unit (a claim, or a whole gang) at a time, handed to the writers.

A pass computes placements one unit at a time and hands each to a pool of writers (writes.py), so
writes overlap with the search and with each other (at most MAX_IN_FLIGHT units, controller.py).
Lone claims go first, in creation order, then gangs, all or none once every member exists: our
labelled gangs (driver/scheduling/opt_in.py), then PodGroups with a gang policy (groups.py). A claim that cannot be
placed gets an Event (gates.py) and waits for the next pass."""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from driver.allocator.cluster import ClusterAllocator, Failure, Placement
from driver.allocator.model import Claim, ObjectError, claim_from_object
from driver.controller import metrics
from driver.controller.fit import claim_pods, node_room
from driver.controller.groups import Groups
from driver.controller.informer import Informer, object_key
from driver.controller.refusals import pods_by_claim, released
from driver.scheduling.nodefit import NodeRoom
from driver.scheduling.opt_in import GANG_LABEL, GANG_SIZE_LABEL, gang_label, gang_of, pending

log = logging.getLogger(__name__)
ABSORB_S = 2.0  # how long a pass goes on placing lone claims that arrive while its writes are out


@dataclass
class Unit:
    """Claims written together: one claim, or the waiting members of a gang (all or none)."""

    placements: list[Placement]
    objects: dict[str, dict[str, Any]]  # claim key -> the object its placement was computed on
    # Gang members allocated earlier (by an interrupted pass) that this unit completes: their
    # resourceVersion is moved first, so that a take-back decided on them elsewhere fails.
    kept: list[dict[str, Any]] = field(default_factory=list)


class Placing:
    """The Controller's placing (controller.py builds the state named here). Uses its acting(),
    _waiting() and _count() (controller.py), _write_unit() and _take_back() (writes.py),
    _report() and _report_group() (gates.py), _set_aside() (making_room.py); the units that fit
    nowhere go to `_unplaced`, for making_room.py."""

    informers: dict[str, Informer]
    stale: threading.Event
    _writers: ThreadPoolExecutor
    _refused: dict[str, set[str]]
    _unplaced: list[list[dict[str, Any]]]

    def _allocate(self, allocator: ClusterAllocator, waiting: list[dict[str, Any]]) -> None:
        """Place and hand out the waiting claims; while their writes are out (up to ABSORB_S), lone
        claims that arrive are placed too, on the same allocator and ledger versions, instead of
        waiting for the next pass. Gang members that arrive wait for it."""
        started = time.perf_counter()
        handled = {object_key(c) for c in waiting}
        room = self._room()
        in_flight = self._submit(allocator, waiting, room)
        version = self.informers["claims"].version
        while time.perf_counter() - started < ABSORB_S and not self.stale.is_set() and self.acting():
            if not wait(in_flight, timeout=0.02, return_when=FIRST_COMPLETED).not_done:
                break
            if self.informers["claims"].version == version:
                continue
            version = self.informers["claims"].version
            arrived = [c for c in self._waiting() if object_key(c) not in handled and not gang_label(c)]
            if arrived:  # a PodGroup's members wait for the next pass too
                groups = self._groups()
                arrived = [c for c in arrived if groups.of_claim(c) is None]
            if not arrived:
                continue
            handled.update(object_key(c) for c in arrived)
            # The pods that came with the claims; what this pass took of the nodes stays.
            room.pods_of = claim_pods(self.informers["pods"].items(), self.informers["claims"].items())
            in_flight += self._submit(allocator, arrived, room)
        wait(in_flight)
        log.debug("pass: %d claims placed and written in %.3f s", len(handled), time.perf_counter() - started)
        for future in in_flight:
            if future.exception() is not None:
                log.error("writing a unit failed", exc_info=future.exception())
                self.stale.set()

    def _submit(self, allocator: ClusterAllocator, waiting: list[dict[str, Any]], room: NodeRoom) -> list[Future[None]]:
        return [self._writers.submit(self._write_unit, unit) for unit in self._units(allocator, waiting, room)]

    def _room(self) -> NodeRoom:
        """What the nodes have left for the pods of the claims this pass places (fit.py)."""
        return node_room(
            self.informers["nodes"].items(),
            self.informers["pods"].items(),
            self.informers["claims"].items(),
            self._refused,
        )

    def _groups(self) -> Groups:
        """The PodGroups with a gang policy, their pods and claims, as the caches have them now."""
        claims = self.informers["claims"]
        return Groups(self.informers["podgroups"].items(), self.informers["pods"].items(), claims.get)

    def _units(self, allocator: ClusterAllocator, waiting: list[dict[str, Any]], room: NodeRoom) -> Iterator[Unit]:
        """Placements, one unit at a time (lone claims first, in creation order, then gangs); stops
        as soon as a write has failed or this replica no longer leads."""
        gangs: dict[tuple[str, int], list[Claim]] = defaultdict(list)
        groups = self._groups()
        grouped: dict[str, list[Claim]] = defaultdict(list)
        for obj in waiting:
            if self.stale.is_set() or not self.acting():
                return
            try:
                claim = claim_from_object(obj)
            except ObjectError as error:
                self._report(obj, f"cannot read the claim: {error}")
                continue
            gang = gang_of(claim)
            if gang is not None:
                gangs[gang].append(claim)
            elif (group := groups.of_claim(obj)) is not None:
                grouped[group].append(claim)
            elif (placement := self._place_one(allocator, claim, obj, room)) is not None:
                yield Unit([placement], {claim.key: obj})
        for (name, size), members in gangs.items():
            if self.stale.is_set() or not self.acting():
                return
            if (unit := self._place_gang(allocator, name, size, members, room)) is not None:
                yield unit
        for group, members in grouped.items():
            if self.stale.is_set() or not self.acting():
                return
            if (unit := self._place_group(allocator, groups, group, members, room)) is not None:
                yield unit

    def _place_one(
        self, allocator: ClusterAllocator, claim: Claim, obj: dict[str, Any], room: NodeRoom
    ) -> Placement | None:
        started = time.perf_counter()
        aside = self._set_aside(allocator, [obj])
        outcome = allocator.allocate(claim, room=room)
        metrics.ALLOCATION_SECONDS.observe(time.perf_counter() - started)
        if isinstance(outcome, Failure):
            aside.put_back()
            metrics.ALLOCATIONS.labels("unschedulable").inc()
            self._report(obj, outcome.reason)
            self._unplaced.append([obj])
            return None
        allocator.commit(outcome)
        room.take(outcome)
        self._count([(obj, outcome)])
        return outcome

    def _place_gang(
        self, allocator: ClusterAllocator, name: str, size: int, members: list[Claim], room: NodeRoom
    ) -> Unit | None:
        objects = {c.key: self.informers["claims"].get(c.key) for c in members}
        if size == 0:
            for obj in objects.values():
                self._report(obj, f"label {GANG_SIZE_LABEL} must be a whole number")
            return None
        present = {key: obj for key, obj in objects.items() if obj is not None}
        if len(present) < len(objects):
            return None  # deleted since the pass began
        allocated = [c for c in self._gang_claims(name) if not pending(c)]
        if len(members) + len(allocated) < size:
            missing = size - len(members) - len(allocated)
            for obj in objects.values():
                self._report(obj, f"gang {name} waits for {missing} more claim(s) of {size}", warning=False)
            return None
        aside = self._set_aside(allocator, list(present.values()))
        outcome = allocator.allocate_gang(members, room)
        if isinstance(outcome, Failure):
            aside.put_back()
            metrics.GANGS.labels("unschedulable").inc()
            for obj in present.values():
                self._report(obj, outcome.reason)
            if not allocated:
                self._unplaced.append(list(present.values()))
            if allocated and len(allocated) < size and not self._any_released(allocated):
                # Members left allocated by an interrupted pass: all or none, so give them back.
                # Not once their pods are let go: a member kube-scheduler gave back (refusals.py)
                # leaves the rest running or binding, and only its own claim to place again.
                self._take_back(allocated)
            return None
        self._count((present[p.claim.key], p) for p in outcome)
        return Unit(outcome, present, kept=allocated)

    def _place_group(
        self, allocator: ClusterAllocator, groups: Groups, group: str, members: list[Claim], room: NodeRoom
    ) -> Unit | None:
        """A PodGroup's gang (groups.py): the opt-in claims of its members (pods with every claim
        made), all or none, once minCount members exist; nothing placed before."""
        state, podgroup = groups.state(group), groups.podgroup(group)
        objects = {c.key: self.informers["claims"].get(c.key) for c in members}
        if podgroup is None or state.present < state.size:
            if podgroup is None:
                absent = self.informers["podgroups"].absent
                reason = f"pod group {group} waits: no PodGroup {group} (scheduling.k8s.io/v1beta1) to read"
                reason += f": {absent}" if absent else ""
            else:
                reason = f"pod group {group} waits for {state.size - state.present} more pod(s) of {state.size}"
            self._report_group(podgroup, objects.values(), reason, warning=False)
            return None
        placing = [c for c in members if c.key in state.pending]
        present = {c.key: obj for c in placing if (obj := objects[c.key]) is not None}
        if not placing or len(present) < len(state.pending):
            return None  # a claim was deleted since, or cannot be read (reported): none then
        aside = self._set_aside(allocator, list(present.values()))
        outcome = allocator.allocate_gang(placing, room)
        if isinstance(outcome, Failure):
            aside.put_back()
            metrics.GANGS.labels("unschedulable").inc()
            reason = f"pod group {group} (gang of {state.size} pods): {outcome.reason}"
            self._report_group(podgroup, present.values(), reason)
            if not state.allocated:
                self._unplaced.append(list(present.values()))
            if state.allocated and not state.whole and not state.released:
                # Members left allocated by an interrupted pass, none let go: all or none.
                self._take_back(state.allocated)
            return None
        self._count((present[p.claim.key], p) for p in outcome)
        # Members written earlier are fenced first (writes.py) while the group's pods wait for them.
        return Unit(outcome, present, kept=[] if state.released else state.allocated)

    def _any_released(self, claims: list[dict[str, Any]]) -> bool:
        pods_of = pods_by_claim(self.informers["pods"].items())
        return any(released(pods_of.get(object_key(c), [])) for c in claims)

    def _gang_claims(self, gang: str) -> list[dict[str, Any]]:
        namespace, name = gang.split("/", 1)
        return [
            c
            for c in self.informers["claims"].items()
            if c["metadata"].get("namespace") == namespace
            and (c["metadata"].get("labels") or {}).get(GANG_LABEL) == name
        ]
