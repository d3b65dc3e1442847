"""Opaque device configuration (apiVersion gpu.fgpu.dev/v1alpha1), strictly validated.

  apiVersion: gpu.fgpu.dev/v1alpha1
  kind: ShareConfig          # for MPS and time-sliced shares (GpuConfig: the same, for whole GPUs)
  sharing:
    strategy: MPS            # or TimeSlicing
    mps: {activeThreadPercentage: 50, pinnedMemoryLimit: 8Gi}   # within the allocated capacity
    timeSlicing: {interval: Short}                             # Default | Short | Medium | Long

  apiVersion: gpu.fgpu.dev/v1alpha1
  kind: MigDeviceConfig      # no parameters yet

Configs from the class come before those of the claim, and later entries win.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from driver.claims.allocation import OpaqueConfig
from driver.claims.refs import ClaimError
from driver.common.quantity import QuantityError, parse_quantity

API_VERSION = "gpu.fgpu.dev/v1alpha1"
KINDS = ("GpuConfig", "ShareConfig", "MigDeviceConfig")
INTERVALS = ("Default", "Short", "Medium", "Long")
MIN_PINNED_MEMORY = 2**20  # MPS takes the limit in whole megabytes: less would be "0M", no limit


@dataclass(frozen=True)
class DeviceConfig:
    strategy: str | None = None  # MPS | TimeSlicing
    thread_percentage: int | None = None
    pinned_memory_bytes: int | None = None
    interval: str | None = None


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
    sharing = _fields(top["sharing"], {"strategy", "mps", "timeSlicing"}, "sharing")
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
        interval = _fields(sharing["timeSlicing"], {"interval"}, "sharing.timeSlicing").get("interval", "Default")
        if interval not in INTERVALS:
            raise ClaimError(
                f"opaque config: sharing.timeSlicing.interval must be one of {INTERVALS}, got {interval!r}"
            )
        config = DeviceConfig(strategy, config.thread_percentage, config.pinned_memory_bytes, interval)
    return config


def config_for_request(configs: tuple[OpaqueConfig, ...], request: str) -> DeviceConfig:
    """The effective config of one request: class configs, then claim configs, later entries win."""
    ordered = [c for c in configs if c.source == "FromClass"] + [c for c in configs if c.source != "FromClass"]
    effective = DeviceConfig()
    for entry in ordered:
        if entry.requests and request not in entry.requests:
            continue
        parsed = parse_device_config(entry.parameters)
        effective = DeviceConfig(
            strategy=parsed.strategy or effective.strategy,
            thread_percentage=parsed.thread_percentage or effective.thread_percentage,
            pinned_memory_bytes=parsed.pinned_memory_bytes or effective.pinned_memory_bytes,
            interval=parsed.interval or effective.interval,
        )
    return effective
