"""Opaque device configuration (apiVersion gpu.fgpu.dev/v1alpha1), strictly validated.

  apiVersion: gpu.fgpu.dev/v1alpha1
  kind: ShareConfig          # for MPS and time-sliced shares (GpuConfig: the same, for whole GPUs)
  sharing:
    strategy: MPS            # or TimeSlicing
    mps: {activeThreadPercentage: 50, pinnedMemoryLimit: 8Gi}   # within the allocated capacity
    timeSlicing: {interval: Short}                             # Default | Short | Medium | Long
    tenancy: Namespace       # or Claim, Shared: whose shares may meet on one GPU (the class's only)

  apiVersion: gpu.fgpu.dev/v1alpha1
  kind: MigDeviceConfig      # no parameters yet

Configs from the class come before those of the claim, and later entries win; the time-slice
interval, a setting of the whole GPU, comes from the class's configs only (config_for_request).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from driver.claims.allocation import OpaqueConfig
from driver.claims.refs import ClaimError
from driver.common.quantity import QuantityError, parse_quantity

API_VERSION = "gpu.fgpu.dev/v1alpha1"
KINDS = ("GpuConfig", "ShareConfig", "MigDeviceConfig")
INTERVALS = ("Default", "Short", "Medium", "Long")
Tenancy = Literal["Namespace", "Claim", "Shared"]  # whose shares may meet on a GPU: driver/claims/tenancy.py
TENANCIES: tuple[Tenancy, ...] = get_args(Tenancy)
DEFAULT_TENANCY: Tenancy = "Namespace"
MIN_PINNED_MEMORY = 2**20  # MPS takes the limit in whole megabytes: less would be "0M", no limit


@dataclass(frozen=True)
class DeviceConfig:
    strategy: str | None = None  # MPS | TimeSlicing
    thread_percentage: int | None = None
    pinned_memory_bytes: int | None = None
    interval: str | None = None
    tenancy: Tenancy | None = None


def _fields(value: Any, allowed: set[str], where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ClaimError(f"opaque config: {where} must be an object")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ClaimError(f"opaque config: unknown field {where}.{unknown[0]}")
    return value


def parse_device_config(parameters: Any) -> DeviceConfig:  # anything: what is not an object is an error
    top = _fields(parameters, {"apiVersion", "kind", "sharing"}, "config")
    if top.get("apiVersion") != API_VERSION:
        raise ClaimError(f"opaque config: apiVersion must be {API_VERSION}, got {top.get('apiVersion')!r}")
    if top.get("kind") not in KINDS:
        raise ClaimError(f"opaque config: kind must be one of {', '.join(KINDS)}, got {top.get('kind')!r}")
    if "sharing" not in top:
        return DeviceConfig()
    if top["kind"] == "MigDeviceConfig":
        raise ClaimError("opaque config: field sharing is not valid for MigDeviceConfig")
    sharing = _fields(top["sharing"], {"strategy", "mps", "timeSlicing", "tenancy"}, "sharing")
    strategy = sharing.get("strategy")
    if strategy not in ("MPS", "TimeSlicing"):
        raise ClaimError(f"opaque config: sharing.strategy must be MPS or TimeSlicing, got {strategy!r}")
    config = DeviceConfig(strategy=strategy)
    if "mps" in sharing:
        mps = _fields(sharing["mps"], {"activeThreadPercentage", "pinnedMemoryLimit"}, "sharing.mps")
        percentage = mps.get("activeThreadPercentage")
        if percentage is not None and (type(percentage) is not int or not 1 <= percentage <= 100):  # bool is not
            raise ClaimError(f"opaque config: sharing.mps.activeThreadPercentage must be 1..100, got {percentage!r}")
        memory = None
        if "pinnedMemoryLimit" in mps:
            limit = mps["pinnedMemoryLimit"]
            if isinstance(limit, bool) or not isinstance(limit, str | int):
                raise ClaimError(f"opaque config: sharing.mps.pinnedMemoryLimit must be a quantity, got {limit!r}")
            try:
                memory = int(parse_quantity(limit))
            except QuantityError as err:
                raise ClaimError(f"opaque config: sharing.mps.pinnedMemoryLimit: {err}") from err
            if memory < MIN_PINNED_MEMORY:
                raise ClaimError("opaque config: sharing.mps.pinnedMemoryLimit must be at least 1Mi")
        config = DeviceConfig(strategy, percentage, memory, None)
    if "timeSlicing" in sharing:
        # Absent: whatever the class sets (None), so that a claim's timeSlicing: {} changes nothing.
        interval = _fields(sharing["timeSlicing"], {"interval"}, "sharing.timeSlicing").get("interval")
        if interval is not None and interval not in INTERVALS:
            raise ClaimError(
                f"opaque config: sharing.timeSlicing.interval must be one of {INTERVALS}, got {interval!r}"
            )
        config = DeviceConfig(strategy, config.thread_percentage, config.pinned_memory_bytes, interval)
    if "tenancy" in sharing:
        if sharing["tenancy"] not in TENANCIES:
            raise ClaimError(f"opaque config: sharing.tenancy must be one of {TENANCIES}, got {sharing['tenancy']!r}")
        config = dataclasses.replace(config, tenancy=sharing["tenancy"])
    return config


def config_for_request(configs: tuple[OpaqueConfig, ...], request: str) -> DeviceConfig:
    """The effective config of one request: class configs, then claim configs, later entries win.
    Except the time-slice interval: a setting of the whole GPU, which every claim time-sliced on it
    shares, so only the class's configs set it; a claim's may repeat it, never change it."""
    applicable = [c for c in configs if not c.requests or request in c.requests]
    from_class = _merged(parse_device_config(c.parameters) for c in applicable if c.source == "FromClass")
    from_claim = [parse_device_config(c.parameters) for c in applicable if c.source != "FromClass"]
    class_interval = from_class.interval or "Default"
    for parsed in from_claim:
        if parsed.tenancy is not None:  # a tenant choosing whom it shares a GPU with is no boundary
            raise ClaimError("opaque config: sharing.tenancy is set by the device class only; remove it from the claim")
        if parsed.interval not in (None, class_interval):
            raise ClaimError(
                f"opaque config: sharing.timeSlicing.interval {parsed.interval} differs from the device class's "
                f"{class_interval}: the interval is the whole GPU's, set by the class only; remove it from the claim"
            )
    return _merged([from_class, *from_claim])


def _merged(configs: Iterable[DeviceConfig]) -> DeviceConfig:
    """Configs applied in order: each field set by a later one wins."""
    effective = DeviceConfig()
    for parsed in configs:
        effective = DeviceConfig(
            strategy=parsed.strategy or effective.strategy,
            thread_percentage=parsed.thread_percentage or effective.thread_percentage,
            pinned_memory_bytes=parsed.pinned_memory_bytes or effective.pinned_memory_bytes,
            interval=parsed.interval or effective.interval,
            tenancy=parsed.tenancy or effective.tenancy,
        )
    return effective
