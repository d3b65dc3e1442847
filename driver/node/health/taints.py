"""GPU faults -> device taints and per-device health (pure).

A fault of a whole GPU taints every device of that GPU (whole, MIG placements, shares). A fault
NVML attributes to a MIG instance taints the devices whose memory overlaps that instance's
slices: the whole GPU and its shares, and the MIG placements that overlap it, not the others.
A fault is in force until the GPU has been healthy for the recovery period after it was last seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from driver.inventory.devices import DeviceTaint, DeviceTarget
from driver.node.health.record import GpuFault
from driver.nvml.geometry import memory_slots

TaintEffect = Literal["NoSchedule", "NoExecute", "None"]
TAINT_DOMAIN = "gpu.fgpu.dev"
UNREACHABLE = f"{TAINT_DOMAIN}/unreachable"
TAINT_KEYS = {"xid": f"{TAINT_DOMAIN}/xid", "ecc": f"{TAINT_DOMAIN}/ecc", "lost": UNREACHABLE, "driver": UNREACHABLE}
# Device faults (driver/hardware), not application errors (13, 31, 43, 45: a kernel's own bug).
DEFAULT_FAULT_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})


@dataclass(frozen=True)
class HealthPolicy:
    fault_xids: frozenset[int] = DEFAULT_FAULT_XIDS
    fault_effect: TaintEffect = "NoSchedule"  # XIDs in fault_xids, double-bit ECC errors
    lost_effect: TaintEffect = "NoExecute"  # a GPU NVML can no longer reach (also: no driver loaded)
    recovery_s: float = 300.0


@dataclass(frozen=True)
class DeviceHealthReport:
    healthy: bool
    message: str = ""


def in_force(fault: GpuFault, now: float, policy: HealthPolicy) -> bool:
    """A device fault (not an application XID) last seen within the recovery period."""
    return now - fault.last_seen < policy.recovery_s and (fault.kind != "xid" or fault.xid in policy.fault_xids)


def affects(fault: GpuFault, target: DeviceTarget) -> bool:
    if fault.gpu_uuid != target.gpu.uuid:
        return False
    if fault.mig is None or target.placement is None:
        return True
    fault_slices = memory_slots(fault.mig.start, fault.mig.size)
    return bool(fault_slices & memory_slots(target.placement.start, target.placement.size))


def taint_of(fault: GpuFault, policy: HealthPolicy) -> DeviceTaint:
    effect = policy.lost_effect if fault.kind in ("lost", "driver") else policy.fault_effect
    value = {"xid": str(fault.xid), "ecc": "double-bit", "lost": "gpu-lost", "driver": "driver-not-loaded"}[fault.kind]
    added = datetime.fromtimestamp(fault.first_seen, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return DeviceTaint(TAINT_KEYS[fault.kind], value, effect, added)


def describe(fault: GpuFault) -> str:
    where = f" in MIG slices {fault.mig.start}-{fault.mig.start + fault.mig.size - 1}" if fault.mig else ""
    what = {
        "xid": f"XID {fault.xid}",
        "ecc": "double-bit ECC error",
        "lost": "GPU unreachable",
        "driver": "NVIDIA driver not loaded",
    }[fault.kind]
    return what + where


def device_taints(
    targets: list[DeviceTarget], faults: list[GpuFault], now: float, policy: HealthPolicy
) -> dict[str, tuple[DeviceTaint, ...]]:
    """Taints per device name, for the devices that have any; one taint per key (the first fault of
    that kind), since a device carries few taints."""
    active = sorted((f for f in faults if in_force(f, now, policy)), key=lambda f: f.first_seen)
    taints: dict[str, tuple[DeviceTaint, ...]] = {}
    for target in targets:
        by_key: dict[str, DeviceTaint] = {}
        for fault in active:
            if affects(fault, target):
                taint = taint_of(fault, policy)
                if taint.effect != "None":
                    by_key.setdefault(taint.key, taint)
        if by_key:
            taints[target.name] = tuple(sorted(by_key.values(), key=lambda t: t.key))
    return taints


def device_health(
    targets: list[DeviceTarget], faults: list[GpuFault], now: float, policy: HealthPolicy
) -> dict[str, DeviceHealthReport]:
    """Every device's health as kubelet hears it: unhealthy while a fault that taints it is in force."""
    active = [f for f in faults if in_force(f, now, policy)]
    report = {}
    for target in targets:
        reasons = [describe(f) for f in active if affects(f, target)]
        report[target.name] = DeviceHealthReport(not reasons, "; ".join(reasons))
    return report
