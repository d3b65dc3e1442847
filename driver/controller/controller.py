"""The controller loop: informer caches in, allocations and lifted scheduling gates out.

Claims opt in with a label and their pods wait behind a scheduling gate (driver/scheduling/opt_in.py). A pass, run
whenever a cache changes and this replica leads, places the waiting claims (placing.py), writes
each unit ledger first, then status (writes.py), and lifts the gates of pods whose claims are all
allocated (gates.py). The caches, the snapshot of the pools and the allocator are kept here from
pass to pass and told only what changed; a standby keeps them current too, so that it places
claims at once when it wins the lease. A write that fails ends the pass: the claims and ledgers are
read afresh from the API server before anything else is allocated."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from driver.allocator.cluster import ClusterAllocator, Placement, Snapshot
from driver.allocator.model import ObjectError, Slice, class_from_object, slice_from_object
from driver.allocator.pools import Node
from driver.allocator.scoring import DEFAULT_POLICY, Policy
from driver.allocator.state import AllocatedState
from driver.controller import metrics
from driver.controller.gates import Gates
from driver.controller.informer import Informer
from driver.controller.leader import LeaderElector, LeaseTimings
from driver.controller.ledger import LEDGER_LABEL, Ledgers, ResultKey, allocated_results, results_of
from driver.controller.making_room import MakingRoom
from driver.controller.placing import Placing
from driver.controller.refusals import Refusal, Refusals
from driver.controller.victims import EvictionBudget
from driver.controller.writes import Writes
from driver.kube.client import KubeError
from driver.scheduling.opt_in import gated, pending

log = logging.getLogger(__name__)
MAX_IN_FLIGHT = 16  # units being written at once: enough to hide the API server's latency


@dataclass
class Counted:
    """The allocator kept between passes and the results its state counts."""

    allocator: ClusterAllocator
    key: tuple[int, int]  # the snapshot and the classes it was built on
    results: dict[ResultKey, dict[str, Any]]


class Controller(Placing, Writes, Gates, Refusals, MakingRoom):
    """One replica: its caches, its lease and the loop. Placing, writing, gates, noticing
    kube-scheduler's refusals and making room are its parts in placing.py, writes.py, gates.py,
    refusals.py and making_room.py; the state they share is made here."""

    def __init__(
        self,
        api: Any,
        identity: str,
        policy: Policy = DEFAULT_POLICY,
        lease_namespace: str = "kube-system",
        timings: LeaseTimings | None = None,
        evictions_per_minute: int = 0,
        compact: bool = False,
    ) -> None:
        """`evictions_per_minute`: making room (making_room.py) evicts at most that many pods a
        minute; 0 turns it off. `compact`: with it, also move pods while nothing waits."""
        self.api, self.policy, self.identity = api, policy, identity
        self.changed = threading.Event()
        self.informers = {kind: Informer(api, kind, self.changed) for kind in ("classes", "claims", "pods", "nodes")}
        self.informers["slices"] = Informer(api, "slices", self.changed, transform=_readable_slice, long_lived=True)
        # Upstream gangs (groups.py); a cluster without the GenericWorkload API has none.
        self.informers["podgroups"] = Informer(api, "podgroups", self.changed, optional=True)
        self.informers["ledgers"] = Informer(
            api, "ledgers", self.changed, f"{LEDGER_LABEL}=true", namespace=lease_namespace
        )
        self.leader = LeaderElector(
            api,
            lease_namespace,
            "fgpu-controller",
            identity,
            timings or LeaseTimings(),
            on_change=lambda leading: self.changed.set(),  # a new leader starts at once
        )
        self.stale = threading.Event()  # a write failed: end the pass, read afresh, then go on
        self.ledgers = Ledgers(api, lease_namespace, self.informers["ledgers"].update, self.stale.set)
        self._writers = ThreadPoolExecutor(MAX_IN_FLIGHT, thread_name_prefix="writer")
        self._snapshot: Snapshot | None = None
        self._counted: Counted | None = None
        self._pods_lock = threading.Lock()
        self._pods_of: tuple[int, dict[str, list[str]]] = (-1, {})
        self._sync_reported = False
        self._snapshot_nodes = -1  # hash of the nodes (and labels) the snapshot was gathered for
        self._snapshot_slices: tuple[int, dict[str, Slice]] = (-1, {})  # informer version, slices by name
        self._reported: dict[str, str] = {}  # claim uid -> last failure reported as an Event
        self._placed: dict[str, str] = {}  # refusals.py: claim uid -> node of the allocation written
        self._refused: dict[str, set[str]] = {}  # refusals.py: pod key -> nodes kube-scheduler refused
        self._unreported: dict[str, Refusal] = {}
        self.budget = EvictionBudget(evictions_per_minute) if evictions_per_minute > 0 else None
        self.compact = compact and self.budget is not None
        self._unplaced: list[list[dict[str, Any]]] = []  # making_room.py: units that fit nowhere this pass
        self._spared: dict[str, float] = {}  # making_room.py: claims whose eviction a budget refused
        self._reserved: dict[str, list[dict[str, Any]]] = {}  # making_room.py: this pass's reservations
        self.stop_event = threading.Event()

    # --- running ------------------------------------------------------------------------------

    def run(self) -> None:
        for informer in self.informers.values():
            informer.start()
        elector = threading.Thread(target=self.leader.run, args=(self.stop_event,), name="leader", daemon=True)
        elector.start()
        while not self.stop_event.is_set():
            self.changed.wait(timeout=5.0)
            self.stop_event.wait(0.05)  # let a burst of watch events land: one pass for all of them
            self.changed.clear()
            metrics.LEADER.set(self.leader.leading())
            if not self._synced():
                continue
            if not self.acting():
                self._keep_ready()
                continue
            try:
                self.run_pass()
            except KubeError as error:
                log.warning("pass ended early: %s", error)
                self.stop_event.wait(1.0)
                self.changed.set()
        self._writers.shutdown(wait=True)
        elector.join()
        self.leader.release()  # after the last write: the standby may start at once

    def _keep_ready(self) -> None:
        """A standby keeps its allocator current with its caches (reads only, no writes), so that
        when it wins the lease its first pass places claims at once, instead of first gathering the
        pools and counting every claim's allocation."""
        self.ledgers.begin(self.informers["ledgers"].items())
        self.allocator()

    def _synced(self) -> bool:
        """Whether every cache has been listed; the first time, says how long that took."""
        if not all(i.synced.is_set() for i in self.informers.values()):
            return False
        if not self._sync_reported:
            self._sync_reported = True
            seconds = max(i.sync_seconds or 0.0 for i in self.informers.values())
            metrics.CACHE_SYNC_SECONDS.set(seconds)
            log.info("caches synced in %.1f s (%d slices)", seconds, len(self.informers["slices"].items()))
        return True

    def stop(self) -> None:
        log.info("stopping")
        self.stop_event.set()
        self.changed.set()
        for informer in self.informers.values():
            informer.stop()

    def acting(self) -> bool:
        """Checked before every write: a replica that cannot renew its lease stops at once."""
        return self.leader.leading() and not self.stop_event.is_set()

    # --- one pass -----------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """Slices and nodes as the allocator sees them: gathered afresh only when a node's labels
        change (other node updates come often and matter not); a slice added, changed or deleted
        touches only its pool, for the nodes that see it (and the allocator's caches of those)."""
        nodes = sorted(
            (n["metadata"]["name"], tuple(sorted((n["metadata"].get("labels") or {}).items())))
            for n in self.informers["nodes"].items()
        )
        slices_version = self.informers["slices"].version
        if self._snapshot is None or hash(tuple(nodes)) != self._snapshot_nodes:
            slices = self.informers["slices"].items()
            self._snapshot = Snapshot.from_slices(slices, [Node(name, dict(labels)) for name, labels in nodes])
            self._snapshot_nodes = hash(tuple(nodes))
            self._snapshot_slices = (slices_version, {s.name: s for s in slices})
        elif slices_version != self._snapshot_slices[0]:
            before, now = self._snapshot_slices[1], {s.name: s for s in self.informers["slices"].items()}
            added = [s for name, s in now.items() if before.get(name) is not s]
            removed = [s for name, s in before.items() if now.get(name) is not s]
            counted = self._counted
            if counted is not None and counted.allocator.snapshot is self._snapshot:
                counted.allocator.update_slices(added, removed)
            else:
                self._snapshot.update(added, removed)
            self._snapshot_slices = (slices_version, now)
        return self._snapshot

    def allocator(self) -> ClusterAllocator:
        """Everything the claims hold and the ledgers record (as of the ledger versions the pass's
        writes are conditioned on). The allocator is kept from pass to pass and told only what
        changed, so its per-node caches survive for the nodes nothing touched."""
        snapshot = self.snapshot()
        results = allocated_results(self.informers["claims"].items(), self.ledgers.objects())
        key = (id(snapshot), self.informers["classes"].version)
        counted = self._counted
        if counted is None or counted.key != key:
            classes = {}
            for obj in self.informers["classes"].items():
                cls = class_from_object(obj)
                classes[cls.name] = cls
            state = AllocatedState()
            for result in results.values():
                state.add_result(result)
            self._counted = Counted(ClusterAllocator(snapshot, classes, state, self.policy), key, results)
            return self._counted.allocator
        gone = [counted.results[k] for k in counted.results.keys() - results.keys()]
        new = [results[k] for k in results.keys() - counted.results.keys()]
        counted.allocator.release("", {"devices": {"results": gone}})
        counted.allocator.add("", {"devices": {"results": new}})
        counted.results = results
        return counted.allocator

    def _count(self, placements: Iterable[tuple[dict[str, Any], Placement]]) -> None:
        """Placements just committed to the allocator: counted, so the next pass does not add them
        again when it finds them in the claims (or takes them out if they were never written)."""
        if self._counted is not None:
            for obj, placement in placements:
                self._counted.results.update(results_of(obj["metadata"].get("uid", ""), placement.allocation))

    def run_pass(self) -> None:
        self.stale.clear()
        self.ledgers.begin(self.informers["ledgers"].items())
        self._resolve_undecided()
        self._reserved = self._reservations()
        self._notice_refusals()
        allocator = self.allocator()  # also when nothing waits: ready for the next burst
        waiting = self._waiting()
        metrics.PENDING.set(len(waiting))
        self._unplaced = []
        if waiting and not self.stale.is_set():
            self._allocate(allocator, waiting)
        if self._unplaced and not self.stale.is_set():
            self._make_room(allocator)
        elif self.compact and not waiting and not self._reserved and not self._any_gated():
            self._compact(allocator)
        if self.stale.is_set():
            self.refresh()
            return
        self._lift_gates()

    def refresh(self) -> None:
        """A conflict means the world changed: read the claims (their allocations) and the ledgers
        from the API server before allocating anything else."""
        metrics.REFRESHES.inc()
        for kind in ("claims", "ledgers"):
            self.informers[kind].relist()
        self._counted = None
        self.stale.clear()
        self.changed.set()

    def _any_gated(self) -> bool:
        """A pod waits at our gate (its claim perhaps not made yet): the controller is not idle."""
        return any(gated(pod) for pod in self.informers["pods"].items())

    def _waiting(self) -> list[dict[str, Any]]:
        return sorted(
            (c for c in self.informers["claims"].items() if pending(c)),
            key=lambda c: (c["metadata"].get("creationTimestamp", ""), c["metadata"]["name"]),
        )


def _readable_slice(obj: dict[str, Any]) -> Slice | None:
    """What the slices' informer keeps: the parsed slice (the API object is dropped)."""
    try:
        return slice_from_object(obj)
    except ObjectError as error:
        log.warning("ignoring ResourceSlice: %s", error)
        return None
