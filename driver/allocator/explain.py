"""Why a claim does not fit, in words a person can act on, and a per-node picture of what is free."""

from __future__ import annotations

from typing import Protocol

from driver.allocator.allocate import AllocationError, NodeAllocator, compiled_selectors
from driver.allocator.capacity import consumption, fits
from driver.allocator.model import Claim, Device, DeviceClass, Request
from driver.allocator.pools import Pool
from driver.allocator.scoring import counters_fit
from driver.claims.tenancy import unit
from driver.common.quantity import Amount, format_amount


class NodePools(Protocol):
    pools: dict[str, list[Pool]]  # node -> the pools it sees


class ClusterView(Protocol):
    """What explaining reads of the cluster allocator (cluster.py), which calls it on a failure."""

    classes: dict[str, DeviceClass]

    @property
    def snapshot(self) -> NodePools: ...  # read only: cluster.py's Snapshot is one

    def node_allocator(self, node: str) -> NodeAllocator: ...


def _why_not(allocator: NodeAllocator, claim: Claim, request: Request, device: Device) -> str | None:
    """Why `device` cannot serve `request` now, or None if it could."""
    if not request.admin_access and device.id in allocator.state.exclusive:
        return "in use"
    other = allocator.other_tenant(claim, request, device)
    if other is not None:  # named by its kind only: it may be another namespace's
        mine = allocator.classes[request.class_name].tenancy(device.id[0])
        return f"another tenant's shares: they belong to one {unit(mine, other.tenancy)} at a time, docs/security.md"
    consumed = consumption(request.capacity, device.capacity)
    if consumed is None:
        return "its capacity policy does not allow the requested amount"
    if not fits(consumed, device.capacity, allocator.state.shared.get(device.id, {})):
        free = allocator.state.capacity_left(device)
        short = [n for n in consumed if consumed[n] > free[n]]
        return ", ".join(f"{format_amount(free[n])} {n} free, {format_amount(consumed[n])} needed" for n in short)
    pool = allocator.pool_of(device)
    shared_in_use = device.allow_multiple_allocations and allocator.capacity_in_use(device)
    if device.consumes and not shared_in_use and not counters_fit(device, allocator.available_counters(pool)):
        return "its GPU is taken by other devices (shared counters)"
    taints = request.untolerated_taints(device)
    if taints:
        return "tainted " + ", ".join(f"{t.key}={t.value}:{t.effect}" for t in taints)
    return None


def explain(cluster: ClusterView, claim: Claim) -> str:
    """A reason per request: how many devices the class and selectors leave, and the closest miss."""
    lines = []
    for alternatives in claim.requests:
        for request in alternatives:
            lines.append(f"request {request.full_name}: {_explain_request(cluster, claim, request)}")
    if claim.constraints:
        lines.append("constraints: " + ", ".join(c.match_attribute or c.distinct_attribute for c in claim.constraints))
    return "; ".join(lines)


def _explain_request(cluster: ClusterView, claim: Claim, request: Request) -> str:
    if request.class_name not in cluster.classes:
        return f"device class {request.class_name} does not exist"
    wanted = f"device of class {request.class_name}"
    if request.capacity:
        wanted += " with " + ", ".join(f"{n} >= {format_amount(v)}" for n, v in sorted(request.capacity.items()))
    in_class = matching = 0
    closest: list[tuple[Amount, str]] = []
    usable_on: dict[str, int] = {}
    try:
        of_class = compiled_selectors(cluster.classes, Request("", request.class_name), claim)
        of_request = compiled_selectors(cluster.classes, request, claim)
    except AllocationError as error:
        return str(error)
    for node, pools in cluster.snapshot.pools.items():
        allocator = cluster.node_allocator(node)
        for pool in pools:
            for device in pool.devices:
                try:
                    if not allocator.selectable(device, of_class):
                        continue
                    in_class += 1
                    if not allocator.selectable(device, of_request):
                        continue
                except AllocationError as error:
                    return str(error)
                matching += 1
                why = _why_not(allocator, claim, request, device)
                if why is None:
                    usable_on[node] = usable_on.get(node, 0) + 1
                    continue
                free = allocator.state.capacity_left(device)
                score = sum(free.values(), 0) if why != "in use" else -1
                closest.append((score, f"{node}/{device.id[2]} ({why})"))
    need = request.count if request.mode == "ExactCount" else max(matching, 1)
    if in_class == 0:
        return f"no {wanted} on any node: the class matches no device"
    if matching == 0:
        return f"no {wanted} on any node: {in_class} device(s) of the class, none matches the request's selectors"
    best = max(usable_on.items(), key=lambda item: item[1], default=("", 0))
    text = f"no {wanted} free on any one node: {matching} match, {need} needed on one node"
    text += f", at most {best[1]} usable on one ({best[0]})" if best[1] else ", none usable now"
    if closest:
        text += "; closest: " + ", ".join(label for _, label in sorted(closest, reverse=True)[:3])
    return text


def node_picture(cluster: ClusterView, node: str) -> list[str]:
    """Per GPU (counter set): free, partly used with the largest device still placeable, or full."""
    pools = cluster.snapshot.pools.get(node, [])
    allocator = cluster.node_allocator(node)
    lines = []
    for pool in pools:
        lines.extend(_pool_picture(allocator, pool))
    return lines


def _pool_picture(allocator: NodeAllocator, pool: Pool) -> list[str]:
    available = allocator.available_counters(pool)
    lines = []
    for set_name, counters in sorted(pool.counter_sets.items()):
        total = sum(counters.values(), 0)
        free = sum(available[set_name].values(), 0)
        members = [d for d in pool.all_devices if any(s == set_name for s, _ in d.consumes)]
        shares = [d for d in members if allocator.state.shared.get(d.id)]
        if shares:
            parts = []
            for device in shares:
                left = allocator.state.capacity_left(device)
                parts.append(
                    f"{device.id[2]} shared, "
                    + ", ".join(f"{format_amount(v)} {n} free" for n, v in sorted(left.items()))
                )
            lines.append(f"  {set_name}: " + "; ".join(parts))
        elif free == total:
            lines.append(f"  {set_name}: free")
        elif free == 0:
            lines.append(f"  {set_name}: full")
        else:
            placeable = [d for d in members if not allocator.state.is_allocated(d.id) and counters_fit(d, available)]
            largest = max(placeable, key=lambda d: sum(len(c) for _, c in d.consumes), default=None)
            fragment = f", largest placeable: {largest.id[2]}" if largest else ", nothing placeable (fragmented)"
            lines.append(f"  {set_name}: {free}/{total} counters free{fragment}")
    uncounted = [d for d in pool.devices if not d.consumes]
    if uncounted:
        used = sum(allocator.state.is_allocated(d.id) for d in uncounted)
        lines.append(
            f"  {pool.driver}/{pool.name}: {len(uncounted) - used}/{len(uncounted)} devices without counters free"
        )
    return lines
