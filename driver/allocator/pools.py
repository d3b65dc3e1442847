"""Which devices a node can use: pools at their highest generation, complete and valid only,
as the upstream allocator gathers them (pools sorted by driver and name, slices by name)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from driver.allocator.model import Device, NodePlacement, Slice
from driver.common.quantity import Amount


@dataclass(frozen=True)
class Node:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Pool:
    driver: str
    name: str
    devices: list[Device] = field(default_factory=list)  # the devices this node can use, in order
    all_devices: list[Device] = field(default_factory=list)  # every device of the pool (for counters)
    counter_sets: dict[str, dict[str, Amount]] = field(default_factory=dict)
    incomplete: bool = False
    invalid: str = ""  # why the pool cannot be used
    neighbours: dict[int, list[Device]] = field(default_factory=dict)  # id(device) -> same counter sets
    selector_outcomes: dict[str, tuple[bool | str, ...]] = field(default_factory=dict)  # expression -> per device
    _by_name: dict[str, Device] = field(default_factory=dict)

    @property
    def id(self) -> tuple[str, str]:
        return self.driver, self.name

    def device_index(self) -> dict[str, Device]:
        if not self._by_name:
            self._by_name.update((d.id[2], d) for d in self.all_devices)
        return self._by_name


def _requirement_matches(requirement: dict[str, Any], value: str | None) -> bool:
    operator, values = requirement.get("operator"), requirement.get("values") or []
    if operator == "In":
        return value is not None and value in values
    if operator == "NotIn":
        return value is None or value not in values
    if operator == "Exists":
        return value is not None
    if operator == "DoesNotExist":
        return value is None
    if operator in ("Gt", "Lt") and value is not None and len(values) == 1:
        mine, bound = decimal_integer(value), decimal_integer(values[0])
        if mine is None or bound is None:
            return False
        return mine > bound if operator == "Gt" else mine < bound
    return False


def decimal_integer(value: Any) -> int | None:
    """A label or taint value as the integer Kubernetes compares (Gt/Lt), or None."""
    try:
        return int(str(value), 10)
    except ValueError:
        return None


def selector_matches(selector: dict[str, Any], node: Node) -> bool:
    """A core/v1 NodeSelector (component-helpers nodeaffinity.go): any term matches when all its
    requirements do; an empty term matches nothing."""
    for term in selector.get("nodeSelectorTerms") or ():
        expressions = term.get("matchExpressions") or ()
        fields = term.get("matchFields") or ()
        if not expressions and not fields:
            continue
        if all(_requirement_matches(r, node.labels.get(r.get("key", ""))) for r in expressions) and all(
            _requirement_matches(r, node.name if r.get("key") == "metadata.name" else None) for r in fields
        ):
            return True
    return False


def placement_matches(placement: NodePlacement, node: Node) -> bool:
    if placement.node_name:
        return placement.node_name == node.name
    if placement.all_nodes:
        return True
    if placement.node_selector is not None:
        return selector_matches(placement.node_selector, node)
    return False


def _slice_targets(slice_: Slice, node: Node) -> bool:
    if slice_.per_device_placement:
        return any(placement_matches(d.placement, node) for d in slice_.devices)
    return placement_matches(slice_.placement, node)


def gather_pools(slices: Iterable[Slice], node: Node) -> list[Pool]:
    """The pools `node` sees. A pool whose newest generation has fewer slices than it announces is
    incomplete; one with duplicate devices or unknown counters is invalid (with the reason)."""
    by_pool: dict[tuple[str, str], list[Slice]] = defaultdict(list)
    for slice_ in slices:
        by_pool[slice_.driver, slice_.pool].append(slice_)
    pools = []
    for (driver, name), pool_slices in by_pool.items():
        newest = max(s.generation for s in pool_slices)
        current = sorted((s for s in pool_slices if s.generation == newest), key=lambda s: s.name)
        targeting = [s for s in current if _slice_targets(s, node)]
        if not targeting:
            continue
        pool = Pool(driver, name)
        if len(current) != current[0].slice_count:
            pool.incomplete = True
        else:
            _fill_pool(pool, current, targeting, node)
        pools.append(pool)
    return sorted(pools, key=lambda p: p.id)


def _fill_pool(pool: Pool, current: list[Slice], targeting: list[Slice], node: Node) -> None:
    targeting_names = {s.name for s in targeting}
    seen: set[str] = set()
    for slice_ in current:
        for name, counters in slice_.counter_sets.items():
            if name in pool.counter_sets:
                pool.invalid = f"duplicate counter set name {name}"
            pool.counter_sets[name] = counters
        if slice_.counter_sets:
            continue
        for device in slice_.devices:
            pool.all_devices.append(device)
            if slice_.name not in targeting_names:
                continue
            if device.id[2] in seen:
                pool.invalid = pool.invalid or f"duplicate device name {device.id[2]}"
            seen.add(device.id[2])
            if not slice_.per_device_placement or placement_matches(device.placement, node):
                pool.devices.append(device)
    for device in pool.all_devices:
        for counter_set, counters in device.consumes:
            if counter_set not in pool.counter_sets:
                pool.invalid = pool.invalid or f"counter set {counter_set} not found"
            elif any(c not in pool.counter_sets[counter_set] for c in counters):
                pool.invalid = pool.invalid or f"counter not found in counter set {counter_set}"
    if pool.invalid:
        pool.devices.clear()
