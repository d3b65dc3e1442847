"""Tenancy of shared GPUs at prepare: a claim's shares of a device that another tenant's claims
hold shares of are refused (the rule: driver/claims/tenancy.py).

Enforced at prepare, the one place neither scheduler can bypass: under the GPU's lock, against the
claims this node holds or is preparing (conflicts.HeldDevices), a claim of another tenant is
refused, kubelet retries it, and it is prepared once the other tenant's shares are gone (the
daemon stopped, its tmpfs unmounted: the next tenant starts on empty ones).
"""

from __future__ import annotations

from collections.abc import Iterable

from driver.claims.tenancy import Tenant, may_meet, unit
from driver.node.state import PreparedClaim, PreparedDevice


def _tenant(claim: PreparedClaim, device: PreparedDevice) -> Tenant:
    return Tenant(device.tenancy, claim.namespace, claim.uid)


def refusal(claim: PreparedClaim, holders: Iterable[PreparedClaim]) -> str:
    """Why the claim's shares may not join the shares the holding claims have ("" when they may).
    It names no other claim or namespace: the holder is another tenant."""
    for device in claim.devices:
        if not (device.holds and device.traits.shared):
            continue
        for holder in holders:
            for held in holder.devices:
                if (
                    held.holds
                    and held.device == device.device
                    and not may_meet(_tenant(claim, device), _tenant(holder, held))
                ):
                    return (
                        f"device {device.device} is shared by another tenant's claims (its shares belong to one "
                        f"{unit(device.tenancy, held.tenancy)} at a time: docs/security.md); kubelet retries, and "
                        "prepares it once they are unprepared"
                    )
    return ""
