"""The controller loop: informer caches in, allocations and lifted scheduling gates out.

Claims opt in with a label and their pods wait behind a scheduling gate (driver/scheduling/opt_in.py). A pass, run
whenever a cache changes and this replica leads, places the waiting claims (placing.py), writes
each unit ledger first, then status (writes.py), and lifts the gates of pods whose claims are all
allocated (gates.py); with `place_pods`, it also places the gated pods without claims of the
namespaces that opt in (placed_pods.py). The caches, the snapshot of the pools and the allocator are kept from
pass to pass and told only what changed (allocators.py); a standby keeps them current too, so that
it places claims at once when it wins the lease. A write that fails ends the pass: the claims and
ledgers are read afresh from the API server before anything else is allocated.

The replica is made of collaborators, each owning its state and given what it uses (replica.py):
what a pass needs of the last is in its context (pass_context.py), made afresh by each pass.

No tenant's claim stalls a pass: each unit's search has a budget, each namespace a share of the
pass (search_shares.py); and a loop that stalls all the same fails the liveness probe and gives up
the Lease (progress.py)."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from driver.allocator.allocate import SEARCH_STEPS
from driver.allocator.cluster import ClusterAllocator
from driver.allocator.model import ObjectError, Slice, slice_from_object
from driver.allocator.policies import DEFAULT_POLICY, Policy
from driver.common.testhooks import NO_TEST_HOOKS, TestHooks
from driver.controller import metrics
from driver.controller.allocators import AllocatorCache
from driver.controller.api import ControllerApi
from driver.controller.clock import WallClock
from driver.controller.emptying import NodeEmptier
from driver.controller.fit import RoomReader
from driver.controller.gates import GatedPods, GateLifter
from driver.controller.leader import LeaderElector, LeaseTimings
from driver.controller.ledger import LEDGER_LABEL, Ledgers
from driver.controller.making_room import RoomMaker
from driver.controller.pass_context import Pass
from driver.controller.placed_pods import PodPlacer
from driver.controller.placing import Placer
from driver.controller.progress import STALL_S, Progress
from driver.controller.refusals import RefusalTracker
from driver.controller.replica import Replica
from driver.controller.reporter import Reporter
from driver.controller.search_shares import SearchShares
from driver.controller.unschedulable import UnschedulableMarker
from driver.controller.usage_histories import HistorySweeper
from driver.controller.victims import EvictionBudget
from driver.controller.writes import ClaimWriter
from driver.kube.errors import KubeError
from driver.kube.informer import Informer
from driver.scheduling.nodefit import NodeRoom
from driver.scheduling.opt_in import PLACE_PODS_LABEL, PLACE_PODS_VALUE

log = logging.getLogger(__name__)
# Units being written at once. Each waits on three or four round trips (finalizer, ledger, status,
# gate); with 16, at 4,000 pods a claim waited ~a minute in the queue of writes (fleet.md).
MAX_IN_FLIGHT = 48


class Controller:
    """One replica: its caches, its lease, the loop and the collaborators a pass runs."""

    def __init__(
        self,
        api: ControllerApi,
        identity: str,
        policy: Policy = DEFAULT_POLICY,
        lease_namespace: str = "kube-system",
        timings: LeaseTimings | None = None,
        evictions_per_minute: int = 0,
        compact: bool = False,
        hooks: TestHooks = NO_TEST_HOOKS,
        preempt_across_namespaces: bool = False,
        search_steps: int | None = None,
        stall_s: float = STALL_S,
        place_pods: bool = False,
        lifetime_hints: bool = True,
        empty_nodes: bool = False,
    ) -> None:
        """`evictions_per_minute`: making room (making_room.py) evicts at most that many pods a
        minute; 0 turns it off. `compact`: with it, also move pods while nothing waits. `hooks`:
        where tests shift the wall clock and stop before writes (driver/common/testhooks.py).
        `preempt_across_namespaces`: making room may preempt lower-priority pods of any namespace,
        not only the pending claim's. `search_steps`: one unit's search budget (None: the
        allocator's SEARCH_STEPS). `stall_s`: seconds without progress after which this replica
        is stalled (progress.py). `place_pods`: also place the pods without claims of the
        namespaces labelled gpu.fgpu.dev/place-pods=fgpu (placed_pods.py). `lifetime_hints`: shares
        placed by when their claims say they end (ClusterAllocator). `empty_nodes`: with `compact`,
        compaction empties whole nodes first, for the autoscaler to remove (emptying.py)."""
        wall_clock = WallClock(hooks.clock_offset_s)
        self.progress = Progress(stall_s)
        self.search_steps = search_steps or SEARCH_STEPS
        self.api, self.policy, self.identity = api, policy, identity
        self.changed = threading.Event()
        self.informers = {kind: Informer(api, kind, self.changed) for kind in ("classes", "claims", "pods", "nodes")}
        self.informers["slices"] = Informer(api, "slices", self.changed, transform=_readable_slice, long_lived=True)
        # Upstream gangs (groups.py); a cluster without the GenericWorkload API has none.
        self.informers["podgroups"] = Informer(api, "podgroups", self.changed, optional=True)
        if place_pods:  # only the namespaces that opt in: the label is the platform team's
            selector = f"{PLACE_PODS_LABEL}={PLACE_PODS_VALUE}"
            self.informers["namespaces"] = Informer(api, "namespaces", self.changed, selector)
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
            wall_clock=wall_clock,
            stalled=self.progress.stalled,
        )
        self.stale = threading.Event()  # a write failed: end the pass, read afresh, then go on
        ledgers = self.informers["ledgers"]
        self.ledgers = Ledgers(api, lease_namespace, ledgers.update, self.stale.set, ledgers.forget)
        self.histories = HistorySweeper(api, lease_namespace, self.informers["nodes"], wall_clock)
        self.writers = ThreadPoolExecutor(MAX_IN_FLIGHT, thread_name_prefix="writer")
        self._sync_reported = False
        self.budget = EvictionBudget(evictions_per_minute) if evictions_per_minute > 0 else None
        self.compact = compact and self.budget is not None
        self.stop_event = threading.Event()
        # The collaborators, each given what it uses: callables where one tells another (written
        # units lift their pods' gates, and are watched for kube-scheduler's refusals).
        self.replica = replica = Replica(
            api, self.informers, self.ledgers, self.stale, self.writers, self.acting, self.progress, RoomReader()
        )
        gated = GatedPods(self.informers["pods"])
        reporter = Reporter(api, self.informers["pods"], gated, wall_clock)
        self.allocators = AllocatorCache(self.informers, self.ledgers, policy, lifetime_hints)
        self.refusals = RefusalTracker(api, self.informers, reporter)
        self.pod_placer = PodPlacer(replica, self.informers["namespaces"], reporter, self._room) if place_pods else None
        self.gates = GateLifter(replica, gated, self.pod_placer.owns if self.pod_placer is not None else None)
        self.writer = ClaimWriter(replica, self.gates.lift_pods, self.refusals.placed, wall_clock, hooks)
        self.placer = Placer(replica, self.allocators, self.writer, reporter, self._room)
        self.emptier = NodeEmptier(api, self.informers["nodes"], wall_clock) if self.compact and empty_nodes else None
        self.room_maker = RoomMaker(replica, self.budget, reporter, self._room, preempt_across_namespaces, self.emptier)
        self.unschedulable = UnschedulableMarker(api, self.informers["pods"], gated, reporter.reason_of, wall_clock)

    # --- running ------------------------------------------------------------------------------

    def run(self) -> None:
        for informer in self.informers.values():
            informer.start()
        elector = threading.Thread(target=self.leader.run, args=(self.stop_event,), name="leader", daemon=True)
        elector.start()
        while not self.stop_event.is_set():
            self.progress.beat()
            self.changed.wait(timeout=5.0)
            self.stop_event.wait(0.05)  # let a burst of watch events land: one pass for all of them
            self.changed.clear()
            metrics.LEADER.set(self.leader.leading())
            if not self._synced():
                continue
            if not self.acting():
                self.keep_ready()
                continue
            try:
                self.run_pass()
            except KubeError as error:
                log.warning("pass ended early: %s", error)
                self.stop_event.wait(1.0)
                self.changed.set()
        self.writers.shutdown(wait=True)
        elector.join()
        self.leader.release()  # after the last write: the standby may start at once

    def keep_ready(self) -> ClusterAllocator:
        """A standby keeps its allocator current with its caches (reads only, no writes), so that
        when it wins the lease its first pass places claims at once, instead of first gathering the
        pools and counting every claim's allocation. Returns that allocator."""
        self.ledgers.begin(self.informers["ledgers"].items())
        allocator = self.allocators.allocator()
        self.progress.beat()  # a first gathering of every pool and claim is a long step
        return allocator

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

    def run_pass(self) -> None:
        self.stale.clear()
        self.ledgers.begin(self.informers["ledgers"].items())
        self.writer.resolve_undecided()
        self.writer.retire_gone_pools()
        self.histories.sweep()
        reserved = self.room_maker.reservations()
        self.refusals.notice()
        current = Pass(
            self.allocators.allocator(), reserved, SearchShares(self.search_steps)
        )  # also when nothing waits
        self.progress.beat()
        waiting = self.replica.waiting()
        metrics.PENDING.set(len(waiting))
        if waiting and not self.stale.is_set():
            self.placer.place(current, waiting)
        if self.pod_placer is not None and not self.stale.is_set():
            self.pod_placer.place(current)  # after the claims: GPU pods choose first
        # Emptying taints go when something waits (the node may take it) and when they are old.
        lifted = self.emptier is not None and self.emptier.lift(every=bool(current.unplaced)) > 0
        if current.unplaced and lifted:
            self.changed.set()  # placed again on the nodes lifted before room is made or a pod marked
        elif current.unplaced and not self.stale.is_set():
            self.room_maker.make_room(current)
        elif self.compact and not waiting and not current.reserved and not self.replica.any_gated():
            self.room_maker.compact(current.allocator)
        if self.stale.is_set():
            self.refresh()
            return
        if current.unplaced and not lifted:
            self.unschedulable.mark(current.unplaced, self.room_maker.reservations())
        self.gates.lift_all()

    def refresh(self) -> None:
        """A conflict means the world changed: read the claims (their allocations) and the ledgers
        from the API server before allocating anything else."""
        metrics.REFRESHES.inc()
        for kind in ("claims", "ledgers"):
            self.informers[kind].relist()
        self.allocators.forget()
        self.stale.clear()
        self.changed.set()

    def _room(self) -> NodeRoom:
        """What the nodes have left for the pods of the claims a pass places, kube-scheduler's
        refusals (refusals.py) ruled out; the kept allocator told of the nodes whose pods changed."""
        return self.allocators.follow(self.replica.room(self.refusals.refused))


def _readable_slice(obj: dict[str, Any]) -> Slice | None:
    """What the slices' informer keeps: the parsed slice (the API object is dropped)."""
    try:
        return slice_from_object(obj)
    except ObjectError as error:
        log.warning("ignoring ResourceSlice: %s", error)
        return None
