"""Prepare again: a claim prepared before, whose record (the checkpoint) says what it was prepared
with, checked and made again where that is gone. A reboot or a GPU reset destroys MIG instances
and clears MPS daemons, compute modes, time-slice settings and CDI specs; the claim's pod may
still run, and kubelet asks to prepare it again, or start-up recovery and the health monitor
check it before kubelet asks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import pynvml

from driver.claims.refs import ClaimError, ClaimRef
from driver.kube.client import KubeApi
from driver.kube.errors import KubeError
from driver.node.cdi import CdiWriter
from driver.node.claim_result import ClaimResult
from driver.node.claim_status import ClaimStatusWriter
from driver.node.partition_use import PartitionUse
from driver.node.state import PreparedClaim, PreparedClaims, PreparedDevice

log = logging.getLogger(__name__)


class PrepareAgain:
    """Checks prepared claims and makes again what of theirs is gone."""

    def __init__(
        self,
        *,
        api: KubeApi,
        claims: PreparedClaims,
        cdi: CdiWriter,
        status: ClaimStatusWriter,
        partition_use: PartitionUse,
        undo: Callable[[PreparedClaim], str],
    ) -> None:
        """`undo`: releases a claim whole (journaled, as an unprepare does); returns what it released."""
        self._api = api
        self._claims = claims
        self._cdi = cdi
        self._status = status
        self._use = partition_use
        self._undo = undo

    def check(self, ref: ClaimRef) -> ClaimResult:
        """A claim the record says is prepared, checked and made again where it is gone."""
        existing = self._claims.get(ref.uid)  # again under the claim's lock: kubelet may have unprepared it
        if existing is None or existing.state != "PrepareCompleted":
            return ClaimResult(summary="no longer prepared, nothing checked")
        return self.prepare(ref, existing)

    def gpus_missing_partitions(self) -> set[int]:
        """GPUs on which a prepared claim's MIG instance is no longer there (its placement empty, or
        another instance's UUID): reset since, without an event to say so. Read only; a GPU NVML
        cannot reach is the health monitor's."""
        missing: set[int] = set()
        for claim in self._claims.all().values():
            for device in claim.devices:
                if claim.state != "PrepareCompleted" or device.gpu_index in missing:
                    continue
                try:
                    if self._use.partition_gone(device):
                        missing.add(device.gpu_index)
                except pynvml.NVMLError:
                    continue
        return missing

    def prepare(self, ref: ClaimRef, existing: PreparedClaim) -> ClaimResult:
        """A claim prepared before: what it recorded may be gone. Each device is made again where it
        is gone: its MIG instance at the same placement (a new UUID and new capability device
        nodes: the old instance ids may be another claim's by now), its MPS daemon, its interval;
        the record, the CDI spec and the claim's status follow. Where it cannot be, the claim is
        released whole (nothing half-made stays) and the error says why; kubelet's retry then
        prepares it afresh from its allocation."""
        gone = ""
        try:
            with self._use.gpu_locks(existing.devices):
                gone = "; ".join(f"{d.device}: {why}" for d in existing.devices if (why := self._use.gone(d)))
                made = [self._make_again(ref, device) for device in existing.devices]
        except ClaimError as err:
            if not gone:  # all of it is there (its containers may use it): a failure to check is no reason to undo
                message = f"checking what it was prepared with failed: {err}; kept as it is"
                raise ClaimError(message, err.reason) from err
            try:
                released = f"released what it held ({self._undo(existing)})"
                self._status.clear(ref)
            except (ClaimError, pynvml.NVMLError) as undo_err:  # kubelet's retry undoes it first (its record says)
                released = f"releasing what it held failed too: {undo_err}"
            raise ClaimError(
                f"it was prepared before and what it was prepared with is gone ({gone}: a reboot or a GPU reset) "
                f"and cannot be made again: {err}; {released}",
                reason=err.reason,
            ) from err
        devices = tuple(device for device, _ in made)
        if devices != existing.devices:
            self._claims.commit(prepared=[replace(existing, devices=devices)])
        if devices != existing.devices or not self._cdi.spec_path(ref.uid).exists():
            self._cdi.write(ref.uid, [d.cdi_device() for d in devices])
        if devices != existing.devices:
            self._publish_status(ref, devices)
        checked = "; ".join(f"{device.device}: {done}" for device, done in made)
        return ClaimResult(devices=devices, summary=f"already prepared, checked: {checked}")

    def _make_again(self, ref: ClaimRef, device: PreparedDevice) -> tuple[PreparedDevice, str]:
        if not self._use.has_gpu(device.gpu_uuid):
            raise ClaimError(f"device {device.device}: its GPU {device.gpu_uuid} is no longer on this node")
        made, done = self._use.make(ref, device, again=True)
        if device.traits.mps and device.traits.in_partition and device.mig_uuid and made.mig_uuid != device.mig_uuid:
            # The old partition's daemon serves a MIG device that no longer exists.
            self._use.stop_partition_daemon(device, device.mig_uuid)
        if device.traits.in_partition and made.mig_uuid != device.mig_uuid:
            done = f"made again (was {device.mig_uuid}): {done}"
        return made, done

    def _publish_status(self, ref: ClaimRef, devices: tuple[PreparedDevice, ...]) -> None:
        """The claim's status with what was made again; best effort, the reconciler repairs it."""
        try:
            claim = self._api.get_claim(ref.namespace, ref.name)
        except KubeError as err:
            log.warning("claim %s: cannot read it to update its status.devices: %s; the reconciler will", ref, err)
            return
        self._status.ensure(ref, devices, claim)
