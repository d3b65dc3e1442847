"""Consumable capacity: how much of a device's capacity a request consumes (requestPolicy rounding)
and whether it still fits, as the upstream allocator computes it."""

from __future__ import annotations

from driver.allocator.model import Capacity, RequestPolicy
from driver.common.quantity import Amount


def _round_up(requested: Amount, capacity: Capacity) -> Amount:
    policy = capacity.policy
    if policy is None:
        return requested
    if policy.has_range and policy.minimum is not None:
        if requested < policy.minimum:
            return policy.minimum
        if policy.step is None:
            return requested
        steps = -((policy.minimum - requested) // policy.step)  # ceil((requested - min) / step)
        return policy.minimum + steps * policy.step
    if policy.valid_values:
        return next((v for v in policy.valid_values if requested <= v), requested)
    return requested


def consumed_amount(requested: Amount | None, capacity: Capacity) -> Amount:
    """What a request takes: rounded up per the policy; unnamed capacities take the default (or all)."""
    if requested is None:
        policy = capacity.policy
        return policy.default if policy is not None and policy.default is not None else capacity.value
    return _round_up(requested, capacity)


def _violates(amount: Amount, policy: RequestPolicy | None) -> bool:
    if policy is None or (policy.default is not None and amount == policy.default):
        return False
    if policy.has_range:
        if policy.maximum is not None and amount > policy.maximum:
            return True
        minimum = policy.minimum or 0
        return policy.step is not None and (int(amount) - int(minimum)) % int(policy.step) != 0
    if policy.valid_values:
        return amount not in policy.valid_values
    return False


def consumption(requests: dict[str, Amount] | None, capacity: dict[str, Capacity]) -> dict[str, Amount] | None:
    """The capacity a request would consume on a device, or None when the request names a capacity
    the device does not have or an amount its policy forbids."""
    requests = requests or {}
    if any(name not in capacity for name in requests):
        return None
    consumed = {name: consumed_amount(requests.get(name), cap) for name, cap in capacity.items()}
    if any(_violates(consumed[name], cap.policy) for name, cap in capacity.items()):
        return None
    return consumed


def fits(consumed: dict[str, Amount], capacity: dict[str, Capacity], *in_use: dict[str, Amount]) -> bool:
    return all(consumed[name] + sum(u.get(name, 0) for u in in_use) <= cap.value for name, cap in capacity.items())
