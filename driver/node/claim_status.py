"""The claim's `status.devices` (KEP-4817, GA in Kubernetes 1.37): what fgpu made of each device.

After a prepare the plugin writes one entry per prepared device: `driver`, `pool`, `device` (and
`shareID` for a share) as in the allocation result, a `Ready` condition, and `data` with what the
workload's owner wants to know (the GPU's UUID; the MIG device's UUID, profile, placement and
instance ids; an MPS share's limits; a time-sliced share's interval). Unprepare removes them.

Written by a PUT of the status subresource in protobuf (KubeApi.write_claim_device_status), field
manager `<driver>/<node>`: the claim as read, with this node's entries (our driver, the node's
pool) replaced and every other byte as stored. Not by server-side apply: kube-apiserver compares
the allocation's opaque configs byte for byte, and an apply re-encodes them, so it was refused
(422 "status.allocation: field cannot be modified once set") for every claim whose allocation
carries a config whose stored JSON is not in Go's canonical form (driver/kube/claim_protobuf.py).
The PUT carries the claim's resourceVersion: the scheduler's or another driver's concurrent write
makes it fail with a conflict (retried at once on a fresh read), never lose their fields. Its
UID is checked on that read: a claim re-created under the same name never gets our entries.

Authorization (kube-apiserver 1.37, pkg/registry/resource/utils.go AuthorizedForDeviceStatus,
gate DRAResourceClaimGranularStatusAuthorization, beta and on): besides `update` on
`resourceclaims/status`, changing a driver's entries needs `associated-node:update` (the request's
verb) on the synthetic `resourceclaims/driver` subresource named after the driver when the caller
is a service account whose token names the node the claim's allocation selects, else
`arbitrary-node:update`. The chart grants only the first, so the apiserver itself keeps a node's
plugin to its own node's claims.

A failed write never fails the prepare: the container runs without it. The reconciler repairs
missing entries of prepared claims from the claim it reads each pass (so a restart loses nothing),
and retries failed clears, which only this process remembers; a clear lost with it is done by the
apiserver when the claim is deallocated (it drops entries of devices no longer allocated). A write
the apiserver refuses (a 4xx other than a conflict or 429: invalid, forbidden) would be refused
again as it is: it is reported once (a Warning Event on the claim, fgpu_claim_status_refusals_total,
a log line) and tried again only once the claim has changed (another resourceVersion).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from driver.claims.refs import ClaimRef
from driver.inventory.sharing import MIG_KINDS
from driver.kube.claim_protobuf import DeviceKey
from driver.kube.client import JsonObject, KubeApi
from driver.kube.errors import ConflictError, KubeError, NotFoundError, RefusedError
from driver.kube.events import object_event
from driver.node import metrics
from driver.node.state import PreparedDevice
from partitioner.mps import CONTAINER_PIPE_DIR

log = logging.getLogger(__name__)

READY = "Ready"
# A PUT that lost a race is tried again at once on a fresh read; past this, the reconciler's next pass.
CONFLICT_ATTEMPTS = 3
REFUSED_EVENT_REASON = "DeviceStatusRefused"


def field_manager(driver: str, node: str) -> str:
    """One manager per node: two plugin instances of a node (rolling update) share its entries."""
    return f"{driver}/{node}"


def device_data(device: PreparedDevice) -> JsonObject:
    """The entry's `data`: facts of the prepared device; fields a record predates are left out."""
    data: JsonObject = {"kind": device.kind, "gpuUUID": device.gpu_uuid, "gpuIndex": device.gpu_index}
    if device.admin_access:
        return {**data, "adminAccess": True}  # the GPU's node only: no instance, limits or interval of its own
    if device.kind in MIG_KINDS:  # a partition, or a share inside one
        data["mig"] = _present(
            uuid=device.mig_uuid,
            profile=device.mig_profile,
            placement=_present(start=device.mig_start, size=device.mig_size),
            gpuInstanceID=device.mig_gi_id,
            computeInstanceID=device.mig_ci_id,
        )
    if device.kind in ("mps", "mig-mps"):
        data["mps"] = _present(
            pinnedMemoryLimitBytes=device.mps_memory_bytes,
            activeThreadPercentage=device.mps_thread_percentage,
            pipeDirectory=CONTAINER_PIPE_DIR,  # where the container finds the daemon
        )
    elif device.kind in ("timeslice", "mig-timeslice"):
        data["timeSlice"] = _present(interval=device.timeslice_interval)
    return data


def _present(**fields: Any) -> JsonObject:
    return {key: value for key, value in fields.items() if value is not None and value != {}}


def ready_condition(driver: str, generation: int, now: datetime) -> JsonObject:
    """metav1.Condition as the apiserver validates it: reason CamelCase, time in whole seconds."""
    return {
        "type": READY,
        "status": "True",
        "reason": "Prepared",
        "message": f"prepared by {driver}",
        "lastTransitionTime": now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "observedGeneration": generation,
    }


def device_entry(driver: str, device: PreparedDevice, generation: int, now: datetime) -> JsonObject:
    entry: JsonObject = {
        "driver": driver,
        "pool": device.pool,
        "device": device.device,
        "conditions": [ready_condition(driver, generation, now)],
        "data": device_data(device),
    }
    if device.share_id:
        entry["shareID"] = device.share_id
    return entry


def entry_key(entry: JsonObject) -> DeviceKey:
    return (entry.get("driver", ""), entry.get("pool", ""), entry.get("device", ""), entry.get("shareID") or "")


def up_to_date(desired: Iterable[JsonObject], claim: JsonObject) -> bool:
    """Whether the claim already shows every desired entry with its data and Ready True (the
    condition's time and generation do not count: rewriting them would be noise)."""
    current = {entry_key(e): e for e in (claim.get("status") or {}).get("devices") or []}
    for entry in desired:
        found = current.get(entry_key(entry))
        if found is None or found.get("data") != entry["data"] or not _ready(found):
            return False
    return True


def _ready(entry: JsonObject) -> bool:
    return any(c.get("type") == READY and c.get("status") == "True" for c in entry.get("conditions") or [])


def claim_generation(claim: JsonObject) -> int:
    return int((claim.get("metadata") or {}).get("generation") or 0)


def resource_version(claim: JsonObject) -> str:
    return str((claim.get("metadata") or {}).get("resourceVersion") or "")


@dataclass(frozen=True)
class Refusal:
    """A write the apiserver refused: the claim's version it was based on, and the server's words."""

    resource_version: str
    cause: str


def refusal_event(ref: ClaimRef, refusal: Refusal, reporter: str, now: datetime) -> JsonObject:
    """The Warning Event on the claim."""
    message = (
        f"{reporter} cannot write status.devices of claim {ref}: {refusal.cause}; tried again when the claim changes"
    )
    metadata = {
        "name": ref.name,
        "namespace": ref.namespace,
        "uid": ref.uid,
        "resourceVersion": refusal.resource_version,
    }
    return object_event("resource.k8s.io/v1", "ResourceClaim", metadata, REFUSED_EVENT_REASON, message, reporter, now)


def _utc_now() -> datetime:
    return datetime.now(UTC)


class ClaimStatusWriter:
    """Writes and clears this node's entries; failures are logged in one line and left to
    `ensure` (entries) or `retry_clears` (removals), which the reconciler calls. A refused write
    waits for the claim to change (`Refusal`)."""

    def __init__(self, api: KubeApi, driver: str, node: str, clock: Callable[[], datetime] = _utc_now) -> None:
        self._api = api
        self._driver = driver
        self._pool = node  # the node's pool is named after it (prepare's rule)
        self.field_manager = field_manager(driver, node)
        self._clock = clock
        self._pending_clears: dict[str, ClaimRef] = {}
        self._refused: dict[str, Refusal] = {}  # by claim UID
        self._reported: dict[str, str] = {}  # claim UID -> the cause its Event gave
        self._guard = threading.Lock()

    def entries(self, devices: Iterable[PreparedDevice], generation: int) -> list[JsonObject]:
        now = self._clock()
        return [device_entry(self._driver, device, generation, now) for device in devices]

    def publish(self, ref: ClaimRef, devices: Iterable[PreparedDevice], generation: int) -> bool:
        with self._guard:
            self._pending_clears.pop(ref.uid, None)  # prepared again: the old clear is moot
        return self._write(ref, self.entries(devices, generation), "writing")

    def ensure(self, ref: ClaimRef, devices: Iterable[PreparedDevice], claim: JsonObject) -> None:
        """Write the entries of a prepared claim unless `claim` (just read) already shows them or
        the apiserver refused them for this very version of the claim."""
        devices = tuple(devices)
        if not up_to_date(self.entries(devices, 0), claim) and not self.waiting(ref, claim):
            self.publish(ref, devices, claim_generation(claim))

    def clear(self, ref: ClaimRef) -> bool:
        if self._write(ref, [], "removing"):
            return True
        with self._guard:
            self._pending_clears[ref.uid] = ref
        return False

    def pending_clears(self) -> list[ClaimRef]:
        with self._guard:
            return list(self._pending_clears.values())

    def refusal(self, uid: str) -> Refusal | None:
        with self._guard:
            return self._refused.get(uid)

    def waiting(self, ref: ClaimRef, claim: JsonObject) -> bool:
        """Whether a write to `claim` (just read) was refused and the claim has not changed since."""
        refused = self.refusal(ref.uid)
        return refused is not None and refused.resource_version == resource_version(claim)

    def retry_clears(self) -> None:
        """Once more each failed removal; one whose claim is gone or re-created is done."""
        for ref in self.pending_clears():
            try:
                current = self._api.get_claim(ref.namespace, ref.name)
            except NotFoundError:
                current = None
            except KubeError as err:
                log.warning("claim %s: cannot read it to remove its status.devices: %s; retrying later", ref, err)
                continue
            gone = current is None or (current.get("metadata") or {}).get("uid") != ref.uid
            if not gone and current is not None and self.waiting(ref, current):  # (not gone: read)
                continue
            if gone or self._write(ref, [], "removing"):
                self._forget(ref)

    def _forget(self, ref: ClaimRef) -> None:
        with self._guard:
            if self._pending_clears.get(ref.uid) is ref:
                del self._pending_clears[ref.uid]
        self._settled(ref)

    def _settled(self, ref: ClaimRef) -> None:
        """A write went through (or has nothing left to do): a later refusal is news again."""
        with self._guard:
            self._refused.pop(ref.uid, None)
            self._reported.pop(ref.uid, None)

    def _ours(self, key: DeviceKey) -> bool:
        return key[0] == self._driver and key[1] == self._pool

    def _write(self, ref: ClaimRef, entries: list[JsonObject], doing: str) -> bool:
        """Make this node's entries `entries`; True when done (a claim that no longer exists
        needs nothing). A conflict is another writer's change: read again and redo ours."""
        for _ in range(CONFLICT_ATTEMPTS):
            try:
                self._api.write_claim_device_status(
                    ref.namespace, ref.name, ref.uid, self._ours, entries, self.field_manager
                )
            except NotFoundError:
                self._settled(ref)
                return True
            except ConflictError:
                continue
            except RefusedError as err:
                self._refuse(ref, err, doing)
                return False
            except KubeError as err:
                log.warning("claim %s: %s its status.devices failed: %s; retrying later", ref, doing, err)
                return False
            self._settled(ref)
            return True
        log.warning(
            "claim %s: %s its status.devices lost %d races in a row; retrying later", ref, doing, CONFLICT_ATTEMPTS
        )
        return False

    def _refuse(self, ref: ClaimRef, err: RefusedError, doing: str) -> None:
        """Park the claim until it changes; one log line and one metric increment a refusal, one
        Event a claim and cause (a claim refused again after a change for the same reason says
        nothing new)."""
        refusal = Refusal(err.resource_version, str(err))
        metrics.record_status_refusal(err.status)
        log.warning(
            "claim %s: %s its status.devices was refused: %s; trying again when the claim changes", ref, doing, err
        )
        with self._guard:
            self._refused[ref.uid] = refusal
            if self._reported.get(ref.uid) == refusal.cause:
                return
            self._reported[ref.uid] = refusal.cause
        event = refusal_event(ref, refusal, self.field_manager, self._clock())
        try:
            self._api.create_event(ref.namespace, event)
        except KubeError as event_err:
            log.warning("claim %s: cannot record an event of the refusal: %s", ref, event_err)
