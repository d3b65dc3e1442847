"""A claim's plan: its allocation on this node checked against the node's devices and the claim's
opaque config, and described as the record prepare journals before any side effect."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from driver.claims.allocation import AllocatedDevice, ClaimAllocation
from driver.claims.config import DEFAULT_TENANCY, config_for_request
from driver.claims.refs import ClaimError
from driver.common.quantity import QuantityError, parse_quantity
from driver.inventory.device_kinds import KIND_TRAITS
from driver.inventory.devices import MPS_DEFAULT_COMPUTE, SHARE_DEFAULT_MEMORY, DeviceTarget
from driver.node.cdi import CdiWriter
from driver.node.state import PreparedClaim, PreparedDevice


@dataclass(frozen=True)
class ClaimPlanner:
    """Plans claims on this node's devices (`targets`, in the node's pool)."""

    pool: str
    targets: Mapping[str, DeviceTarget]
    cdi: CdiWriter  # the devices' CDI names
    owner: str  # the plugin instance that records the plan

    def plan(self, allocation: ClaimAllocation) -> PreparedClaim:
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
            devices.append(device if device.admin_access else _configure(device, target, results, allocation))
        return PreparedClaim(ref.uid, ref.namespace, ref.name, tuple(devices), state="PrepareStarted", owner=self.owner)


def _configure(
    device: PreparedDevice, target: DeviceTarget, results: list[AllocatedDevice], allocation: ClaimAllocation
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
    if kind.shared:  # whose shares may meet this one's on the device (tenancy.py)
        device = replace(device, tenancy=config.tenancy or DEFAULT_TENANCY)
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
            raise ClaimError(f"device {device.device} is a time-sliced share; its config asks for {config.strategy}")
        if kind.in_partition and config.interval not in (None, "Default"):
            # The interval is a setting of the whole GPU, which other partitions share.
            raise ClaimError(
                f"device {device.device} is a time-sliced share of a MIG partition, whose interval cannot be "
                f"set (it is the GPU's); remove sharing.timeSlicing.interval {config.interval}"
            )
        return replace(device, timeslice_interval=config.interval or "Default")
    return device


def _within(limit: int | None, allocated: int, field: str, capacity: str) -> int:
    """A config limit may lower what the claim was allocated, never raise it."""
    if limit is None:
        return allocated
    if limit > allocated:
        raise ClaimError(f"opaque config: {field} {limit} exceeds the allocated {capacity} {allocated}")
    return limit


def _quantity(value: str | None, default: int) -> int:
    if value is None:
        return default
    try:
        return int(parse_quantity(value))
    except QuantityError as err:
        raise ClaimError(f"allocation: consumed capacity: {err}") from err
