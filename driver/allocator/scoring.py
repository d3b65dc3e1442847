"""Placement scoring: which device, and which node, to try first. Feasibility never depends on it
(the search is exhaustive); only which of the feasible placements is taken.

first-fit: exactly upstream's choice (pool, slice and device order; nodes by name).
fragmentation (default): the placement that least raises the expected fragmentation for the mix
of claims seen (driver/allocator/fragmentation.py); within a node, binpack's device order behind
the GPUs it picked.
binpack: shares go onto GPUs already shared, MIG instances where they block the fewest other
still-possible placements (best fit), and nodes already in use fill up before empty ones, so whole
GPUs and large MIG placements stay free. spread: the opposite, for isolation."""

from __future__ import annotations

from fractions import Fraction

from driver.allocator.allocate import NodeAllocator
from driver.allocator.lifetimes import distance, nearest_first
from driver.allocator.model import Device
from driver.allocator.policies import Policy
from driver.allocator.pools import Pool
from driver.common.quantity import Amount


def counters_fit(device: Device, available: dict[str, dict[str, Amount]], extra: Device | None = None) -> bool:
    """Whether the counters `device` draws are left in `available` (after `extra` drew its own)."""
    for counter_set, counters in device.consumes:
        for name, value in counters.items():
            taken: Amount = 0
            if extra is not None:
                taken = next((c.get(name, 0) for s, c in extra.consumes if s == counter_set), 0)
            if available.get(counter_set, {}).get(name, 0) - taken < value:
                return False
    return True


def _neighbours(pool: Pool, device: Device) -> list[Device]:
    """Devices drawing from the same counter sets (static, so computed once a pool)."""
    if not pool.neighbours:
        by_set: dict[str, list[Device]] = {}
        for d in pool.all_devices:
            for counter_set, _ in d.consumes:
                by_set.setdefault(counter_set, []).append(d)
        for d in pool.all_devices:
            near = {id(n): n for s, _ in d.consumes for n in by_set[s] if n is not d}
            pool.neighbours[id(d)] = list(near.values())
    return pool.neighbours.get(id(device), [])


def device_score(allocator: NodeAllocator, device: Device) -> tuple[int, int, float | Fraction]:
    """(touched first: 0, size of the devices this one would rule out, share of its counters left after it).
    Lower is a tighter fit."""
    pool = allocator.pool_of(device)
    if device.allow_multiple_allocations and allocator.capacity_in_use(device):
        # A share on a GPU already shared draws nothing new; best fit: the least capacity left first.
        used = allocator.state.shared.get(device.id, {})
        shares_left = [1 - used.get(name, 0) / cap.value for name, cap in device.capacity.items() if cap.value]
        return 0, 0, min(shares_left, default=0)
    available = allocator.available_counters(pool)
    total: Amount = 0
    left: Amount = 0
    touched = False
    for counter_set, counters in device.consumes:  # the whole GPU (counter set), not just this device's part
        full = sum(pool.counter_sets.get(counter_set, {}).values(), 0)
        now = sum(available.get(counter_set, {}).values(), 0)
        touched = touched or now < full
        total += full
        left += now - sum(counters.values(), 0)
    ruled_out = sum(  # weighted by size: blocking a large placement costs more than a small one
        sum(len(counters) for _, counters in other.consumes)
        for other in _neighbours(pool, device)
        if not allocator.state.is_allocated(other.id)
        and counters_fit(other, available)
        and not counters_fit(other, available, device)
    )
    return (0 if touched else 1), ruled_out, (left / total if total else 0)


def _takeable(allocator: NodeAllocator, device: Device) -> bool:
    """Cheap pre-check: devices taken, or whose counters are gone, need no score (they go last)."""
    if device.id in allocator.state.exclusive:
        return False
    if device.allow_multiple_allocations and allocator.capacity_in_use(device):
        return True
    return counters_fit(device, allocator.available_counters(allocator.pool_of(device)))


def order_for(policy: Policy, end: float | None = None):  # -> DeviceOrder | None
    """Devices in the policy's order within a node (fragmentation: binpack's, behind the GPUs its
    node choice picked, see fragmentation.py). With `end` (a claim's expected end, lifetimes.py;
    not under spread), the devices that score as the best does (within lifetimes.TOLERANCE of its
    free share) go by how near their shares' expected ends are to it."""
    if policy == "first-fit":
        return None  # upstream's order: pools by name, slices by name, devices as published

    def ordered(allocator: NodeAllocator, devices: list[Device]) -> list[Device]:
        takeable: list[Device] = []
        rest: list[Device] = []
        for device in devices:
            (takeable if _takeable(allocator, device) else rest).append(device)
        scores = {id(d): device_score(allocator, d) for d in takeable}
        if policy != "spread":
            takeable.sort(key=lambda d: scores[id(d)])
            if end is not None:
                takeable = nearest_first(
                    takeable,
                    lambda d: scores[id(d)][:2],
                    lambda d: float(scores[id(d)][2]),
                    lambda d: distance(end, allocator.state.expected_empty((d.id,))),
                )
        else:
            takeable.sort(key=lambda d: (-scores[id(d)][0], scores[id(d)][1], -scores[id(d)][2]))
        return takeable + rest

    return ordered
