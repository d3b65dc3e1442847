"""Tenancy of shared GPUs: whose MPS and time-sliced shares may meet on one GPU (or MIG partition).

The shares of one device (`gpu-<i>-mps`, `gpu-<i>-ts`, or the same inside one MIG partition) share
more than the hardware: MPS clients share one control daemon (whoever can reach its socket can
`quit` it, list and end its clients, change its defaults), one /dev/shm and one MPS server (a fatal
fault in one client ends them all), and the server runs as one uid at a time (a client of another
uid waits until the others are done); time-sliced shares share the GPU's memory with nothing but
the address spaces between them. So the shares of one device belong to one tenant at a time,
chosen per DeviceClass by its opaque config (`sharing.tenancy`; a claim's config may not set it):

- Namespace (the default): the claims of one namespace.
- Claim: one claim (and the pods that share it): tenants that do not trust each other within a
  namespace either; each claim then has the device's daemon and /dev/shm to itself.
- Shared: any claims: a single-tenant cluster's choice.

Two claims' shares of one device may meet where the stricter of their two tenancies allows it.
Enforced at prepare, the one place neither scheduler can bypass: under the GPU's lock, against the
claims this node holds or is preparing (conflicts.HeldDevices), a claim of another tenant is
refused, kubelet retries it, and it is prepared once the other tenant's shares are gone (the
daemon stopped, its tmpfs unmounted: the next tenant starts on empty ones).
"""

from __future__ import annotations

from collections.abc import Iterable

from driver.claims.config import Tenancy
from driver.node.state import PreparedClaim, PreparedDevice

LOOSEST_FIRST: tuple[Tenancy, ...] = ("Shared", "Namespace", "Claim")


def may_meet(mine: tuple[PreparedClaim, PreparedDevice], theirs: tuple[PreparedClaim, PreparedDevice]) -> bool:
    """Whether two claims' shares of one device may be prepared side by side."""
    (claim, device), (holder, held) = mine, theirs
    strictest = max(device.tenancy, held.tenancy, key=LOOSEST_FIRST.index)
    if strictest == "Claim":
        return claim.uid == holder.uid
    if strictest == "Namespace":
        return claim.namespace == holder.namespace
    return True


def refusal(claim: PreparedClaim, holders: Iterable[PreparedClaim]) -> str:
    """Why the claim's shares may not join the shares the holding claims have ("" when they may).
    It names no other claim or namespace: the holder is another tenant."""
    for device in claim.devices:
        if not (device.holds and device.traits.shared):
            continue
        for holder in holders:
            for held in holder.devices:
                if held.holds and held.device == device.device and not may_meet((claim, device), (holder, held)):
                    return (
                        f"device {device.device} is shared by another tenant's claims (its shares belong to one "
                        f"{_unit(device, held)} at a time: docs/security.md); kubelet retries, and prepares it "
                        "once they are unprepared"
                    )
    return ""


def _unit(device: PreparedDevice, held: PreparedDevice) -> str:
    return "claim" if "Claim" in (device.tenancy, held.tenancy) else "namespace"
