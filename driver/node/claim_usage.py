"""What a prepared claim's device uses at one sample, for right-sizing (pure; docs/rightsizing.md,
"What is measured"): the memory its processes hold, its compute in percent of the whole GPU's SMs,
whether it was at its memory limit, and the size it was given (driver/sizing/sizes.py's Size).

By kind, from what NVML measures:
- a whole GPU: the GPU's memory in use and its utilisation (else its processes' SM utilisation);
- a MIG partition: its MIG device's memory in use; NVML measures no utilisation per partition (nor
  per process in MIG mode), so a partition with a process counts its whole share of the GPU's SMs:
  its compute is never shrunk from a guess;
- an MPS or time-sliced share: the memory and SM utilisation of its own pods' processes (by their
  cgroups); in a MIG partition, where NVML samples no processes, a share with a process counts
  its limit (MPS) or its partition (time-sliced).
Out-of-memory is not reported by NVML (the allocation fails in the process); a device whose
processes hold OOM_FRACTION of its limit or more counts as one: the demand above a limit is not
seen, so sizing must not take the limit for the need.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from driver.inventory.discovery import GpuInfo
from driver.inventory.sharing import MIG_KINDS
from driver.node.state import PreparedDevice
from driver.node.usage import GpuActivity
from driver.sizing.sizes import Size

MIB = 2**20
OOM_FRACTION = 0.98


@dataclass(frozen=True)
class DeviceUse:
    """One device's use at a sample, and its size."""

    size: Size
    memory_mib: int
    compute_percent: float  # of the whole GPU's SMs
    at_memory_limit: bool


def device_size(device: PreparedDevice, share_memory_bytes: int | None) -> Size:
    """The size the device was given: a share's memory (as allocated, else as prepared) and MPS
    compute, a partition's profile."""
    memory = share_memory_bytes if share_memory_bytes is not None else device.mps_memory_bytes
    memory_mib = memory // MIB if memory is not None else None
    profile = device.mig_profile if device.kind in MIG_KINDS else None
    if device.kind in ("whole", "mig"):
        return Size(device.kind, profile=profile)
    compute = device.mps_thread_percentage if device.kind in ("mps", "mig-mps") else None
    return Size(device.kind, memory_mib, compute, profile)


def measure(
    device: PreparedDevice,
    pod_uids: Iterable[str],
    activity: GpuActivity,
    gpu: GpuInfo,
    share_memory_bytes: int | None,
) -> DeviceUse | None:
    """The device's use at this sample (the module's rules); None where NVML did not say (a MIG
    device it does not list, a GPU whose memory it did not read)."""
    size = device_size(device, share_memory_bytes)
    mig_uuid = device.mig_uuid if device.kind in MIG_KINDS else None
    on_device = [p for p in activity.processes if p.mig_uuid == mig_uuid]
    partition = _partition_percent(device, gpu)
    if device.kind in ("whole", "mig"):
        usage = activity.device if device.kind == "whole" else activity.mig.get(mig_uuid or "")
        if usage is None:
            return None
        memory, limit = usage.memory_used_bytes, usage.memory_total_bytes
        if device.kind == "mig":
            compute = partition if on_device else 0.0
        elif usage.gpu_percent is not None:
            compute = float(usage.gpu_percent)
        else:
            compute = float(sum(p.sm_percent or 0 for p in on_device))
    else:
        pods = set(pod_uids)
        own = [p for p in on_device if activity.pod_of_pid.get(p.pid) in pods]
        memory = sum(p.memory_bytes or 0 for p in own)
        limit = _share_limit_bytes(device, size, activity, gpu)
        if mig_uuid is None:
            compute = float(sum(p.sm_percent or 0 for p in own))
        elif not own:
            compute = 0.0
        else:  # MIG mode: NVML samples no processes (the module's rule)
            share = (size.compute_percent or 100) / 100 if device.kind == "mig-mps" else 1.0
            compute = partition * share
    return DeviceUse(
        size=size,
        memory_mib=memory // MIB,
        compute_percent=round(min(100.0, compute), 1),
        at_memory_limit=limit > 0 and memory >= OOM_FRACTION * limit,
    )


def _share_limit_bytes(device: PreparedDevice, size: Size, activity: GpuActivity, gpu: GpuInfo) -> int:
    """What a share's processes can hold: an MPS share its limit, a time-sliced one (accounting
    only) its GPU's or partition's memory."""
    room = gpu.memory_bytes
    if device.kind in MIG_KINDS:
        usage = activity.mig.get(device.mig_uuid or "")
        room = usage.memory_total_bytes if usage is not None else 0
    if device.kind in ("mps", "mig-mps") and size.memory_mib is not None:
        return min(size.memory_mib * MIB, room) if room else size.memory_mib * MIB
    return room


def _partition_percent(device: PreparedDevice, gpu: GpuInfo) -> float:
    """A MIG partition's SMs in percent of its GPU's (100 outside MIG)."""
    if device.kind not in MIG_KINDS or gpu.multiprocessors <= 0:
        return 100.0
    for profile in gpu.mig_profiles:
        if profile.name == device.mig_profile or profile.profile_id == device.mig_profile_id:
            return 100.0 * profile.multiprocessors / gpu.multiprocessors
    return 100.0  # a profile not known: the whole GPU, so that nothing is shrunk from a guess


@dataclass(frozen=True)
class ClaimObservation:
    """A claim's one device at a sample, with what the recorder needs to say whose it is: the claim
    as last read (its annotations, requests) and the pods holding it (name, UID)."""

    claim_uid: str
    namespace: str
    name: str
    request: str
    gpu_product: str
    use: DeviceUse
    pods: tuple[tuple[str, str], ...]
    claim: Mapping[str, Any]
