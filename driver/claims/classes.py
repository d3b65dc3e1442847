"""Which device classes a claim asks for, and which of them are fgpu's (pure: claim JSON in).

fgpu's DeviceClasses are named after the driver: `<driver>` for whole GPUs and `<kind>.<driver>`
for the others (`mps.gpu.fgpu.dev`, `mig-1g.10gb.gpu.fgpu.dev`; the chart's deviceclasses.yaml).
Read by the admission webhook (a pod whose claims ask for fgpu's devices) and by `fgpu plan` (a
class it has no object for is fgpu's by its name)."""

from __future__ import annotations

from typing import Any

# resource.k8s.io/v1's limits: requests a claim, alternatives a firstAvailable request. A claim the
# API server stored keeps to them; a template's spec is read no further either.
MAX_REQUESTS = 32
MAX_ALTERNATIVES = 8


def ours(class_name: str, driver: str) -> bool:
    """Whether a DeviceClass is one of fgpu's by its name."""
    return class_name == driver or class_name.endswith("." + driver)


def requested_classes(claim_spec: Any) -> list[str]:
    """The class names a claim's spec (a template's `spec.spec`) asks for: each request's
    `exactly.deviceClassName` and every `firstAvailable` alternative's; malformed entries skipped."""
    devices = claim_spec.get("devices") if isinstance(claim_spec, dict) else None
    requests = devices.get("requests") if isinstance(devices, dict) else None
    names: list[str] = []
    for request in requests[:MAX_REQUESTS] if isinstance(requests, list) else ():
        if not isinstance(request, dict):
            continue
        exactly, alternatives = request.get("exactly"), request.get("firstAvailable")
        entries = [exactly] if isinstance(exactly, dict) else []
        entries += alternatives[:MAX_ALTERNATIVES] if isinstance(alternatives, list) else []
        names += [
            e["deviceClassName"] for e in entries if isinstance(e, dict) and isinstance(e.get("deviceClassName"), str)
        ]
    return names


def asks_for_ours(claim_spec: Any, driver: str) -> bool:
    """Whether any request of the claim may be served by fgpu's devices."""
    return any(ours(name, driver) for name in requested_classes(claim_spec))
