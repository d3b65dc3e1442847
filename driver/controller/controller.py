"""The controller loop: informer caches in, allocations and lifted scheduling gates out.

Claims opt in with the label `gpu.fgpu.dev/allocator=fgpu` (set it on a ResourceClaimTemplate's
metadata and every claim made from it carries it). Their pods carry the scheduling gate
`gpu.fgpu.dev/allocation`, so kube-scheduler leaves them alone until the controller has written
every claim's allocation; it then lifts the gate and kube-scheduler binds the pod to the node the
allocation names. Gangs: claims labelled `gpu.fgpu.dev/gang=<name>` and `gpu.fgpu.dev/gang-size=<n>`
are allocated together once all n exist, all or none.

A pass computes placements one unit (a claim, or a whole gang) at a time and hands each to a pool
of writers, so writes overlap with the search and with each other (at most MAX_IN_FLIGHT units);
a unit's pods are released as soon as its claims are written. Each unit is recorded in the pools'
ledgers before its claims are written (ledger.py: the fence). A write that fails ends the pass:
the claims and ledgers are read afresh from the API server before anything else is allocated."""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from driver.allocator.cluster import ClusterAllocator, Failure, Placement, Snapshot
from driver.allocator.model import Claim, ObjectError, Slice, claim_from_object, class_from_object, slice_from_object
from driver.allocator.pools import Node
from driver.allocator.scoring import Policy
from driver.allocator.state import AllocatedState
from driver.controller import metrics
from driver.controller.clock import timestamp
from driver.controller.informer import Informer, object_key
from driver.controller.leader import LeaderElector, LeaseTimings
from driver.controller.ledger import (
    FENCE_ANNOTATION,
    LEDGER_LABEL,
    Entry,
    Ledgers,
    PoolId,
    ResultKey,
    allocated_results,
    backs,
    entries_for,
    entries_of,
    pool_of,
    results_of,
)
from driver.controller.testhooks import stop_point
from driver.kube import ConflictError, KubeError, NotFoundError

log = logging.getLogger(__name__)
OPT_IN_LABEL = "gpu.fgpu.dev/allocator"
OPT_IN_VALUE = "fgpu"
GANG_LABEL = "gpu.fgpu.dev/gang"
GANG_SIZE_LABEL = "gpu.fgpu.dev/gang-size"
SCHEDULING_GATE = "gpu.fgpu.dev/allocation"
DELETE_PROTECTION = "resource.kubernetes.io/delete-protection"
COMPONENT = "fgpu-controller"
MAX_IN_FLIGHT = 16  # units being written at once: enough to hide the API server's latency
ABSORB_S = 2.0  # how long a pass goes on placing lone claims that arrive while its writes are out


def opted_in(claim: dict[str, Any]) -> bool:
    return ((claim.get("metadata") or {}).get("labels") or {}).get(OPT_IN_LABEL) == OPT_IN_VALUE


def pending(claim: dict[str, Any]) -> bool:
    meta = claim.get("metadata") or {}
    return opted_in(claim) and not (claim.get("status") or {}).get("allocation") and not meta.get("deletionTimestamp")


def pod_claim_names(pod: dict[str, Any]) -> list[str] | None:
    """The claims a pod uses, or None while one made from a template has no name yet."""
    statuses = {
        s["name"]: s.get("resourceClaimName") for s in (pod.get("status") or {}).get("resourceClaimStatuses") or ()
    }
    names = []
    for ref in (pod.get("spec") or {}).get("resourceClaims") or ():
        name = ref.get("resourceClaimName") or statuses.get(ref.get("name"))
        if not name:
            return None
        names.append(name)
    return names


def gang_of(claim: Claim) -> tuple[str, int] | None:
    name = claim.labels.get(GANG_LABEL)
    if not name:
        return None
    try:
        return f"{claim.namespace}/{name}", max(1, int(claim.labels.get(GANG_SIZE_LABEL, "1")))
    except ValueError:
        return f"{claim.namespace}/{name}", 0  # a size that is not a number: reported, never placed


def _gang_label(claim: dict[str, Any]) -> str | None:
    return (claim["metadata"].get("labels") or {}).get(GANG_LABEL)


def gated(pod: dict[str, Any]) -> bool:
    return any(g.get("name") == SCHEDULING_GATE for g in (pod.get("spec") or {}).get("schedulingGates") or ())


class Unwritten(enum.Enum):
    """A claim write that failed: refused by the API server (nothing written), or unanswered (a
    timeout, a server error: it may have been written, so what it records must be kept)."""

    REFUSED = "refused"
    UNKNOWN = "unknown"


@dataclass
class Counted:
    """The allocator kept between passes and the results its state counts."""

    allocator: ClusterAllocator
    key: tuple[int, int]  # the snapshot and the classes it was built on
    results: dict[ResultKey, dict[str, Any]]


@dataclass
class Unit:
    """Claims written together: one claim, or the waiting members of a gang (all or none)."""

    placements: list[Placement]
    objects: dict[str, dict[str, Any]]  # claim key -> the object its placement was computed on
    # Gang members allocated earlier (by an interrupted pass) that this unit completes: their
    # resourceVersion is moved first, so that a take-back decided on them elsewhere fails.
    kept: list[dict[str, Any]] = field(default_factory=list)


class Controller:
    def __init__(
        self,
        api: Any,
        identity: str,
        policy: Policy = "binpack",
        lease_namespace: str = "kube-system",
        timings: LeaseTimings | None = None,
    ) -> None:
        self.api, self.policy, self.identity = api, policy, identity
        self.changed = threading.Event()
        self.informers = {kind: Informer(api, kind, self.changed) for kind in ("classes", "claims", "pods", "nodes")}
        self.informers["slices"] = Informer(api, "slices", self.changed, transform=_readable_slice, long_lived=True)
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
        allocator = self.allocator()  # also when nothing waits: ready for the next burst
        waiting = self._waiting()
        metrics.PENDING.set(len(waiting))
        if waiting and not self.stale.is_set():
            self._allocate(allocator, waiting)
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

    def _waiting(self) -> list[dict[str, Any]]:
        return sorted(
            (c for c in self.informers["claims"].items() if pending(c)),
            key=lambda c: (c["metadata"].get("creationTimestamp", ""), c["metadata"]["name"]),
        )

    def _allocate(self, allocator: ClusterAllocator, waiting: list[dict[str, Any]]) -> None:
        """Place and hand out the waiting claims; while their writes are out (up to ABSORB_S), lone
        claims that arrive are placed too, on the same allocator and ledger versions, instead of
        waiting for the next pass. Gang members that arrive wait for it."""
        started = time.perf_counter()
        handled = {object_key(c) for c in waiting}
        in_flight = self._submit(allocator, waiting)
        version = self.informers["claims"].version
        while time.perf_counter() - started < ABSORB_S and not self.stale.is_set() and self.acting():
            if not wait(in_flight, timeout=0.02, return_when=FIRST_COMPLETED).not_done:
                break
            if self.informers["claims"].version == version:
                continue
            version = self.informers["claims"].version
            arrived = [c for c in self._waiting() if object_key(c) not in handled and not _gang_label(c)]
            handled.update(object_key(c) for c in arrived)
            in_flight += self._submit(allocator, arrived)
        wait(in_flight)
        log.debug("pass: %d claims placed and written in %.3f s", len(handled), time.perf_counter() - started)
        for future in in_flight:
            if future.exception() is not None:
                log.error("writing a unit failed", exc_info=future.exception())
                self.stale.set()

    def _submit(self, allocator: ClusterAllocator, waiting: list[dict[str, Any]]) -> list[Future[None]]:
        return [self._writers.submit(self._write_unit, unit) for unit in self._units(allocator, waiting)]

    def _units(self, allocator: ClusterAllocator, waiting: list[dict[str, Any]]) -> Iterator[Unit]:
        """Placements, one unit at a time (lone claims first, in creation order, then gangs); stops
        as soon as a write has failed or this replica no longer leads."""
        gangs: dict[tuple[str, int], list[Claim]] = defaultdict(list)
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
            elif (placement := self._place_one(allocator, claim, obj)) is not None:
                yield Unit([placement], {claim.key: obj})
        for (name, size), members in gangs.items():
            if self.stale.is_set() or not self.acting():
                return
            if (unit := self._place_gang(allocator, name, size, members)) is not None:
                yield unit

    def _place_one(self, allocator: ClusterAllocator, claim: Claim, obj: dict[str, Any]) -> Placement | None:
        started = time.perf_counter()
        outcome = allocator.allocate(claim)
        metrics.ALLOCATION_SECONDS.observe(time.perf_counter() - started)
        if isinstance(outcome, Failure):
            metrics.ALLOCATIONS.labels("unschedulable").inc()
            self._report(obj, outcome.reason)
            return None
        allocator.commit(outcome)
        self._count([(obj, outcome)])
        return outcome

    def _place_gang(self, allocator: ClusterAllocator, name: str, size: int, members: list[Claim]) -> Unit | None:
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
        outcome = allocator.allocate_gang(members)
        if isinstance(outcome, Failure):
            metrics.GANGS.labels("unschedulable").inc()
            for obj in objects.values():
                self._report(obj, outcome.reason)
            if allocated and len(allocated) < size:
                # Members left allocated by an interrupted pass: all or none, so give them back.
                self._take_back(allocated)
            return None
        self._count((present[p.claim.key], p) for p in outcome)
        return Unit(outcome, present, kept=allocated)

    def _gang_claims(self, gang: str) -> list[dict[str, Any]]:
        namespace, name = gang.split("/", 1)
        return [
            c
            for c in self.informers["claims"].items()
            if c["metadata"].get("namespace") == namespace
            and (c["metadata"].get("labels") or {}).get(GANG_LABEL) == name
        ]

    # --- writes: one unit -----------------------------------------------------------------------

    def _write_unit(self, unit: Unit) -> None:
        """Finalizers, then the ledger entries (the fence), then the claims' status; the unit's pods
        go as soon as it is written. After a failed status write, the entries of the claims not
        written are dropped, except where the write may have landed (no answer): that claim may hold
        the devices, so its entry stays until a pass reads the claim afresh (_resolve_undecided).
        Members of a gang already written stay too: this replica's view is stale now, so the next
        pass, after reading afresh, places the rest of the gang or takes the gang back."""
        if not all(self.acting() and self._fence(obj) for obj in unit.kept):
            return
        prepared = [self._protect(unit.objects[p.claim.key]) for p in unit.placements]
        decided = [(p, obj) for p, obj in zip(unit.placements, prepared, strict=True) if obj is not None]
        if len(decided) < len(unit.placements):
            return
        recorded = self._record(decided)
        if recorded is None:
            return
        gang = len(decided) > 1
        for index, (placement, obj) in enumerate(decided):
            result = self._write_status(obj, placement) if self.acting() else Unwritten.REFUSED
            if isinstance(result, Unwritten):
                first = index + (result is Unwritten.UNKNOWN)
                unwritten = {o["metadata"]["uid"] for _, o in decided[first:]}
                self._forget(
                    {pool: {u: e for u, e in added.items() if u in unwritten} for pool, added in recorded.items()}
                )
                if gang:
                    metrics.GANGS.labels("interrupted").inc()
                return
        if gang:
            metrics.GANGS.labels("allocated").inc()
        self._lift_pods([*unit.objects, *(object_key(obj) for obj in unit.kept)])  # the whole gang's pods

    def _record(self, decided: list[tuple[Placement, dict[str, Any]]]) -> dict[PoolId, dict[str, Entry]] | None:
        """The unit's ledger entries, pool by pool; None (and what was recorded forgotten) on failure."""
        entries: dict[PoolId, dict[str, Entry]] = defaultdict(dict)
        for placement, obj in decided:
            for pool, entry in entries_for(obj, placement.allocation).items():
                entries[pool][obj["metadata"]["uid"]] = entry
        recorded: dict[PoolId, dict[str, Entry]] = {}
        for pool, added in entries.items():
            if self.acting():
                stop_point("ledger", *(entry.claim for entry in added.values()))
                if self.ledgers.change(pool, add=added):
                    recorded[pool] = added
                    continue
            self._forget(recorded)
            return None
        return recorded

    def _forget(self, entries: dict[PoolId, dict[str, Entry]]) -> None:
        """Drop entries whose claims were never written; what cannot be dropped now is dropped by a
        later pass (_resolve_undecided)."""
        for pool, uids in entries.items():
            if uids and self.acting():
                self.ledgers.change(pool, remove=uids)

    def _protect(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The claim with the delete-protection finalizer (added first, as kube-scheduler does)."""
        finalizers = obj["metadata"].get("finalizers") or []
        if DELETE_PROTECTION in finalizers:
            return obj
        if not self.acting():
            return None
        meta = {**obj["metadata"], "finalizers": [*finalizers, DELETE_PROTECTION]}
        updated = self._claim_write(self.api.replace_claim, {**obj, "metadata": meta}, object_key(obj))
        return None if isinstance(updated, Unwritten) else updated

    def _write_status(self, obj: dict[str, Any], placement: Placement) -> dict[str, Any] | Unwritten:
        stop_point("status", placement.claim.key)
        allocation = {**placement.allocation, "allocationTimestamp": timestamp()}
        body = {**obj, "status": {**(obj.get("status") or {}), "allocation": allocation}}
        updated = self._claim_write(self.api.replace_claim_status, body, placement.claim.key)
        if not isinstance(updated, Unwritten):
            metrics.ALLOCATIONS.labels("allocated").inc()
            log.info("allocated %s on %s", placement.claim.key, placement.node)
        return updated

    def _claim_write(self, call: Any, body: dict[str, Any], key: str) -> dict[str, Any] | Unwritten:
        """One write conditioned on the claim's resourceVersion; on failure the pass ends, and the
        result says whether the write may have landed all the same."""
        try:
            updated = call(body)
        except ConflictError:
            log.info("claim %s changed since this replica read it", key)
            metrics.CONFLICTS.inc()
            metrics.ALLOCATIONS.labels("conflict").inc()
            self.stale.set()
            return Unwritten.REFUSED
        except NotFoundError:
            log.info("claim %s is gone", key)
            self.stale.set()
            return Unwritten.REFUSED
        except KubeError as error:  # a timeout or an outage: a later pass, reading afresh, sees what it did
            metrics.ALLOCATIONS.labels("error").inc()
            log.warning("cannot write claim %s: %s", key, error)
            self.stale.set()
            return Unwritten.UNKNOWN
        self.informers["claims"].update(updated)
        return updated

    def _take_back(self, claims: Iterable[dict[str, Any]]) -> None:
        """Clear allocations we wrote, then their ledger entries (in that order: the entry holds the
        devices until the claim no longer does). What fails is retried by a later pass."""
        cleared: dict[PoolId, set[str]] = defaultdict(set)
        for obj in claims:
            if not self.acting():
                return
            status = {k: v for k, v in (obj.get("status") or {}).items() if k != "allocation"}
            cleared_claim = self._claim_write(self.api.replace_claim_status, {**obj, "status": status}, object_key(obj))
            if isinstance(cleared_claim, Unwritten):
                log.error("could not take back the allocation of %s", object_key(obj))
                continue
            for pool in entries_for(obj, (obj.get("status") or {}).get("allocation") or {}):
                cleared[pool].add(obj["metadata"]["uid"])
        for pool, uids in cleared.items():
            if self.acting():
                self.ledgers.change(pool, remove=uids)

    # --- entries without a claim to match -------------------------------------------------------

    def _resolve_undecided(self) -> None:
        """Drop ledger entries that no claim holds and none can come to hold: left by a replica
        that stopped (or was stopped) between its ledger write and its claim write, or by a claim
        that was taken back or deleted. Entries the claim cache confirms cost nothing here."""
        claims = {c["metadata"].get("uid"): c for c in self.informers["claims"].items()}
        suspects = [
            (pool_of(ledger), uid, entry)
            for ledger in self.ledgers.objects()
            for uid, entry in entries_of(ledger).items()
            if not backs(entry, uid, claims.get(uid), pool_of(ledger))
        ]
        if not suspects:
            return
        verdicts = self._writers.map(lambda s: self._voided(*s), suspects)
        dropped: dict[PoolId, set[str]] = defaultdict(set)
        for (pool, uid, _), voided in zip(suspects, verdicts, strict=True):
            if voided:
                dropped[pool].add(uid)
        for pool, uids in dropped.items():
            if self.acting():
                log.info("dropping %d ledger entries of pool %s/%s no claim holds", len(uids), *pool)
                self.ledgers.change(pool, remove=uids)

    def _voided(self, pool: PoolId, uid: str, entry: Entry) -> bool:
        """Whether no write can still give the claim what the entry records: read afresh, the claim
        is gone, holds something else, or has moved past the version the entry was decided on. A
        pending claim still at that version is changed now, so that the decision's write fails."""
        namespace, name = entry.claim.split("/", 1)
        try:
            claim = self.api.get_claim(namespace, name)
        except NotFoundError:
            return True
        except KubeError as error:
            log.warning("cannot read claim %s: %s", entry.claim, error)
            return False
        if backs(entry, uid, claim, pool):
            self.informers["claims"].update(claim)
            return False
        if claim["metadata"].get("uid") != uid or claim["metadata"].get("resourceVersion") != entry.version:
            return True
        if not self.acting():
            return False
        return self._fence(claim)

    def _fence(self, claim: dict[str, Any]) -> bool:
        """Move the claim's resourceVersion (an annotation naming the version it had), so that every
        write decided on that version, by any replica, fails; False if this write failed."""
        version = claim["metadata"]["resourceVersion"]
        annotations = {**(claim["metadata"].get("annotations") or {}), FENCE_ANNOTATION: version}
        body = {**claim, "metadata": {**claim["metadata"], "annotations": annotations}}
        return not isinstance(self._claim_write(self.api.replace_claim, body, object_key(claim)), Unwritten)

    # --- gates --------------------------------------------------------------------------------

    def _gated_pods_by_claim(self) -> dict[str, list[str]]:
        """Claim key -> gated pods that use it, rebuilt when the pods change (kube-controller-manager
        names a pod's claims in its status after it makes them, so this is read when a unit is written)."""
        with self._pods_lock:
            version = self.informers["pods"].version
            if self._pods_of[0] != version:
                out: dict[str, list[str]] = defaultdict(list)
                for pod in self.informers["pods"].items():
                    if gated(pod) and (names := pod_claim_names(pod)) is not None:
                        for name in names:
                            out[f"{pod['metadata']['namespace']}/{name}"].append(object_key(pod))
                self._pods_of = (version, out)
            return self._pods_of[1]

    def _whole_gangs(self) -> dict[str, bool]:
        """Gang -> whether every one of its claims exists and is allocated."""
        members: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
        for obj in self.informers["claims"].items():
            if opted_in(obj) and (labels := obj["metadata"].get("labels") or {}).get(GANG_LABEL):
                members[f"{obj['metadata']['namespace']}/{labels[GANG_LABEL]}", _size(labels)].append(obj)
        return {
            gang: len(claims) >= size > 0 and not any(pending(c) for c in claims)
            for (gang, size), claims in members.items()
        }

    def _lift_pods(self, claims: Iterable[str]) -> None:
        pods_of = self._gated_pods_by_claim()
        keys = {pod for claim in claims for pod in pods_of.get(claim, ())}
        pods = [p for key in keys if (p := self.informers["pods"].get(key)) is not None]
        if pods:
            whole = self._whole_gangs()
            for pod in pods:
                self._lift(pod, whole)

    def _lift_gates(self) -> None:
        """Every gated pod whose claims are allocated, the patches sent concurrently."""
        whole = self._whole_gangs()
        pods = [p for p in self.informers["pods"].items() if gated(p)]
        if pods and self.acting():
            wait([self._writers.submit(self._lift, pod, whole) for pod in pods])

    def _lift(self, pod: dict[str, Any], whole_gangs: dict[str, bool]) -> None:
        """Lift our gate once every opt-in claim of the pod is allocated and its gang is whole."""
        if not gated(pod) or (names := pod_claim_names(pod)) is None:
            return
        namespace = pod["metadata"]["namespace"]
        used = [self.informers["claims"].get(f"{namespace}/{name}") for name in names]
        for claim in used:
            if claim is None or pending(claim):
                return
            gang = (claim["metadata"].get("labels") or {}).get(GANG_LABEL) if opted_in(claim) else None
            if gang and not whole_gangs.get(f"{namespace}/{gang}"):
                return
        gates = [g for g in pod["spec"]["schedulingGates"] if g.get("name") != SCHEDULING_GATE]
        try:
            self.informers["pods"].update(self.api.set_scheduling_gates(pod, gates))
        except KubeError as error:
            log.warning("cannot lift the gate of pod %s: %s", object_key(pod), error)
            return
        metrics.GATES_LIFTED.inc()

    def _report(self, obj: dict[str, Any] | None, reason: str, warning: bool = True) -> None:
        """One Event per claim and reason (not one a pass)."""
        if obj is None:
            return
        meta = obj["metadata"]
        if self._reported.get(meta.get("uid", "")) == reason:
            return
        self._reported[meta.get("uid", "")] = reason
        log.info("claim %s/%s: %s", meta["namespace"], meta["name"], reason)
        now = timestamp()
        event = {
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "reason": "FailedAllocation" if warning else "WaitingForGang",
            "message": reason[:1024],
            "type": "Warning" if warning else "Normal",
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.api.create_event(meta["namespace"], event)
        except KubeError as error:
            log.warning("cannot record an event for %s/%s: %s", meta["namespace"], meta["name"], error)


def _readable_slice(obj: dict[str, Any]) -> Slice | None:
    """What the slices' informer keeps: the parsed slice (the API object is dropped)."""
    try:
        return slice_from_object(obj)
    except ObjectError as error:
        log.warning("ignoring ResourceSlice: %s", error)
        return None


def _size(labels: dict[str, str]) -> int:
    try:
        return max(1, int(labels.get(GANG_SIZE_LABEL, "1")))
    except ValueError:
        return 0
