"""What each team holds over time, and which claims sit idle: pure, fed by the plugin's metrics
(driver/node/metrics.py) with what the node holds and what NVML saw at each sample.

GPU-seconds: each prepared device counts a fraction of its GPU for as long as it is held: a whole
GPU 1, a MIG partition its memory slices over the GPU's 8 (a 3g.40gb at 4 slices 0.5, a 1g.10gb
0.125), an MPS or time-sliced share (also one inside a MIG partition) the memory it was allocated
over the GPU's memory. Held time is sampled: what a sample sees is counted until the next one.

Idle: a device is used at a sample when NVML shows it working, by the most precise measure the
hardware gives for its kind (`is_busy`; a MIG device's GPU instance where GPM measures it, on Hopper
and newer: driver/nvml/gpm.py); a claim's idle time is the time since its last used sample, or
since the plugin first saw it prepared when it has not been used since.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from driver.inventory.sharing import MIG_KINDS, DeviceKind
from driver.node.state import PreparedDevice
from driver.nvml.geometry import GEOMETRY_BY_ID, MEMORY_SLICES
from driver.nvml.session import DeviceUsage, NvmlProcess

# Busy: an SM utilisation at or above this (percent), over NVML's last sample period (1/6 s to 1 s).
BUSY_PERCENT = 5
SHARE_KINDS: tuple[DeviceKind, ...] = ("mps", "timeslice", "mig-mps", "mig-timeslice")
# A pod's cgroup path names its UID, with _ for - under the systemd cgroup driver:
# kubepods-besteffort-pod<uid>.slice (systemd) or kubepods/besteffort/pod<uid> (cgroupfs).
_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")


@dataclass(frozen=True)
class GpuActivity:
    """What NVML saw on a GPU at a sample, and the pod each process runs in (by pid; absent: not
    a pod's, or its cgroup unreadable); with the GPU's and its MIG devices' memory where read
    (for right-sizing, driver/node/claim_usage.py)."""

    gpu_percent: float | None  # None in MIG mode: NVML does not measure it there
    processes: tuple[NvmlProcess, ...] = ()
    pod_of_pid: Mapping[int, str] = field(default_factory=dict)
    device: DeviceUsage | None = None
    mig: Mapping[str, DeviceUsage] = field(default_factory=dict)  # by MIG UUID


@dataclass(frozen=True)
class HeldDevice:
    """One device of a prepared claim at a sample: whose it is, what fraction of a GPU it counts,
    and whether it was used."""

    claim_uid: str
    namespace: str
    claim: str
    pods: tuple[str, ...]
    kind: DeviceKind
    device: str
    gpu_fraction: float
    busy: bool


@dataclass(frozen=True)
class IdleClaimDevice:
    held: HeldDevice
    last_used: float  # wall clock: the last sample it was used at, else when first seen held
    idle_s: float


def pod_uid_of_cgroup(text: str) -> str | None:
    """The pod UID in a /proc/<pid>/cgroup file's text, or None for a process outside pods."""
    found = _POD_UID.search(text)
    return found.group(1).replace("_", "-") if found else None


def gpu_fraction(device: PreparedDevice, gpu_memory_bytes: int, share_memory_bytes: int | None) -> float:
    """How much of a GPU the device counts for (the module's rule). A share whose memory is not
    known (its claim not read yet) counts 0 until it is."""
    if device.kind == "whole":
        return 1.0
    if device.kind == "mig":
        size = device.mig_size
        if size is None and device.mig_profile_id in GEOMETRY_BY_ID:  # records from before mig_size
            size = GEOMETRY_BY_ID[device.mig_profile_id].memory_slices
        return (size or 0) / MEMORY_SLICES
    memory = share_memory_bytes if share_memory_bytes is not None else device.mps_memory_bytes
    return min(1.0, (memory or 0) / gpu_memory_bytes) if gpu_memory_bytes > 0 else 0.0


def instance_percent(device: PreparedDevice, activity: GpuActivity) -> float | None:
    """The SM utilisation of a MIG device's GPU instance, in percent of the instance's SMs, where
    GPM measured it; None outside MIG and where not measured."""
    usage = activity.mig.get(device.mig_uuid or "") if device.kind in MIG_KINDS else None
    return usage.gpu_percent if usage is not None else None


def is_busy(device: PreparedDevice, pod_uids: Iterable[str], activity: GpuActivity) -> bool:
    """Whether the device was used at this sample, by what NVML measures for its kind:
    - a whole GPU: its utilisation, else (not measured) any compute process on it;
    - a MIG partition: any compute process on its MIG device, computing at BUSY_PERCENT or more of
      its GPU instance's SMs where GPM measures that (elsewhere a process that holds the partition
      without computing counts as use);
    - a share: its own pods' processes (by their cgroups): one with per-process SM utilisation at
      or above BUSY_PERCENT, or, where NVML samples none (MIG), one present, in a GPU instance
      at BUSY_PERCENT or more where GPM measures it (the instance idle: all its shares are)."""
    mig_uuid = device.mig_uuid if device.kind in MIG_KINDS else None
    on_device = [p for p in activity.processes if p.mig_uuid == mig_uuid]
    if device.kind == "whole":
        return activity.gpu_percent >= BUSY_PERCENT if activity.gpu_percent is not None else bool(on_device)
    measured = instance_percent(device, activity)
    if measured is not None and measured < BUSY_PERCENT:
        return False
    if device.kind == "mig":
        return bool(on_device)
    pods = set(pod_uids)
    return any(
        activity.pod_of_pid.get(p.pid) in pods and (p.sm_percent is None or p.sm_percent >= BUSY_PERCENT)
        for p in on_device
    )


@dataclass
class _Seen:
    held: HeldDevice
    last_used: float


@dataclass
class UsageLedger:
    """GPU-seconds by namespace and kind since the plugin started, and each held device's last
    use. Fed one sample at a time (`observe`), with a wall clock reading."""

    gpu_seconds: dict[tuple[str, DeviceKind], float] = field(default_factory=dict)
    _seen: dict[tuple[str, str], _Seen] = field(default_factory=dict)
    _last_at: float | None = None

    def observe(self, now: float, held: Iterable[HeldDevice]) -> None:
        """Count what the previous sample saw held up to `now`, then take this sample's view."""
        if self._last_at is not None:
            elapsed = max(0.0, now - self._last_at)  # a clock stepped back counts nothing
            for seen in self._seen.values():
                key = (seen.held.namespace, seen.held.kind)
                self.gpu_seconds[key] = self.gpu_seconds.get(key, 0.0) + seen.held.gpu_fraction * elapsed
        self._last_at = now
        current: dict[tuple[str, str], _Seen] = {}
        for device in held:
            seen_key = (device.claim_uid, device.device)
            before = self._seen.get(seen_key)
            last_used = now if device.busy or before is None else before.last_used
            current[seen_key] = _Seen(device, last_used)
        self._seen = current

    def idle(self, now: float) -> list[IdleClaimDevice]:
        """Every held device with its idle time at `now` (0 when used at the last sample)."""
        return [IdleClaimDevice(s.held, s.last_used, max(0.0, now - s.last_used)) for s in self._seen.values()]
