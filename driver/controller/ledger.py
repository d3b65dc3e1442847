"""The fence: a ledger per pool (a ConfigMap) of every allocation the controller made from it.

No API call spans two objects, and two claims that get the same device are two objects, so a
claim's resourceVersion alone cannot stop two replicas from giving one device twice. What both
must touch is the pool's ledger: a replica records a claim's devices there (one entry per claim,
keyed by its uid) before it writes the claim's status, with the ledger's resourceVersion as a
precondition, namely the version its allocator counted. A replica whose view is stale (resumed
after SIGSTOP, or a second one that believes it leads) fails that write with a conflict, so two
entries in one ledger never overbook a device, a counter or a share's capacity. The claim's status
write then carries the claim's resourceVersion recorded in the entry.

An entry stays while its claim may hold its devices, so a ledger is a complete record of the
controller's allocations from its pool, whatever a replica's claim cache shows. It goes when its
claim is gone, holds another allocation, or has moved past the recorded version (no write from the
entry's decision can succeed any more); a pending claim still at that version is changed first
(an annotation), so that the decision's write fails. Taking an allocation back clears the claim's
status first and the entry after. Changes to one ledger from concurrent writes go out as one write.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from driver.kube.errors import ConflictError, KubeError, NotFoundError

log = logging.getLogger(__name__)
LEDGER_LABEL = "gpu.fgpu.dev/ledger"
POOL_ANNOTATION = "gpu.fgpu.dev/pool"  # <driver>/<pool>: names may be longer than a label value
FENCE_ANNOTATION = "gpu.fgpu.dev/fenced-at"  # set on a pending claim to void an earlier decision
RESERVED_KEY = "reservedUntil"  # in an entry that reserves devices for a pending claim (making_room.py)

PoolId = tuple[str, str]  # (driver, pool)


@dataclass(frozen=True)
class Entry:
    claim: str  # namespace/name
    version: str  # the claim's resourceVersion its status write is conditioned on
    results: tuple[tuple[str, str], ...]  # (device, shareID or "") of the allocation in this pool
    consumed: tuple[dict[str, str], ...]  # consumedCapacity per result, {} where none
    # A reservation (making_room.py): devices being freed for a pending claim, held for it until
    # this time (seconds since the epoch) and never written to its status as they are.
    until: float = 0.0

    @property
    def reservation(self) -> bool:
        return self.until > 0

    def encode(self) -> str:
        body: dict[str, Any] = {
            "claim": self.claim,
            "version": self.version,
            "results": [list(r) for r in self.results],
        }
        if any(self.consumed):
            body["consumed"] = list(self.consumed)
        if self.until:
            body[RESERVED_KEY] = round(self.until, 3)
        return json.dumps(body, separators=(",", ":"), sort_keys=True)

    @classmethod
    def decode(cls, text: str) -> Entry:
        body = json.loads(text)
        results = tuple((str(d), str(s)) for d, s in body["results"])
        consumed = tuple(body.get("consumed") or ({},) * len(results))
        return cls(body["claim"], body["version"], results, consumed, float(body.get(RESERVED_KEY) or 0))


def _reservation(text: str) -> bool:
    """Whether a recorded entry only reserves devices: its claim's own allocation replaces it."""
    try:
        return Entry.decode(text).reservation
    except (ValueError, KeyError, TypeError):
        return False


def ledger_name(pool: PoolId) -> str:
    return "fgpu-ledger-" + hashlib.sha256("/".join(pool).encode()).hexdigest()[:20]


def pool_of(ledger: dict[str, Any]) -> PoolId:
    driver, _, pool = ((ledger["metadata"].get("annotations") or {}).get(POOL_ANNOTATION) or "/").partition("/")
    return driver, pool


def entries_of(ledger: dict[str, Any]) -> dict[str, Entry]:
    """uid -> entry; an entry that cannot be read is skipped with a warning (it fences nothing)."""
    out = {}
    for uid, text in (ledger.get("data") or {}).items():
        try:
            out[uid] = Entry.decode(text)
        except (ValueError, KeyError, TypeError) as error:
            log.warning("ledger %s: unreadable entry %s: %s", ledger["metadata"]["name"], uid, error)
    return out


def entries_for(claim: dict[str, Any], allocation: dict[str, Any], until: float = 0.0) -> dict[PoolId, Entry]:
    """The entries that record `allocation` of `claim`, one per pool it draws from (admin access
    takes nothing from others, so it is not recorded); with `until`, reserved for it until then."""
    by_pool: dict[PoolId, list[dict[str, Any]]] = defaultdict(list)
    for result in (allocation.get("devices") or {}).get("results") or ():
        if not result.get("adminAccess"):
            by_pool[result["driver"], result["pool"]].append(result)
    meta = claim["metadata"]
    return {
        pool: Entry(
            f"{meta['namespace']}/{meta['name']}",
            meta["resourceVersion"],
            tuple((r["device"], r.get("shareID") or "") for r in results),
            tuple(r.get("consumedCapacity") or {} for r in results),
            until,
        )
        for pool, results in by_pool.items()
    }


def claim_results(claim: dict[str, Any], pool: PoolId) -> set[tuple[str, str]]:
    allocation = (claim.get("status") or {}).get("allocation") or {}
    return {
        (r["device"], r.get("shareID") or "")
        for r in (allocation.get("devices") or {}).get("results") or ()
        if (r.get("driver"), r.get("pool")) == pool and not r.get("adminAccess")
    }


def backs(entry: Entry, uid: str, claim: dict[str, Any] | None, pool: PoolId) -> bool:
    """Whether the claim (as given) holds exactly what the entry records."""
    return (
        claim is not None and claim["metadata"].get("uid") == uid and claim_results(claim, pool) == set(entry.results)
    )


def holds_reservation(entry: Entry, claim: dict[str, Any] | None, now: float) -> bool:
    """Whether a reservation still holds: its claim (from the cache) exists, waits for an
    allocation, and the time is not up. It is never written to the claim, so no fence is needed
    to drop it."""
    return (
        claim is not None
        and f"{claim['metadata'].get('namespace')}/{claim['metadata'].get('name')}" == entry.claim
        and not (claim.get("status") or {}).get("allocation")
        and now < entry.until
    )


ResultKey = tuple[str, str, str, str, str]  # claim uid, driver, pool, device, shareID


def results_of(uid: str, allocation: dict[str, Any]) -> dict[ResultKey, dict[str, Any]]:
    return {
        (uid, r.get("driver"), r.get("pool"), r.get("device"), r.get("shareID") or ""): r
        for r in (allocation.get("devices") or {}).get("results") or ()
    }


def allocated_results(
    claims: Iterable[dict[str, Any]], ledgers: Iterable[dict[str, Any]]
) -> dict[ResultKey, dict[str, Any]]:
    """Every device result held by a claim or recorded in a ledger, each once (a claim's own
    allocation and its entry are the same devices; any other difference counts both ways)."""
    seen: dict[ResultKey, dict[str, Any]] = {}
    for claim in claims:
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for key, result in results_of(claim["metadata"].get("uid", ""), allocation).items():
            seen.setdefault(key, result)
    for ledger in ledgers:
        pool = pool_of(ledger)
        for uid, entry in entries_of(ledger).items():
            for result in entry_results(pool, entry):
                seen.setdefault((uid, *pool, result["device"], result.get("shareID") or ""), result)
    return seen


def entry_results(pool: PoolId, entry: Entry) -> list[dict[str, Any]]:
    """The device results an entry records, as a claim's allocation has them."""
    results = []
    for (device, share), consumed in zip(entry.results, entry.consumed, strict=True):
        result: dict[str, Any] = {"driver": pool[0], "pool": pool[1], "device": device}
        if share:
            result |= {"shareID": share, "consumedCapacity": consumed}
        results.append(result)
    return results


@dataclass
class _Change:
    add: dict[str, Entry]
    remove: set[str]
    done: bool = False
    ok: bool = False


@dataclass
class Ledgers:
    """The ledgers as one pass writes them. Every write is conditioned on the version the pass's
    allocator counted (`begin`), moved on only by the pass's own writes: a change made by anyone
    else in between fails the write. Concurrent changes to one ledger go out as one write."""

    api: Any
    namespace: str
    on_write: Callable[[dict[str, Any]], None]  # a written ledger, for the informer's cache
    on_failure: Callable[[], None]  # a write failed: the pass must end and refresh
    on_delete: Callable[[dict[str, Any]], None]  # a retired ledger, for the informer's cache
    _base: dict[str, dict[str, Any]] = field(default_factory=dict)
    _pending: dict[str, list[_Change]] = field(default_factory=lambda: defaultdict(list))
    _busy: set[str] = field(default_factory=set)
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def begin(self, ledgers: Iterable[dict[str, Any]]) -> None:
        with self._cond:
            self._base = {obj["metadata"]["name"]: obj for obj in ledgers}

    def objects(self) -> list[dict[str, Any]]:
        with self._cond:
            return list(self._base.values())

    def change(self, pool: PoolId, add: dict[str, Entry] | None = None, remove: Iterable[str] = ()) -> bool:
        """Apply the change to the pool's ledger; False if the write failed (conflict or outage)."""
        name = ledger_name(pool)
        item = _Change(add or {}, set(remove))
        with self._cond:
            self._pending[name].append(item)
            while not item.done:
                if name in self._busy:
                    self._cond.wait()
                    continue
                batch = self._pending.pop(name)
                self._busy.add(name)
                self._cond.release()
                try:
                    ok = self._commit(name, pool, batch)
                finally:
                    self._cond.acquire()
                    self._busy.discard(name)
                    for change in batch:
                        change.done, change.ok = True, ok
                    self._cond.notify_all()
        return item.ok

    def retire(self, name: str) -> bool:
        """Delete the ledger if it records nothing, on the version this pass read (a ledger another
        replica wrote to since is kept); False if it was kept. A pool that comes back, or a replica
        that counted no ledger, creates it afresh: a create of one that exists conflicts, as ever."""
        with self._cond:
            base = self._base.get(name)
            if base is None or base.get("data") or name in self._busy or self._pending.get(name):
                return False
            self._busy.add(name)
        retired = False
        try:
            self.api.delete_configmap(self.namespace, base)
            retired = True
        except NotFoundError:
            retired = True  # another replica retired it
        except KubeError as error:  # ConflictError included: written to since
            log.info("keeping ledger %s: %s", name, error)
        finally:
            with self._cond:
                self._busy.discard(name)
                if retired:
                    self._base.pop(name, None)
                self._cond.notify_all()
        if retired:
            self.on_delete(base)
        return retired

    def _commit(self, name: str, pool: PoolId, batch: list[_Change]) -> bool:
        with self._cond:
            base = self._base.get(name)
        data = dict((base or {}).get("data") or {})
        for change in batch:
            for uid in change.remove:
                data.pop(uid, None)
            for uid, entry in change.add.items():
                if data.get(uid, entry.encode()) != entry.encode() and not _reservation(data[uid]):
                    log.info("ledger %s: claim %s was decided elsewhere", name, entry.claim)
                    self.on_failure()
                    return False
                data[uid] = entry.encode()
        if base is not None and data == (base.get("data") or {}):
            return True
        try:
            written = self._write(name, pool, base, data)
        except ConflictError:
            log.info("ledger %s changed since this replica read it", name)
            self.on_failure()
            return False
        except KubeError as error:
            log.warning("cannot write ledger %s: %s", name, error)
            self.on_failure()
            return False
        with self._cond:
            self._base[name] = written
        self.on_write(written)
        return True

    def _write(self, name: str, pool: PoolId, base: dict[str, Any] | None, data: dict[str, str]) -> dict[str, Any]:
        if base is not None:
            return self.api.replace_ledger(self.namespace, {**base, "data": data})
        metadata = {
            "name": name,
            "namespace": self.namespace,
            "labels": {LEDGER_LABEL: "true"},
            "annotations": {POOL_ANNOTATION: "/".join(pool)},
        }
        body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}
        return self.api.create_ledger(self.namespace, body)  # exists already: a conflict, as for a replace
