"""What is already allocated: devices in exclusive use, capacity consumed on shared devices, and
the counters they draw. Built from the claims' allocation results; the allocator adds to it."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from driver.allocator.model import Device, DeviceId
from driver.allocator.pools import Pool
from driver.common.quantity import Amount, QuantityError, parse_quantity


@dataclass
class AllocatedState:
    # Devices in exclusive use, with how many results hold each: a device reserved for a pending
    # claim (the controller's ledger) while the pods it was freed from still hold it counts twice,
    # and stays held until both are released.
    exclusive: Counter[DeviceId] = field(default_factory=Counter)
    shared: dict[DeviceId, dict[str, Amount]] = field(default_factory=dict)  # consumed capacity
    share_count: dict[DeviceId, int] = field(default_factory=lambda: defaultdict(int))

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

    def add_result(self, result: dict[str, Any]) -> None:
        if result.get("adminAccess"):
            return  # admin access never takes a device from others
        device = (result.get("driver", ""), result.get("pool", ""), result.get("device", ""))
        if result.get("shareID") is None:
            self.exclusive[device] += 1
            return
        consumed = self.shared.setdefault(device, {})
        self.share_count[device] += 1
        for name, value in (result.get("consumedCapacity") or {}).items():
            try:
                consumed[name] = consumed.get(name, 0) + parse_quantity(value)
            except QuantityError:
                continue  # the API server validated it; an unreadable entry cannot be counted

    def remove_result(self, result: dict[str, Any]) -> None:
        if result.get("adminAccess"):
            return
        device = (result.get("driver", ""), result.get("pool", ""), result.get("device", ""))
        if result.get("shareID") is None:
            self.exclusive[device] -= 1
            if self.exclusive[device] <= 0:
                del self.exclusive[device]
            return
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

    def add_allocation(self, allocation: dict[str, Any] | None) -> None:
        for result in ((allocation or {}).get("devices") or {}).get("results") or ():
            self.add_result(result)

    def remove_allocation(self, allocation: dict[str, Any] | None) -> None:
        for result in ((allocation or {}).get("devices") or {}).get("results") or ():
            self.remove_result(result)

    @classmethod
    def from_allocations(cls, allocations: Iterable[dict[str, Any] | None]) -> AllocatedState:
        state = cls()
        for allocation in allocations:
            state.add_allocation(allocation)
        return state
