"""What a prepared claim's device uses at one sample, for right-sizing (pure; docs/rightsizing.md,
"What is measured"): the memory its processes hold, its compute in percent of the whole GPU's SMs,
whether it was at its memory limit, the size it was given (driver/sizing/sizes.py's Size), and the
memory and SMs that size holds (what it was given less what it used is its waste, on the dashboard).

By kind, from what NVML measures:
- a whole GPU: the GPU's memory in use and its utilisation (else its processes' SM utilisation);
- a MIG partition: its MIG device's memory in use and, with a process on it, its GPU instance's
  SM utilisation where GPM measures it (Hopper and newer, driver/nvml/gpm.py) times its share of
  the GPU's SMs; without GPM (NVML measures no utilisation per partition, nor per process in MIG
  mode) its whole share: its compute is never shrunk from a guess;
- an MPS or time-sliced share: the memory and SM utilisation of its own pods' processes (by their
  cgroups); in a MIG partition, where NVML samples no processes, a share with a process counts
  its limit (MPS) or its partition (time-sliced) of the partition's SMs, or its GPU instance's
  measured utilisation where lower: that is all its shares' use together, never below its own.
Out-of-memory is not reported by NVML (the allocation fails in the process); a device whose
processes hold OOM_FRACTION of its limit or more counts as one: the demand above a limit is not
seen, so sizing must not take the limit for the need.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from driver.inventory.discovery import GpuInfo
from driver.inventory.sharing import MIG_KINDS, DeviceKind
from driver.node.state import PreparedDevice
from driver.node.usage import GpuActivity, instance_percent
from driver.sizing.sizes import Size

MIB = 2**20
OOM_FRACTION = 0.98
TIMESLICE_KINDS: frozenset[DeviceKind] = frozenset({"timeslice", "mig-timeslice"})


@dataclass(frozen=True)
class DeviceUse:
    """One device's use at a sample, and its size."""

    size: Size
    memory_mib: int
    compute_percent: float  # of the whole GPU's SMs
    at_memory_limit: bool
    memory_allocated_mib: int  # what it was given (_allocated_bytes): waste is this less memory_mib
    compute_allocated_percent: float | None  # of the whole GPU's SMs; None: given none of its own (time-sliced)


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
    measured = instance_percent(device, activity)
    if device.kind in ("whole", "mig"):
        usage = activity.device if device.kind == "whole" else activity.mig.get(mig_uuid or "")
        if usage is None:
            return None
        memory, limit = usage.memory_used_bytes, usage.memory_total_bytes
        if device.kind == "mig":
            compute = _partition_compute(partition, 100.0, measured) if on_device else 0.0
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
            ceiling = float(size.compute_percent or 100) if device.kind == "mig-mps" else 100.0
            compute = _partition_compute(partition, ceiling, measured)
    return DeviceUse(
        size=size,
        memory_mib=memory // MIB,
        compute_percent=round(min(100.0, compute), 1),
        at_memory_limit=limit > 0 and memory >= OOM_FRACTION * limit,
        memory_allocated_mib=_allocated_bytes(device, size, limit) // MIB,
        compute_allocated_percent=_allocated_compute_percent(device, size, partition),
    )


def _allocated_bytes(device: PreparedDevice, size: Size, limit: int) -> int:
    """The memory the device was given: its limit, but a time-sliced share its allocation, which
    nothing enforces (its processes can hold the whole room): counting the room would count a GPU's
    memory once per share of it."""
    if device.kind not in TIMESLICE_KINDS or size.memory_mib is None:
        return limit
    allocated = size.memory_mib * MIB
    return min(allocated, limit) if limit else allocated


def _allocated_compute_percent(device: PreparedDevice, size: Size, partition: float) -> float | None:
    """The SMs the device was given, in percent of its whole GPU's: a whole GPU or partition all
    of its own, an MPS share its limit of them; a time-sliced share none (it takes turns with its
    device's other shares)."""
    if device.kind in TIMESLICE_KINDS:
        return None
    share = (size.compute_percent or 100) / 100 if device.kind in ("mps", "mig-mps") else 1.0
    return round(partition * share, 1)


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


def _partition_compute(partition: float, ceiling: float, measured: float | None) -> float:
    """A MIG device's compute in percent of the whole GPU's SMs: `ceiling` percent of its
    partition's, or the GPU instance's measured utilisation where lower (the module's rules)."""
    return partition * min(ceiling, 100.0 if measured is None else measured) / 100


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
