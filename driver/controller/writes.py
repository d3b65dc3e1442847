"""Writes: a unit's claims written ledger first, then status (the fence), and allocations taken back.

Each unit is recorded in the pools' ledgers before its claims are written (ledger.py: the fence).
A write that fails ends the pass (`stale`): the claims and ledgers are read afresh from the API
server before anything else is allocated. Ledger entries that no claim holds and none can come to
hold (a replica stopped between its two writes, a claim taken back or deleted) are dropped by the
next pass, after fencing the claim where a write decided on it could still land."""

from __future__ import annotations

import enum
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from driver.allocator.cluster import Placement
from driver.common.testhooks import TestHooks
from driver.controller import metrics
from driver.controller.clock import WallClock
from driver.controller.ledger import (
    FENCE_ANNOTATION,
    Entry,
    PoolId,
    backs,
    entries_for,
    entries_of,
    holds_reservation,
    pool_of,
)
from driver.controller.replica import Replica
from driver.kube.errors import ConflictError, KubeError, NotFoundError
from driver.kube.informer import object_key

log = logging.getLogger(__name__)
DELETE_PROTECTION = "resource.kubernetes.io/delete-protection"


class Unwritten(enum.Enum):
    """A claim write that failed: refused by the API server (nothing written), or unanswered (a
    timeout, a server error: it may have been written, so what it records must be kept)."""

    REFUSED = "refused"
    UNKNOWN = "unknown"


@dataclass
class Unit:
    """Claims written together: one claim, or the waiting members of a gang (all or none)."""

    placements: list[Placement]
    objects: dict[str, dict[str, Any]]  # claim key -> the object its placement was computed on
    # Gang members allocated earlier (by an interrupted pass) that this unit completes: their
    # resourceVersion is moved first, so that a take-back decided on them elsewhere fails.
    kept: list[dict[str, Any]] = field(default_factory=list)


class ClaimWriter:
    """Writes units (ledger first, then status), takes allocations back and drops the ledger
    entries no claim holds. `written`: told the claim keys of each unit written (their pods may
    go: gates.py); `allocated`: told each claim uid and the node its allocation was written on
    (refusals.py watches it)."""

    def __init__(
        self,
        replica: Replica,
        written: Callable[[list[str]], None],
        allocated: Callable[[str, str], None],
        wall_clock: WallClock,
        hooks: TestHooks,
    ) -> None:
        self._replica, self._written, self._allocated = replica, written, allocated
        self._wall_clock, self._hooks = wall_clock, hooks
        self._api, self._informers, self._ledgers = replica.api, replica.informers, replica.ledgers
        self._swept: tuple[int, int] | None = None  # the informers' versions retire_gone_pools last saw
        self._pools: tuple[int, set[tuple[str, str]]] = (-1, set())  # slices' version, their pools

    def write_unit(self, unit: Unit) -> None:
        """Finalizers, then the ledger entries (the fence), then the claims' status; the unit's pods
        go as soon as it is written. After a failed status write, the entries of the claims not
        written are dropped, except where the write may have landed (no answer): that claim may hold
        the devices, so its entry stays until a pass reads the claim afresh (resolve_undecided).
        Members of a gang already written stay too: this replica's view is stale now, so the next
        pass, after reading afresh, places the rest of the gang or takes the gang back."""
        if not all(self._replica.acting() and self._fence(obj) for obj in unit.kept):
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
            result = self._write_status(obj, placement) if self._replica.acting() else Unwritten.REFUSED
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
        self._written([*unit.objects, *(object_key(obj) for obj in unit.kept)])  # the whole gang's pods

    def _record(self, decided: list[tuple[Placement, dict[str, Any]]]) -> dict[PoolId, dict[str, Entry]] | None:
        """The unit's ledger entries, pool by pool; None (and what was recorded forgotten) on failure."""
        entries: dict[PoolId, dict[str, Entry]] = defaultdict(dict)
        for placement, obj in decided:
            for pool, entry in entries_for(obj, placement.allocation).items():
                entries[pool][obj["metadata"]["uid"]] = entry
        recorded: dict[PoolId, dict[str, Entry]] = {}
        for pool, added in entries.items():
            if self._replica.acting():
                self._hooks.stop_before("ledger", [entry.claim for entry in added.values()])
                if self._ledgers.change(pool, add=added):
                    recorded[pool] = added
                    continue
            self._forget(recorded)
            return None
        return recorded

    def _forget(self, entries: dict[PoolId, dict[str, Entry]]) -> None:
        """Drop entries whose claims were never written; what cannot be dropped now is dropped by a
        later pass (resolve_undecided)."""
        for pool, uids in entries.items():
            if uids and self._replica.acting():
                self._ledgers.change(pool, remove=uids)

    def _protect(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The claim with the delete-protection finalizer (added first, as kube-scheduler does)."""
        finalizers = obj["metadata"].get("finalizers") or []
        if DELETE_PROTECTION in finalizers:
            return obj
        if not self._replica.acting():
            return None
        meta = {**obj["metadata"], "finalizers": [*finalizers, DELETE_PROTECTION]}
        updated = self._claim_write(self._api.replace_claim, {**obj, "metadata": meta}, object_key(obj))
        return None if isinstance(updated, Unwritten) else updated

    def _write_status(self, obj: dict[str, Any], placement: Placement) -> dict[str, Any] | Unwritten:
        self._hooks.stop_before("status", [placement.claim.key])
        allocation = {**placement.allocation, "allocationTimestamp": self._wall_clock.timestamp()}
        body = {**obj, "status": {**(obj.get("status") or {}), "allocation": allocation}}
        updated = self._claim_write(self._api.replace_claim_status, body, placement.claim.key)
        if not isinstance(updated, Unwritten):
            metrics.ALLOCATIONS.labels("allocated").inc()
            self._allocated(obj["metadata"]["uid"], placement.node)
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
            self._replica.stale.set()
            return Unwritten.REFUSED
        except NotFoundError:
            log.info("claim %s is gone", key)
            self._replica.stale.set()
            return Unwritten.REFUSED
        except KubeError as error:  # a timeout or an outage: a later pass, reading afresh, sees what it did
            metrics.ALLOCATIONS.labels("error").inc()
            log.warning("cannot write claim %s: %s", key, error)
            self._replica.stale.set()
            return Unwritten.UNKNOWN
        self._informers["claims"].update(updated)
        return updated

    def take_back(self, claims: Iterable[dict[str, Any]]) -> None:
        """Clear allocations we wrote, then their ledger entries (in that order: the entry holds the
        devices until the claim no longer does). What fails is retried by a later pass."""
        cleared: dict[PoolId, set[str]] = defaultdict(set)
        for obj in claims:
            if not self._replica.acting():
                return
            status = {k: v for k, v in (obj.get("status") or {}).items() if k != "allocation"}
            body = {**obj, "status": status}
            if isinstance(self._claim_write(self._api.replace_claim_status, body, object_key(obj)), Unwritten):
                log.error("could not take back the allocation of %s", object_key(obj))
                continue
            for pool in entries_for(obj, (obj.get("status") or {}).get("allocation") or {}):
                cleared[pool].add(obj["metadata"]["uid"])
        for pool, uids in cleared.items():
            if self._replica.acting():
                self._ledgers.change(pool, remove=uids)

    # --- entries without a claim to match -------------------------------------------------------

    def resolve_undecided(self) -> None:
        """Drop ledger entries that no claim holds and none can come to hold: left by a replica
        that stopped (or was stopped) between its ledger write and its claim write, or by a claim
        that was taken back or deleted; and reservations (making_room.py) whose claim is gone or
        allocated, or that expired. Entries the claim cache confirms cost nothing here."""
        claims = {c["metadata"].get("uid"): c for c in self._informers["claims"].items()}
        now = time.time()
        dropped: dict[PoolId, set[str]] = defaultdict(set)
        suspects = []
        for ledger in self._ledgers.objects():
            pool = pool_of(ledger)
            for uid, entry in entries_of(ledger).items():
                if entry.reservation:
                    if not holds_reservation(entry, claims.get(uid), now):
                        dropped[pool].add(uid)
                elif not backs(entry, uid, claims.get(uid), pool):
                    suspects.append((pool, uid, entry))
        verdicts = self._replica.writers.map(lambda s: self._voided(*s), suspects)
        for (pool, uid, _), voided in zip(suspects, verdicts, strict=True):
            if voided:
                dropped[pool].add(uid)
        for pool, uids in dropped.items():
            if self._replica.acting():
                log.info("dropping %d ledger entries of pool %s/%s no claim holds", len(uids), *pool)
                self._ledgers.change(pool, remove=uids)

    def retire_gone_pools(self) -> None:
        """Delete the ledgers that record nothing and whose pool has no slice left (a node an
        autoscaler removed): otherwise every pool a fleet ever had keeps a ConfigMap that each pass
        reads. Looked at again only when the slices or the ledgers changed (a deletion that failed
        is tried again then, not on every pass)."""
        slices, ledgers = self._informers["slices"], self._informers["ledgers"]
        seen = (slices.version, ledgers.version)
        if seen == self._swept or not self._replica.acting():
            return
        if seen[0] != self._pools[0]:  # ledgers change with every write, slices seldom
            self._pools = (seen[0], {(s.driver, s.pool) for s in slices.items()})
        self._swept, pools = seen, self._pools[1]
        for ledger in self._ledgers.objects():
            pool = pool_of(ledger)
            if not ledger.get("data") and pool not in pools and self._ledgers.retire(ledger["metadata"]["name"]):
                log.info("deleted the ledger of pool %s/%s: the pool is gone and the ledger records nothing", *pool)

    def _voided(self, pool: PoolId, uid: str, entry: Entry) -> bool:
        """Whether no write can still give the claim what the entry records: read afresh, the claim
        is gone, holds something else, or has moved past the version the entry was decided on. A
        pending claim still at that version is changed now, so that the decision's write fails."""
        namespace, name = entry.claim.split("/", 1)
        try:
            claim = self._api.get_claim(namespace, name)
        except NotFoundError:
            return True
        except KubeError as error:
            log.warning("cannot read claim %s: %s", entry.claim, error)
            return False
        if backs(entry, uid, claim, pool):
            self._informers["claims"].update(claim)
            return False
        if claim["metadata"].get("uid") != uid or claim["metadata"].get("resourceVersion") != entry.version:
            return True
        if not self._replica.acting():
            return False
        return self._fence(claim)

    def _fence(self, claim: dict[str, Any]) -> bool:
        """Move the claim's resourceVersion (an annotation naming the version it had), so that every
        write decided on that version, by any replica, fails; False if this write failed."""
        version = claim["metadata"]["resourceVersion"]
        annotations = {**(claim["metadata"].get("annotations") or {}), FENCE_ANNOTATION: version}
        body = {**claim, "metadata": {**claim["metadata"], "annotations": annotations}}
        return not isinstance(self._claim_write(self._api.replace_claim, body, object_key(claim)), Unwritten)
