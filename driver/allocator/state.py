"""What is already allocated: devices in exclusive use, capacity consumed on shared devices, the
counters they draw, and whose shares each shared device holds (its tenants: a claim of another
tenant is not placed there, driver/claims/tenancy.py). Built from the claims' allocation results
(a result's tenant from its claim, where the caller names it); the allocator adds to it."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from driver.allocator.model import Claim, Device, DeviceId
from driver.allocator.pools import Pool
from driver.claims.tenancy import Tenant, request_tenancy
from driver.common.flags import DEFAULT_DRIVER_NAME
from driver.common.quantity import Amount, QuantityError, parse_quantity


@dataclass
class AllocatedState:
    # Devices in exclusive use, with how many results hold each: a device reserved for a pending
    # claim (the controller's ledger) while the pods it was freed from still hold it counts twice,
    # and stays held until both are released.
    exclusive: Counter[DeviceId] = field(default_factory=Counter)
    shared: dict[DeviceId, dict[str, Amount]] = field(default_factory=dict)  # consumed capacity
    share_count: dict[DeviceId, int] = field(default_factory=lambda: defaultdict(int))
    # Who holds a shared device's shares: each tenant with its count of shares (a count may go
    # below zero for a while: a release and an add are exact inverses in any order). Only
    # `tenancy_driver`'s devices, whose plugin refuses another tenant's claim at prepare.
    tenants: dict[DeviceId, Counter[Tenant]] = field(default_factory=dict)
    tenancy_driver: str = DEFAULT_DRIVER_NAME
    # When the claims holding shares are expected to end (claim uid -> seconds since the epoch), for
    # those added with a holder that has a hint (lifetimes.py): read through `tenants`.
    ends: dict[str, float] = field(default_factory=dict)
    _end_holds: Counter[str] = field(default_factory=Counter)  # claim uid -> its shares counted with `ends`

    def is_allocated(self, device: DeviceId) -> bool:
        """Allocated at all: its counters are drawn (once, however many shares it has)."""
        return device in self.exclusive or device in self.shared

    def capacity_left(self, device: Device) -> dict[str, Amount]:
        """A shared device's capacity less what its shares consume."""
        used = self.shared.get(device.id, {})
        return {name: cap.value - used.get(name, 0) for name, cap in device.capacity.items()}

    def counters_left(self, pool: Pool) -> dict[str, dict[str, Amount]]:
        """The pool's counters less what its allocated devices draw (a shared device once)."""
        left = {name: dict(counters) for name, counters in pool.counter_sets.items()}
        for device in pool.all_devices:
            if self.is_allocated(device.id):
                for counter_set, counters in device.consumes:
                    for name, value in counters.items():
                        if name in left.get(counter_set, {}):
                            left[counter_set][name] -= value
        return left

    def share_tenant(
        self, result: dict[str, Any], configs: Sequence[dict[str, Any]], namespace: str, uid: str
    ) -> Tenant | None:
        """Whose a result's share is, for the claim (`namespace`, `uid`) whose allocation has the
        result and config entries `configs`; None where the result is no share with a tenant."""
        if result.get("shareID") is None or result.get("adminAccess") or result.get("driver") != self.tenancy_driver:
            return None  # admin access is no tenant: it holds nothing, as prepare counts it
        return Tenant(request_tenancy(configs, self.tenancy_driver, result.get("request") or ""), namespace, uid)

    def _count_tenant(self, device: DeviceId, tenant: Tenant | None, sign: int) -> None:
        if tenant is None:
            return
        held = self.tenants.setdefault(device, Counter())
        held[tenant] += sign
        if not held[tenant]:
            del held[tenant]
            if not held:
                del self.tenants[device]

    def _count_end(self, tenant: Tenant | None, end: float | None, sign: int) -> None:
        """The share's claim's expected end, kept while it holds a share counted with one."""
        if tenant is None or (sign > 0 and end is None) or (sign < 0 and tenant.claim_uid not in self._end_holds):
            return
        uid = tenant.claim_uid
        if end is not None:
            self.ends[uid] = end
        self._end_holds[uid] += sign
        if self._end_holds[uid] <= 0:  # its last share gone (a part may go alone)
            del self._end_holds[uid], self.ends[uid]

    def add_result(self, result: dict[str, Any], tenant: Tenant | None = None, end: float | None = None) -> None:
        """`end`: when the share's claim is expected to end (lifetimes.py), counted with its tenant."""
        if result.get("adminAccess"):
            return  # admin access never takes a device from others
        device = (result.get("driver", ""), result.get("pool", ""), result.get("device", ""))
        if result.get("shareID") is None:
            self.exclusive[device] += 1
            return
        consumed = self.shared.setdefault(device, {})
        self.share_count[device] += 1
        self._count_tenant(device, tenant, +1)
        self._count_end(tenant, end, +1)
        for name, value in (result.get("consumedCapacity") or {}).items():
            try:
                consumed[name] = consumed.get(name, 0) + parse_quantity(value)
            except QuantityError:
                continue  # the API server validated it; an unreadable entry cannot be counted

    def remove_result(self, result: dict[str, Any], tenant: Tenant | None = None) -> None:
        """The reverse of add_result, given the same tenant."""
        if result.get("adminAccess"):
            return
        device = (result.get("driver", ""), result.get("pool", ""), result.get("device", ""))
        if result.get("shareID") is None:
            self.exclusive[device] -= 1
            if self.exclusive[device] <= 0:
                del self.exclusive[device]
            return
        self._count_tenant(device, tenant, -1)
        self._count_end(tenant, None, -1)
        consumed = self.shared.get(device, {})
        for name, value in (result.get("consumedCapacity") or {}).items():
            try:
                consumed[name] = consumed.get(name, 0) - parse_quantity(value)
            except QuantityError:
                continue
        self.share_count[device] -= 1
        if self.share_count[device] <= 0:
            self.shared.pop(device, None)
            self.share_count.pop(device, None)

    def _tenants(self, allocation: dict[str, Any], holder: Claim | None) -> list[tuple[dict[str, Any], Tenant | None]]:
        devices = allocation.get("devices") or {}
        configs = devices.get("config") or ()
        return [
            (result, None if holder is None else self.share_tenant(result, configs, holder.namespace, holder.uid))
            for result in devices.get("results") or ()
        ]

    def add_allocation(self, allocation: dict[str, Any] | None, holder: Claim | None = None) -> None:
        """The allocation's results; with the claim that holds it, its shares' tenants too (and when
        it is expected to end, where it says)."""
        for result, tenant in self._tenants(allocation or {}, holder):
            self.add_result(result, tenant, holder.expected_end if holder is not None else None)

    def remove_allocation(self, allocation: dict[str, Any] | None, holder: Claim | None = None) -> None:
        for result, tenant in self._tenants(allocation or {}, holder):
            self.remove_result(result, tenant)

    def expected_empty(self, devices: Iterable[DeviceId]) -> float | None:
        """When these devices (one GPU's) are expected to hold nothing: the latest expected end of
        their shares' claims. None where that is not known: nothing held (a free GPU), a device
        taken whole, or a share whose claim is not known or gave no hint."""
        latest: float | None = None
        for device in devices:
            if device in self.exclusive:
                return None
            count = self.share_count.get(device, 0)
            if not count:
                continue
            held = self.tenants.get(device)
            if held is None or sum(held.values()) != count:
                return None  # a share counted without its claim (a ledger's, or no tenant)
            for tenant in held:
                end = self.ends.get(tenant.claim_uid)
                if end is None:
                    return None
                latest = end if latest is None else max(latest, end)
        return latest

    @classmethod
    def from_allocations(cls, allocations: Iterable[dict[str, Any] | None]) -> AllocatedState:
        """Allocations whose claims are not known: devices and capacity held, no tenants."""
        state = cls()
        for allocation in allocations:
            state.add_allocation(allocation)
        return state

    @classmethod
    def from_claims(cls, claims: Iterable[Claim], tenancy_driver: str = DEFAULT_DRIVER_NAME) -> AllocatedState:
        """What the claims' allocations hold, their shares' tenants included."""
        state = cls(tenancy_driver=tenancy_driver)
        for claim in claims:
            state.add_allocation(claim.allocation, claim)
        return state
