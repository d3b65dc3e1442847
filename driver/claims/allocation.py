"""What a ResourceClaim's allocation means for one node: its devices of our driver in the node's pool,
and the opaque configs of our driver (pure: claim JSON in, dataclasses out)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from driver.claims.refs import ClaimError, ClaimRef


@dataclass(frozen=True)
class AllocatedDevice:
    request: str  # the parent request name: a subrequest "req/sub" is reported as "req"
    pool: str
    device: str
    share_id: str | None = None
    consumed_capacity: dict[str, str] = field(default_factory=dict)
    admin_access: bool = False


@dataclass(frozen=True)
class OpaqueConfig:
    source: str  # FromClass or FromClaim
    requests: tuple[str, ...]  # empty: every request
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ClaimAllocation:
    claim: ClaimRef
    devices: tuple[AllocatedDevice, ...]
    configs: tuple[OpaqueConfig, ...]


def parent_request(name: str) -> str:
    return name.split("/", 1)[0]


def allocation_for_node(claim: dict[str, Any], ref: ClaimRef, driver: str, pool: str) -> ClaimAllocation:
    """The devices of `driver` in `pool` allocated to the claim, after checking it is the claim
    kubelet meant and that it is allocated."""
    metadata = claim.get("metadata") or {}
    if metadata.get("uid") != ref.uid:
        raise ClaimError(
            f"UID mismatch: kubelet asked for {ref.uid}, the API server has {metadata.get('uid')} "
            "(the claim was deleted and re-created)",
            reason="not_found",
        )
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError("claim is not allocated", reason="not_allocated")
    results = (allocation.get("devices") or {}).get("results") or []
    ours = [r for r in results if r.get("driver") == driver]
    if not ours:
        raise ClaimError(f"no device of driver {driver} is allocated to this claim", reason="not_allocated")
    local = [r for r in ours if r.get("pool") == pool]
    if not local:
        pools = sorted({str(r.get("pool")) for r in ours})
        raise ClaimError(
            f"the claim's {driver} devices are in pool(s) {', '.join(pools)}, not this node's pool {pool}",
            reason="not_allocated",
        )
    devices = tuple(_allocated_device(result) for result in local)
    configs = opaque_configs((allocation.get("devices") or {}).get("config") or (), driver)
    return ClaimAllocation(claim=ref, devices=devices, configs=configs)


def opaque_configs(entries: Iterable[dict[str, Any]], driver: str) -> tuple[OpaqueConfig, ...]:
    """The opaque configs of `driver` among an allocation's config entries, in order."""
    return tuple(_opaque_config(entry) for entry in entries if (entry.get("opaque") or {}).get("driver") == driver)


def _allocated_device(result: dict[str, Any]) -> AllocatedDevice:
    for key in ("request", "device"):
        if not isinstance(result.get(key), str) or not result[key]:
            raise ClaimError(f"malformed allocation result without {key!r}: {result}")
    return AllocatedDevice(
        request=parent_request(result["request"]),
        pool=result["pool"],
        device=result["device"],
        share_id=result.get("shareID"),
        consumed_capacity=dict(result.get("consumedCapacity") or {}),
        admin_access=bool(result.get("adminAccess")),
    )


def _opaque_config(entry: dict[str, Any]) -> OpaqueConfig:
    return OpaqueConfig(
        source=str(entry.get("source", "")),
        requests=tuple(parent_request(r) for r in entry.get("requests") or []),
        parameters=dict(entry["opaque"].get("parameters") or {}),
    )
