"""Partition use: what a claim's devices make on the GPUs (MIG partitions, MPS daemons, time-slice
settings), and who uses it. Claims share these (the shares of one partition, the MPS shares of one
GPU): the first user makes them, later ones join, and the last to go destroys, stops or resets
them; who else uses what is read from the prepared claims' records. One GPU's changes at a time
(its lock, taken in GPU order); claims on different GPUs run in parallel.

What each kind of device needs (a MIG instance, an MPS daemon, a time-slice setting) comes from its
traits (driver/inventory/device_kinds.py), never from its name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import pynvml

from driver.claims.refs import ClaimError, ClaimRef, ErrorReason
from driver.common.testhooks import Step, TestHooks
from driver.inventory.devices import DeviceTarget
from driver.node.claim_locks import KeyedLocks
from driver.node.conflicts import overlaps
from driver.node.state import PreparedClaim, PreparedClaims, PreparedDevice
from driver.nvml.session import GpuInstanceRecord
from partitioner.mig import MigError, MigPartitioner, mig_device_nodes
from partitioner.mps import MpsLimits, MpsPartitioner
from partitioner.runner import ToolError
from partitioner.timeslice import TimeSlicer


@dataclass(frozen=True)
class Partitioners:
    mig: MigPartitioner
    mps: MpsPartitioner
    timeslice: TimeSlicer


class PartitionUse:
    """Makes and releases what the claims' devices use on this node's GPUs (`targets`)."""

    def __init__(
        self,
        *,
        targets: Mapping[str, DeviceTarget],
        partitioners: Partitioners,
        claims: PreparedClaims,
        test_hooks: TestHooks,
        proc_root: Path = Path("/proc"),
    ) -> None:
        self._targets = targets
        # A prepared device is made again on its GPU also where the node no longer offers it (a
        # changed sharing config): its pod still runs.
        self._gpus = {target.gpu.uuid: target.gpu for target in targets.values()}
        self.partitioners = partitioners
        self._claims = claims
        self._hooks = test_hooks
        self._proc_root = proc_root
        self._locks = KeyedLocks()  # one GPU's changes at a time

    def gpu_lock(self, gpu_index: int) -> contextlib.AbstractContextManager[None]:
        return self._locks.held(f"gpu/{gpu_index}")

    @contextlib.contextmanager
    def gpu_locks(self, devices: tuple[PreparedDevice, ...]) -> Iterator[None]:
        """The locks of the devices' GPUs, taken in GPU order, so that two claims spanning the same
        GPUs cannot deadlock."""
        with contextlib.ExitStack() as stack:
            for index in sorted({d.gpu_index for d in devices}):
                stack.enter_context(self.gpu_lock(index))
            yield

    def has_gpu(self, gpu_uuid: str) -> bool:
        return gpu_uuid in self._gpus

    # --- make -----------------------------------------------------------------------------------

    def make(self, ref: ClaimRef, device: PreparedDevice, again: bool = False) -> tuple[PreparedDevice, str]:
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
        self._hooks.reached(Step.DEVICE_READY)
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
        self._hooks.reached(Step.PARTITION_MADE)
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
        target = self._targets.get(device.device)
        if target is not None and target.placement is not None:
            return target.placement.profile.name
        return f"profile {device.mig_profile_id}"  # a device the node no longer publishes

    def _timeslice_already_set(self, uid: str, gpu_index: int, interval: str) -> bool:
        """Whether another prepared claim's time-sliced share already set this interval on the GPU."""
        return any(
            d.holds and d.gpu_index == gpu_index and d.timeslice_interval == interval
            for other_uid, c in self._claims.all().items()
            if other_uid != uid and c.state == "PrepareCompleted"
            for d in c.devices
            if d.traits.time_sliced and not d.traits.in_partition  # a whole GPU's time-sliced share
        )

    def stop_partition_daemon(self, device: PreparedDevice, mig_uuid: str) -> None:
        """Stop the MPS daemon of the device's partition that was `mig_uuid` (made again, it has a
        new MIG device)."""
        try:
            self.partitioners.mps.stop(device.gpu_index, mig_uuid, exclusive_gpu=False)
        except ToolError as err:
            raise ClaimError(str(err), reason=_step_reason(device, err)) from err

    # --- what is gone ---------------------------------------------------------------------------

    def partition_gone(self, device: PreparedDevice) -> bool:
        """Whether the device's MIG instance is no longer there (no instance at its placement, or
        another one: a re-created instance has a new UUID)."""
        if not device.traits.in_partition or not device.holds:
            return False
        record = self._find_partition(device)
        return record is None or device.mig_uuid not in {uuid for _, uuid in record.compute_instances}

    def gone(self, device: PreparedDevice) -> str:
        """What of the device's is no longer there, as far as NVML and the host can tell ("": all
        of it; a time-slice interval cannot be read back)."""
        if device.gpu_uuid not in self._gpus:
            return "its GPU is not on this node"
        try:
            if self.partition_gone(device):
                return "its MIG instance is gone"
        except pynvml.NVMLError as err:
            return f"its GPU does not answer NVML ({err})"
        daemon = device.mig_uuid if device.traits.in_partition else device.gpu_uuid
        if device.traits.mps and device.holds and daemon and not self.partitioners.mps.running(daemon):
            return "its MPS daemon is not running"
        return ""

    # --- release --------------------------------------------------------------------------------

    def release(self, claim: PreparedClaim) -> list[str]:
        """Undo what the claim's devices made on the GPUs, keeping what another claim still uses;
        what was done, device by device. Safe to repeat."""
        with self.gpu_locks(claim.devices):
            # Read under the GPU locks: a claim being unprepared no longer holds its GPU, one being
            # prepared already may (its daemon may be up before it is marked completed).
            others = [c for uid, c in self._claims.all().items() if uid != claim.uid and c.state != "UnprepareStarted"]
            return [f"{device.device}: {self._release_or_fail(device, others)}" for device in claim.devices]

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
            if any(d.holds and overlaps(device, d) for c in others for d in c.devices):
                # Prepare refuses such a claim (conflicts.py); a record from before that still must
                # not take the instance from under the other claim's containers.
                return f"MIG {self._profile_name(device)} kept: another claim holds it"
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


def _step_reason(device: PreparedDevice, err: MigError | ToolError) -> ErrorReason:
    """MIG instances and MIG mode are NVML's; anything else that fails is a tool of the device's kind."""
    return "mig" if isinstance(err, MigError) else device.traits.tool_error_reason


def _mps_limits(device: PreparedDevice) -> MpsLimits:
    assert device.mps_memory_bytes is not None and device.mps_thread_percentage is not None
    return MpsLimits(device.mps_memory_bytes, device.mps_thread_percentage)
