"""Prepare and unprepare: what kubelet's NodePrepareResources / NodeUnprepareResources mean here.

Independent of gRPC: the plugin services translate messages to and from these calls. Every claim
of a batch gets its own result; an error names the claim and the reason and leaves the state of
every other claim alone.

Locking, outermost first: the node's claim lock (claim_locks.NodeClaimLock: one plugin instance's
claim operations at a time, during a rolling update), the claim's own lock (one operation on a
claim at a time: kubelet retries while a call runs), then the locks of the claim's GPUs in index
order (one GPU's changes at a time; claims on different GPUs run in parallel).

Each step is journaled before its side effect (state.py): the claim's record (PrepareStarted)
before any MIG instance, MPS daemon or timeslice change; PrepareCompleted after the CDI spec is
written; UnprepareStarted before anything is undone. At start-up, recovery.py rolls back what a
crash left half-prepared, finishes half-done unprepares, and sweeps what no claim owns.

What each kind of device needs (a MIG instance, an MPS daemon, a time-slice setting) comes from its
traits (driver/inventory/device_kinds.py), never from its name.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import pynvml
from kubernetes.utils import parse_quantity

from driver.claims.allocation import AllocatedDevice, ClaimAllocation, allocation_for_node
from driver.claims.config import config_for_request
from driver.claims.refs import ClaimError, ClaimRef, ErrorReason
from driver.common.testhooks import crash_point
from driver.inventory.device_kinds import KIND_TRAITS
from driver.inventory.devices import MPS_DEFAULT_COMPUTE, SHARE_DEFAULT_MEMORY, DeviceTarget
from driver.kube.client import JsonObject, KubeApi, KubeError, NotFoundError
from driver.node import metrics
from driver.node.cdi import CdiWriter
from driver.node.claim_locks import KeyedLocks, NodeClaimLock
from driver.node.claim_status import ClaimStatusWriter, claim_generation
from driver.node.instance_lock import InstanceLock
from driver.node.state import PreparedClaim, PreparedClaims, PreparedDevice
from driver.nvml.session import GpuInstanceRecord
from partitioner.mig import MigError, MigPartitioner, mig_device_nodes
from partitioner.mps import MpsLimits, MpsPartitioner
from partitioner.runner import ToolError
from partitioner.timeslice import TimeSlicer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClaimResult:
    """One claim's outcome of prepare or unprepare (unprepare's has no devices)."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""
    # What was created or destroyed, for the operator's log line; not part of kubelet's answer.
    summary: str = field(default="", compare=False)
    reason: ErrorReason | None = None  # where the error came from, for the metrics


@dataclass(frozen=True)
class Partitioners:
    mig: MigPartitioner
    mps: MpsPartitioner
    timeslice: TimeSlicer


class ClaimPreparer:
    """Prepares and unprepares the claims kubelet names, on this node's devices (`targets`)."""

    def __init__(
        self,
        *,
        driver_name: str,
        node_name: str,
        targets: list[DeviceTarget],
        api: KubeApi,
        claims: PreparedClaims,
        cdi: CdiWriter,
        partitioners: Partitioners,
        instance: InstanceLock,
        node_lock: NodeClaimLock | None = None,
        proc_root: Path = Path("/proc"),
        driver_missing: Callable[[], str] = lambda: "",
    ) -> None:
        """`node_lock`: each claim operation holds it (the plugin process); None where this is the
        only instance (in-process tests). `driver_missing()`: why the NVIDIA driver does not answer
        ("" while it does; the health monitor's finding)."""
        self.driver_name = driver_name
        self.pool = node_name
        # What the preparer works with; start-up recovery (recovery.py) works with the same.
        self.targets = {target.name: target for target in targets}
        # A prepared device is made again on its GPU also where the node no longer offers it (a
        # changed sharing config): its pod still runs.
        self._gpus = {target.gpu.uuid: target.gpu for target in targets}
        self._api = api
        self.claims = claims
        self.cdi = cdi
        self.partitioners = partitioners
        self.instance = instance
        self._node_lock = node_lock
        self._proc_root = proc_root
        self._driver_missing = driver_missing
        self.status = ClaimStatusWriter(api, driver_name, node_name)
        # One claim UID at a time (kubelet retries while a call runs), one GPU's changes at a time.
        self.locks = KeyedLocks()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="claims")

    # --- prepare --------------------------------------------------------------------------------

    def prepare(self, refs: list[ClaimRef]) -> dict[str, ClaimResult]:
        if not refs:  # nothing shared: the liveness self-probe must not wait on the other instance
            return {}
        with self.node_wide():
            return self._each(refs, self._prepare_one, "prepare")

    def _prepare_one(self, ref: ClaimRef) -> ClaimResult:
        ref.validate()
        missing = self._driver_missing()
        if missing:  # nothing can be made or checked; the record and the claim's status stay as they are
            raise ClaimError(
                f"the NVIDIA driver is not loaded on this node ({missing}); kubelet's retry prepares the claim "
                "once it is back",
                reason="driver",
            )
        existing = self.claims.get(ref.uid)
        if existing is not None and existing.state == "PrepareCompleted":
            return self._prepare_again(ref, existing)
        if existing is not None:
            self._undo(existing)  # a half-done attempt: roll it back and start afresh
        try:
            claim = self._api.get_claim(ref.namespace, ref.name)
        except NotFoundError as err:
            raise ClaimError("the claim does not exist in the API server", reason="not_found") from err
        planned = self._plan(allocation_for_node(claim, ref, self.driver_name, self.pool))
        if _needs_journal(planned):
            self.claims.commit(prepared=[planned])
        crash_point("prepare:journaled")
        try:
            with self._gpu_locks(planned.devices):
                made = [self._make_real(ref, device) for device in planned.devices]
            devices = tuple(device for device, _ in made)
            self.cdi.write(ref.uid, [d.cdi_device() for d in devices])
            crash_point("prepare:cdi-written")
            self.claims.commit(prepared=[replace(planned, devices=devices, state="PrepareCompleted")])
        except BaseException as err:
            try:
                self._undo(self.claims.get(ref.uid) or planned)
            except Exception:  # the claim's error stays the original one; recovery retries the undo
                log.exception("rolling back claim %s after %r failed", ref, err)
            raise
        crash_point("prepare:completed")
        self.status.publish(ref, devices, claim_generation(claim))  # best effort: the reconciler repairs it
        return ClaimResult(devices=devices, summary="; ".join(f"{d.device}: {done}" for d, done in made))

    def check_prepared(self, gpu_index: int | None = None) -> dict[str, ClaimResult]:
        """What every prepared claim recorded (or each with a device on one GPU) checked, and made
        again where it is gone, as kubelet's prepare would: at start-up and after a GPU reset, so
        that it is there before kubelet asks and whatever cannot be made again is released."""
        with self.node_wide():
            refs = [
                ClaimRef(claim.namespace, claim.name, uid)
                for uid, claim in self.claims.all().items()
                if claim.state == "PrepareCompleted"
                and (gpu_index is None or any(d.gpu_index == gpu_index for d in claim.devices))
            ]
            return self._each(refs, self._check_one, "prepare")

    def gpus_missing_partitions(self) -> set[int]:
        """GPUs on which a prepared claim's MIG instance is no longer there (its placement empty, or
        another instance's UUID): reset since, without an event to say so. Read only; a GPU NVML
        cannot reach is the health monitor's."""
        missing: set[int] = set()
        for claim in self.claims.all().values():
            for device in claim.devices:
                if claim.state != "PrepareCompleted" or device.gpu_index in missing:
                    continue
                try:
                    if self._partition_gone(device):
                        missing.add(device.gpu_index)
                except pynvml.NVMLError:
                    continue
        return missing

    def _partition_gone(self, device: PreparedDevice) -> bool:
        """Whether the device's MIG instance is no longer there (no instance at its placement, or
        another one: a re-created instance has a new UUID)."""
        if not device.traits.in_partition or not device.holds:
            return False
        record = self._find_partition(device)
        return record is None or device.mig_uuid not in {uuid for _, uuid in record.compute_instances}

    def _gone(self, device: PreparedDevice) -> str:
        """What of the device's is no longer there, as far as NVML and the host can tell ("": all
        of it; a time-slice interval cannot be read back)."""
        if device.gpu_uuid not in self._gpus:
            return "its GPU is not on this node"
        try:
            if self._partition_gone(device):
                return "its MIG instance is gone"
        except pynvml.NVMLError as err:
            return f"its GPU does not answer NVML ({err})"
        daemon = device.mig_uuid if device.traits.in_partition else device.gpu_uuid
        if device.traits.mps and device.holds and daemon and not self.partitioners.mps.running(daemon):
            return "its MPS daemon is not running"
        return ""

    def _check_one(self, ref: ClaimRef) -> ClaimResult:
        existing = self.claims.get(ref.uid)  # again under the claim's lock: kubelet may have unprepared it
        if existing is None or existing.state != "PrepareCompleted":
            return ClaimResult(summary="no longer prepared, nothing checked")
        return self._prepare_again(ref, existing)

    def _prepare_again(self, ref: ClaimRef, existing: PreparedClaim) -> ClaimResult:
        """A claim prepared before: what it recorded may be gone, since a reboot or a GPU reset
        destroys MIG instances and clears MPS daemons, compute modes, time-slice settings and CDI
        specs. Each device is made again where it is gone: its MIG instance at the same placement
        (a new UUID and new capability device nodes: the old instance ids may be another claim's
        by now), its MPS daemon, its interval; the record, the CDI spec and the claim's status
        follow. Where it cannot be, the claim is released whole (nothing half-made stays) and the
        error says why; kubelet's retry then prepares it afresh from its allocation."""
        gone = ""
        try:
            with self._gpu_locks(existing.devices):
                gone = "; ".join(f"{d.device}: {why}" for d in existing.devices if (why := self._gone(d)))
                made = [self._make_again(ref, device) for device in existing.devices]
        except ClaimError as err:
            if not gone:  # all of it is there (its containers may use it): a failure to check is no reason to undo
                message = f"checking what it was prepared with failed: {err}; kept as it is"
                raise ClaimError(message, err.reason) from err
            try:
                released = f"released what it held ({self._undo(existing)})"
                self.status.clear(ref)
            except (ClaimError, pynvml.NVMLError) as undo_err:  # kubelet's retry undoes it first (its record says)
                released = f"releasing what it held failed too: {undo_err}"
            raise ClaimError(
                f"it was prepared before and what it was prepared with is gone ({gone}: a reboot or a GPU reset) "
                f"and cannot be made again: {err}; {released}",
                reason=err.reason,
            ) from err
        devices = tuple(device for device, _ in made)
        if devices != existing.devices:
            self.claims.commit(prepared=[replace(existing, devices=devices)])
        if devices != existing.devices or not self.cdi.spec_path(ref.uid).exists():
            self.cdi.write(ref.uid, [d.cdi_device() for d in devices])
        if devices != existing.devices:
            self._publish_status(ref, devices)
        checked = "; ".join(f"{device.device}: {done}" for device, done in made)
        return ClaimResult(devices=devices, summary=f"already prepared, checked: {checked}")

    def record_answer(self, uids: Iterable[str], answered: bool) -> list[str]:
        """Record whether kubelet got the answer of its prepare call for these claims (not: it
        cancelled the call meanwhile); the prepared ones whose record changed, by name."""
        changed = []
        for uid in uids:
            if (known := self.claims.get(uid)) is None or known.answered == answered:
                continue  # the usual case, read without a lock: nothing to write
            with self.node_wide(), self.locks.held(f"claim/{uid}"):
                claim = self.claims.get(uid)
                if claim is not None and claim.state == "PrepareCompleted" and claim.answered != answered:
                    self.claims.commit(prepared=[replace(claim, answered=answered)])
                    changed.append(f"{claim.namespace}/{claim.name}")
        return changed

    def _make_again(self, ref: ClaimRef, device: PreparedDevice) -> tuple[PreparedDevice, str]:
        if device.gpu_uuid not in self._gpus:
            raise ClaimError(f"device {device.device}: its GPU {device.gpu_uuid} is no longer on this node")
        made, done = self._make_real(ref, device, again=True)
        if device.traits.mps and device.traits.in_partition and device.mig_uuid and made.mig_uuid != device.mig_uuid:
            # The old partition's daemon serves a MIG device that no longer exists.
            try:
                self.partitioners.mps.stop(device.gpu_index, device.mig_uuid, exclusive_gpu=False)
            except ToolError as err:
                raise ClaimError(str(err), reason=_step_reason(device, err)) from err
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
        self.status.ensure(ref, devices, claim)

    def _plan(self, allocation: ClaimAllocation) -> PreparedClaim:
        """Check every allocated device and config, and describe the work, before any side effect."""
        ref = allocation.claim
        by_device: dict[str, list[AllocatedDevice]] = {}
        for allocated in allocation.devices:
            if allocated.device not in self.targets:
                raise ClaimError(
                    f"device {allocated.device!r} is not a device of this node's pool {self.pool}",
                    reason="not_allocated",
                )
            by_device.setdefault(allocated.device, []).append(allocated)
        devices = []
        for name, results in by_device.items():
            target = self.targets[name]
            requests = tuple(dict.fromkeys(r.request for r in results))
            device = PreparedDevice(
                request_names=requests,
                pool=self.pool,
                device=name,
                cdi_ids=(self.cdi.qualified_id(ref.uid, name),),
                share_id=results[0].share_id,
                kind=target.kind,
                gpu_index=target.gpu.index,
                gpu_uuid=target.gpu.uuid,
                admin_access=all(r.admin_access for r in results),
            )
            devices.append(device if device.admin_access else self._configure(device, target, results, allocation))
        return PreparedClaim(
            ref.uid, ref.namespace, ref.name, tuple(devices), state="PrepareStarted", owner=self.instance.id
        )

    def _configure(
        self, device: PreparedDevice, target: DeviceTarget, results: list[AllocatedDevice], allocation: ClaimAllocation
    ) -> PreparedDevice:
        config = config_for_request(allocation.configs, device.request_names[0])
        kind = KIND_TRAITS[target.kind]
        if target.placement is not None:  # a MIG partition, or a share inside one
            device = replace(
                device,
                mig_profile_id=target.placement.profile.profile_id,
                mig_profile=target.placement.profile.name,
                mig_start=target.placement.start,
                mig_size=target.placement.size,
            )
        if kind.mps:
            if config.strategy not in (None, "MPS"):
                raise ClaimError(f"device {device.device} is an MPS share; its config asks for {config.strategy}")
            memory = sum(_quantity(r.consumed_capacity.get("memory"), SHARE_DEFAULT_MEMORY) for r in results)
            threads = sum(_quantity(r.consumed_capacity.get("compute"), MPS_DEFAULT_COMPUTE) for r in results)
            memory = _within(config.pinned_memory_bytes, memory, "sharing.mps.pinnedMemoryLimit", "memory")
            threads = _within(config.thread_percentage, threads, "sharing.mps.activeThreadPercentage", "compute")
            return replace(device, mps_memory_bytes=memory, mps_thread_percentage=min(threads, 100))
        if kind.time_sliced:
            if config.strategy not in (None, "TimeSlicing"):
                raise ClaimError(
                    f"device {device.device} is a time-sliced share; its config asks for {config.strategy}"
                )
            if kind.in_partition and config.interval not in (None, "Default"):
                # The interval is a setting of the whole GPU, which other partitions share.
                raise ClaimError(
                    f"device {device.device} is a time-sliced share of a MIG partition, whose interval cannot be "
                    f"set (it is the GPU's); remove sharing.timeSlicing.interval {config.interval}"
                )
            return replace(device, timeslice_interval=config.interval or "Default")
        return device

    def _make_real(self, ref: ClaimRef, device: PreparedDevice, again: bool = False) -> tuple[PreparedDevice, str]:
        """Create what the device needs on the GPU; returns it with its CDI edits, and what was done.
        What exists already is kept; `again` (a prepared claim's check) sets the time-slice interval
        even where another claim's record says it is set: it cannot be read back."""
        gpu = self._gpus[device.gpu_uuid]
        gpu_node = f"/dev/nvidia{gpu.minor}"
        if device.admin_access:  # the GPU's node, for monitoring; nothing made or changed on it
            return replace(device, device_nodes=(gpu_node,)), "admin access, nothing created"
        try:
            if device.traits.in_partition:
                device, done = self._make_partition(device, gpu.minor)
            else:
                # Whole-GPU use (whole, MPS, time-slicing) needs MIG mode off: a MIG device left it on.
                released = gpu.mig_capable and self.partitioners.mig.release_mig_mode_if_idle(device.gpu_index)
                device, done = self._make_whole_gpu_use(ref, replace(device, device_nodes=(gpu_node,)), again)
                done += ", MIG mode disabled" if released else ""
        except (MigError, ToolError) as err:
            raise ClaimError(str(err), reason=_step_reason(device, err)) from err
        except pynvml.NVMLError as err:  # the GPU fell off the bus, the driver is being reloaded
            raise ClaimError(f"GPU {device.gpu_index} ({device.gpu_uuid}) does not answer NVML: {err}") from err
        crash_point("prepare:device-ready")
        return device, done

    def _make_partition(self, device: PreparedDevice, gpu_minor: int) -> tuple[PreparedDevice, str]:
        """A MIG device, or a share inside one: the instance at the placement (a share joins it when
        an earlier share of the same device made it), and for an MPS share the partition's daemon."""
        assert device.mig_profile_id is not None and device.mig_start is not None and device.mig_size is not None
        instance = self.partitioners.mig.create(
            device.gpu_index, device.mig_profile_id, device.mig_start, device.mig_size
        )
        device = replace(
            device,
            mig_uuid=instance.uuid,
            mig_gi_id=instance.gi_id,
            mig_ci_id=instance.ci_id,
            device_nodes=mig_device_nodes(gpu_minor, instance, self._proc_root),
        )
        done = f"MIG {self._profile_name(device)} gi {instance.gi_id} ci {instance.ci_id}"
        if not instance.created:  # a later share of the partition, or a prepared claim's check
            done += " joined" if device.traits.shared else " in place"
        done += ", MIG mode enabled" if instance.enabled_mig_mode else ""
        if not device.traits.shared:  # the MIG device itself
            return device, done
        crash_point("prepare:partition-made")
        if device.traits.time_sliced:
            return device, done + ", time-sliced share"
        # The partition's own daemon, bound to its MIG device; the GPU's compute mode is left
        # alone: it is the whole GPU's, and other partitions may not use MPS.
        started = self.partitioners.mps.start(device.gpu_index, instance.uuid, exclusive_gpu=False)
        limits = _mps_limits(device)
        device = replace(device, env=limits.env(), mounts=self.partitioners.mps.mounts(instance.uuid))
        return device, done + f", MPS share {limits}, daemon {'started' if started else 'already running'}"

    def _make_whole_gpu_use(self, ref: ClaimRef, device: PreparedDevice, again: bool) -> tuple[PreparedDevice, str]:
        """A whole GPU (nothing to make), an MPS share (the GPU's daemon) or a time-sliced share."""
        if device.traits.mps:
            started = self.partitioners.mps.start(device.gpu_index, device.gpu_uuid)
            limits = _mps_limits(device)
            device = replace(device, env=limits.env(), mounts=self.partitioners.mps.mounts(device.gpu_uuid))
            return device, f"MPS share {limits}, daemon {'started' if started else 'already running'}"
        if device.traits.time_sliced:
            interval = device.timeslice_interval or "Default"
            if not again and self._timeslice_already_set(ref.uid, device.gpu_index, interval):
                return device, f"timeslice {interval} (already set)"
            self.partitioners.timeslice.set_interval(device.gpu_uuid, interval)
            return device, f"timeslice {interval}"
        return device, "none"

    def _profile_name(self, device: PreparedDevice) -> str:
        target = self.targets.get(device.device)
        if target is not None and target.placement is not None:
            return target.placement.profile.name
        return f"profile {device.mig_profile_id}"  # a device the node no longer publishes

    def _timeslice_already_set(self, uid: str, gpu_index: int, interval: str) -> bool:
        """Whether another prepared claim's time-sliced share already set this interval on the GPU."""
        return any(
            d.holds and d.gpu_index == gpu_index and d.timeslice_interval == interval
            for other_uid, c in self.claims.all().items()
            if other_uid != uid and c.state == "PrepareCompleted"
            for d in c.devices
            if d.traits.time_sliced and not d.traits.in_partition  # a whole GPU's time-sliced share
        )

    # --- unprepare ------------------------------------------------------------------------------

    def unprepare(self, refs: list[ClaimRef]) -> dict[str, str]:
        """Claim UID -> error ("" on success). Unknown claims succeed and touch nothing."""
        if not refs:
            return {}
        with self.node_wide():
            results = self._each(refs, self._unprepare_one, "unprepare")
        return {uid: result.error for uid, result in results.items()}

    def _unprepare_one(self, ref: ClaimRef) -> ClaimResult:
        if not ref.uid:
            raise ClaimError("malformed request: the claim has no uid")
        existing = self.claims.get(ref.uid)
        if existing is None:
            self.cdi.remove(ref.uid)  # a spec without a record is an orphan all the same
            return ClaimResult(summary="not prepared on this node, nothing destroyed")
        missing = self._driver_missing()
        # An unloaded driver took the claim's MIG instances, MPS daemons and GPU settings with it
        # (nothing of it is there once a driver loads again): only the record and the spec are left.
        if missing:
            self._forget(existing)
            summary = f"the NVIDIA driver is not loaded ({missing}): nothing of it left on the GPU"
        else:
            summary = self._undo(existing)
        self.status.clear(ref)  # best effort: the reconciler retries it
        return ClaimResult(summary=summary)

    def undo_left_over(self, ref: ClaimRef) -> ClaimResult:
        """Start-up recovery's unprepare of a claim a crash left half-prepared or half-unprepared:
        kubelet is not asking, so its error is logged (and retried at the next start), not raised."""
        return self._per_claim(ref, lambda: self._unprepare_one(ref))

    def refresh_status(self, ref: ClaimRef, claim: JsonObject) -> None:
        """The reconciler's repair: write the status entries of a prepared claim that `claim` (just
        read) lacks. Under the claim's lock, so an unprepare cannot clear them in between (and the
        node's: the other instance may be unpreparing it)."""
        with self.node_wide(), self.locks.held(f"claim/{ref.uid}"):
            prepared = self.claims.get(ref.uid)
            if prepared is not None and prepared.state == "PrepareCompleted":
                self.status.ensure(ref, prepared.devices, claim)

    def _undo(self, claim: PreparedClaim) -> str:
        """Release everything the claim may hold, then forget it; returns what was released. Safe
        to repeat at any point."""
        if _needs_journal(claim):
            self.claims.commit(prepared=[replace(claim, state="UnprepareStarted", owner=self.instance.id)])
        crash_point("unprepare:journaled")
        with self._gpu_locks(claim.devices):
            # Read under the GPU locks: a claim being unprepared no longer holds its GPU, one being
            # prepared already may (its daemon may be up before it is marked completed).
            others = [c for uid, c in self.claims.all().items() if uid != claim.uid and c.state != "UnprepareStarted"]
            released = [f"{device.device}: {self._release_or_fail(device, others)}" for device in claim.devices]
        crash_point("unprepare:devices-released")
        self.cdi.remove(claim.uid)
        crash_point("unprepare:cdi-removed")
        self.claims.commit(removed=[claim.uid])
        return "; ".join(released)

    def _forget(self, claim: PreparedClaim) -> None:
        """The record and the CDI spec of a claim whose devices are gone."""
        self.cdi.remove(claim.uid)
        self.claims.commit(removed=[claim.uid])

    def _release_or_fail(self, device: PreparedDevice, others: list[PreparedClaim]) -> str:
        try:
            return self._release(device, others)
        except (MigError, ToolError) as err:
            raise ClaimError(f"releasing its devices failed: {err}", reason=_step_reason(device, err)) from err

    def _release(self, device: PreparedDevice, others: list[PreparedClaim]) -> str:
        """Undo what the device made on the GPU; returns what was destroyed."""
        if device.admin_access:
            return "admin access ended, nothing destroyed"
        if device.traits.in_partition and device.traits.shared:
            return self._release_partition_share(device, others)
        if device.traits.in_partition:
            return self._destroy_partition(device, self._find_partition(device))
        still_used = any(
            d.holds and d.kind == device.kind and d.gpu_index == device.gpu_index for c in others for d in c.devices
        )
        if device.traits.mps:
            share = f"MPS share {_mps_limits(device)} ended"
            if still_used:
                return f"{share}, daemon kept for other shares"
            stopped = self.partitioners.mps.stop(device.gpu_index, device.gpu_uuid)
            return f"{share}, daemon {'stopped' if stopped else 'was not running'}, its tmpfs unmounted"
        if device.traits.time_sliced:
            if still_used:
                return "timeslice kept for other shares"
            self.partitioners.timeslice.reset(device.gpu_uuid)
            return "timeslice reset to Default"
        return "none"

    def _release_partition_share(self, device: PreparedDevice, others: list[PreparedClaim]) -> str:
        """The last share of a partition stops the partition's daemon (MPS) and destroys it."""
        if any(d.holds and d.device == device.device for c in others for d in c.devices):
            return "share ended, partition kept for other shares"
        record = self._find_partition(device)
        stopped = ""
        if device.traits.mps:
            # A claim a crash left half-prepared has no MIG UUID in its record yet: the instance has.
            mig_uuid = device.mig_uuid or (
                record.compute_instances[0][1] if record and record.compute_instances else ""
            )
            if mig_uuid:
                was_running = self.partitioners.mps.stop(device.gpu_index, mig_uuid, exclusive_gpu=False)
                stopped = f"MPS daemon {'stopped' if was_running else 'was not running'}, "
        return "last share ended, " + stopped + self._destroy_partition(device, record)

    def _find_partition(self, device: PreparedDevice) -> GpuInstanceRecord | None:
        return self.partitioners.mig.find(device.gpu_index, device.mig_profile_id or 0, device.mig_start or 0)

    def _destroy_partition(self, device: PreparedDevice, record: GpuInstanceRecord | None) -> str:
        if record is None:
            return f"MIG {self._profile_name(device)} already gone"
        self.partitioners.mig.destroy(device.gpu_index, record.gi_id)
        cis = ",".join(str(ci) for ci, _ in record.compute_instances)
        return f"MIG {self._profile_name(device)} gi {record.gi_id} ci {cis} destroyed"

    # --- helpers --------------------------------------------------------------------------------

    def _each(
        self, refs: list[ClaimRef], action: Callable[[ClaimRef], ClaimResult], operation: metrics.Operation
    ) -> dict[str, ClaimResult]:
        """Run each claim of a batch under its own lock; claims on different GPUs run in parallel.
        Each claim done is one INFO line (a failure is one WARNING line, from _per_claim, and
        counted by its reason)."""

        def one(ref: ClaimRef) -> ClaimResult:
            with self.locks.held(f"claim/{ref.uid}"):
                started = time.monotonic()
                result = self._per_claim(ref, lambda: action(ref))
            if result.reason is not None:
                metrics.record_claim_error(operation, result.reason)
            else:
                elapsed_ms = (time.monotonic() - started) * 1000
                log.info("%sd claim %s in %.0f ms: %s", operation, ref, elapsed_ms, result.summary)
            return result

        if len(refs) == 1:
            return {refs[0].uid: one(refs[0])}
        return dict(zip((r.uid for r in refs), self._pool.map(one, refs), strict=True))

    def _per_claim(self, ref: ClaimRef, action: Callable[[], ClaimResult]) -> ClaimResult:
        """Run one claim's work; whatever goes wrong becomes that claim's error, never the batch's."""
        reason: ErrorReason
        try:
            return action()
        except ClaimError as err:
            message, reason = f"claim {ref}: {err}", err.reason
        except KubeError as err:
            message, reason = f"claim {ref}: cannot read the claim from the API server: {err}", "api"
        except OSError as err:  # the CDI spec, the checkpoint, a MIG device node
            message, reason = f"claim {ref}: {err}", "io"
        except Exception as err:
            log.exception("unexpected error for claim %s", ref)
            message, reason = f"claim {ref}: internal error: {err!r}", "internal"
        log.warning("%s", message)
        return ClaimResult(error=message, reason=reason)

    def node_wide(self) -> contextlib.AbstractContextManager[None]:
        """The node's claim lock where there is one: no other plugin instance works on claims meanwhile."""
        return self._node_lock.held() if self._node_lock is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def _gpu_locks(self, devices: tuple[PreparedDevice, ...]) -> Iterator[None]:
        """Changes on one GPU are serialised; claims on different GPUs run in parallel. Locks are
        taken in GPU order, so two claims spanning the same GPUs cannot deadlock."""
        with contextlib.ExitStack() as stack:
            for index in sorted({d.gpu_index for d in devices}):
                stack.enter_context(self.locks.held(f"gpu/{index}"))
            yield


def _step_reason(device: PreparedDevice, err: MigError | ToolError) -> ErrorReason:
    """MIG instances and MIG mode are NVML's; anything else that fails is a tool of the device's kind."""
    return "mig" if isinstance(err, MigError) else device.traits.tool_error_reason


def _mps_limits(device: PreparedDevice) -> MpsLimits:
    assert device.mps_memory_bytes is not None and device.mps_thread_percentage is not None
    return MpsLimits(device.mps_memory_bytes, device.mps_thread_percentage)


def _within(limit: int | None, allocated: int, field: str, capacity: str) -> int:
    """A config limit may lower what the claim was allocated, never raise it."""
    if limit is None:
        return allocated
    if limit > allocated:
        raise ClaimError(f"opaque config: {field} {limit} exceeds the allocated {capacity} {allocated}")
    return limit


def _needs_journal(claim: PreparedClaim) -> bool:
    """Whole GPUs change nothing on the node but the CDI spec, which the start-up sweep covers; MIG
    instances, MPS daemons and timeslice settings must be journaled before they are made."""
    return any(device.traits.changes_gpu and device.holds for device in claim.devices)


def _quantity(value: str | None, default: int) -> int:
    return default if value is None else int(parse_quantity(value))
