"""Opaque configs of gpu.fgpu.dev as a claim spells them."""

from __future__ import annotations

from typing import Any


def timeslice_interval(interval: str) -> dict[str, Any]:
    """A config entry setting a time-slice interval (a DeviceClass's spec.config[]: a claim may only
    repeat its class's interval)."""
    sharing = {"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}}
    parameters = {"apiVersion": "gpu.fgpu.dev/v1alpha1", "kind": "ShareConfig", "sharing": sharing}
    return {"opaque": {"driver": "gpu.fgpu.dev", "parameters": parameters}}
