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
This module is the rule, pure; prepare enforces it (driver/node/tenancy.py: the one place neither
scheduler can bypass) and fgpu's allocator places by it (driver/allocator/state.py records who
holds a device's shares), so that a claim it places does not wait at prepare for another tenant.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from driver.claims.allocation import opaque_configs, parent_request
from driver.claims.config import DEFAULT_TENANCY, Tenancy, config_for_request
from driver.claims.refs import ClaimError


@dataclass(frozen=True, slots=True)
class Tenant:
    """A claim's shares of one device, as the rule sees them."""

    tenancy: Tenancy  # of the class the claim's request for the device is of
    namespace: str
    claim_uid: str


def may_meet(mine: Tenant, theirs: Tenant) -> bool:
    """Whether two claims' shares may be on one device side by side: the stricter tenancy decides
    (Claim, then Namespace, then Shared). Asked on every device the allocator's search tries where
    shares are held: plain comparisons."""
    tenancies = (mine.tenancy, theirs.tenancy)
    if "Claim" in tenancies:
        return mine.claim_uid == theirs.claim_uid
    if "Namespace" in tenancies:
        return mine.namespace == theirs.namespace
    return True


def unit(mine: Tenancy, theirs: Tenancy) -> str:
    """What the shares of a device belong to one of at a time, where these two meet (for messages)."""
    return "claim" if "Claim" in (mine, theirs) else "namespace"


def request_tenancy(entries: Iterable[dict[str, Any]], driver: str, request: str) -> Tenancy:
    """A request's tenancy on `driver`'s devices as prepare reads it, from an allocation's config
    entries (its class's: a claim's may not set it). Configs prepare refuses count as the default:
    such a claim is never prepared at all."""
    try:
        return config_for_request(opaque_configs(entries, driver), parent_request(request)).tenancy or DEFAULT_TENANCY
    except (ClaimError, TypeError, ValueError):  # parameters that are no object fail before validation
        return DEFAULT_TENANCY


def class_tenancy(entries: Iterable[dict[str, Any]], driver: str) -> Tenancy:
    """A device class's tenancy on `driver`'s devices, from its config entries (spec.config)."""
    return request_tenancy(({"source": "FromClass", **entry} for entry in entries), driver, "")
