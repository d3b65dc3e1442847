"""The claim's `status.devices` (KEP-4817, GA in Kubernetes 1.37): what fgpu made of each device.

After a prepare the plugin writes one entry per prepared device: `driver`, `pool`, `device` (and
`shareID` for a share) as in the allocation result, a `Ready` condition, and `data` with what the
workload's owner wants to know (the GPU's UUID; the MIG device's UUID, profile, placement and
instance ids; an MPS share's limits; a time-sliced share's interval). Unprepare removes them.

Written by server-side apply on the status subresource, field manager `<driver>/<node>`.
`status.devices` is a map list keyed by driver, pool, device and shareID, so an apply owns exactly
the entries it names: other drivers' entries (other managers) are never touched, and applying none
removes ours. The body carries the claim's UID: a claim re-created under the same name is refused
(422, metadata.uid is immutable) rather than given our entries.

Authorization (kube-apiserver 1.37, pkg/registry/resource/utils.go AuthorizedForDeviceStatus,
gate DRAResourceClaimGranularStatusAuthorization, beta and on): besides `patch` on
`resourceclaims/status`, changing a driver's entries needs `associated-node:patch` on the synthetic
`resourceclaims/driver` subresource named after the driver when the caller is a service account
whose token names the node the claim's allocation selects, else `arbitrary-node:patch`. The chart
grants only the first, so the apiserver itself keeps a node's plugin to its own node's claims.

A failed write never fails the prepare: the container runs without it. The reconciler repairs
missing entries of prepared claims from the claim it reads each pass (so a restart loses nothing),
and retries failed clears, which only this process remembers; a clear lost with it is done by the
apiserver when the claim is deallocated (it drops entries of devices no longer allocated).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from driver.kube import JsonObject, KubeApi, KubeError, NotFoundError
from driver.node.claims import ClaimRef
from driver.node.state import PreparedDevice
from driver.sharing import MIG_KINDS
from partitioner.mps import CONTAINER_PIPE_DIR

log = logging.getLogger(__name__)

READY = "Ready"
DeviceKey = tuple[str, str, str, str]  # driver, pool, device, shareID ("" for none): the list's map key


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


def apply_body(ref: ClaimRef, entries: list[JsonObject]) -> JsonObject:
    """The apply configuration: our entries and nothing else (none: ours are removed)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": ref.namespace, "name": ref.name, "uid": ref.uid},
        "status": {"devices": entries},
    }


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


def _utc_now() -> datetime:
    return datetime.now(UTC)


class ClaimStatusWriter:
    """Writes and clears this node's entries; failures are logged in one line and left to
    `ensure` (entries) or `retry_clears` (removals), which the reconciler calls."""

    def __init__(self, api: KubeApi, driver: str, node: str, clock: Callable[[], datetime] = _utc_now) -> None:
        self._api = api
        self._driver = driver
        self.field_manager = field_manager(driver, node)
        self._clock = clock
        self._pending_clears: dict[str, ClaimRef] = {}
        self._guard = threading.Lock()

    def entries(self, devices: Iterable[PreparedDevice], generation: int) -> list[JsonObject]:
        now = self._clock()
        return [device_entry(self._driver, device, generation, now) for device in devices]

    def publish(self, ref: ClaimRef, devices: Iterable[PreparedDevice], generation: int) -> bool:
        with self._guard:
            self._pending_clears.pop(ref.uid, None)  # prepared again: the old clear is moot
        return self._apply(ref, self.entries(devices, generation), "writing")

    def ensure(self, ref: ClaimRef, devices: Iterable[PreparedDevice], claim: JsonObject) -> None:
        """Write the entries of a prepared claim unless `claim` (just read) already shows them."""
        devices = tuple(devices)
        if not up_to_date(self.entries(devices, 0), claim):
            self.publish(ref, devices, claim_generation(claim))

    def clear(self, ref: ClaimRef) -> bool:
        if self._apply(ref, [], "removing"):
            return True
        with self._guard:
            self._pending_clears[ref.uid] = ref
        return False

    def pending_clears(self) -> list[ClaimRef]:
        with self._guard:
            return list(self._pending_clears.values())

    def retry_clears(self) -> None:
        """Once more each failed removal; one whose claim is gone or re-created is done."""
        for ref in self.pending_clears():
            try:
                current = self._api.get_claim(ref.namespace, ref.name)
                done = (current.get("metadata") or {}).get("uid") != ref.uid or self._apply(ref, [], "removing")
            except NotFoundError:
                done = True
            except KubeError as err:
                log.warning("claim %s: cannot read it to remove its status.devices: %s; retrying later", ref, err)
                continue
            if done:
                with self._guard:
                    if self._pending_clears.get(ref.uid) is ref:
                        del self._pending_clears[ref.uid]

    def _apply(self, ref: ClaimRef, entries: list[JsonObject], doing: str) -> bool:
        """One apply; True when done (a claim that no longer exists needs nothing)."""
        try:
            self._api.apply_claim_status(ref.namespace, ref.name, apply_body(ref, entries), self.field_manager)
        except NotFoundError:
            return True
        except KubeError as err:
            log.warning("claim %s: %s its status.devices failed: %s; retrying later", ref, doing, err)
            return False
        return True
