"""`fgpu status`: per node and GPU, what the claims hold and what is still free. Pure: ResourceSlices
and ResourceClaims (plain dicts as the API returns them) in, a model and its renderings out.

What is free comes from the allocator's own accounting (driver/allocator): the pools as it gathers
them, the allocations as it counts them, the counters they leave and the capacity shares consume.

Fields of `-o json` / `-o yaml` (stable; quantities are Kubernetes quantity strings):
  nodes[]:       name, problem (why the node's devices cannot be shown, else null), gpus[]
  gpus[]:        index, uuid, product, healthy (no taint under `<driver>/`), state (free: nothing
                 allocated; partial: in use, more fits; full: nothing more fits), offers[] (whole, mig, mps,
                 timeslice, mig-mps, mig-timeslice),
                 notOffered (the kinds it holds back and why, e.g. "mig: MIG mode off, switching
                 needs a GPU reset"; null when it offers all it is configured to),
                 wholeFree, migPlaceable[], shares[], claims[], taints[]
  migPlaceable[]: device, profile, start, size: each MIG placement that could still be allocated
  shares[]:      device, kind (mps | timeslice | mig-mps | mig-timeslice), count (shares allocated),
                 open (a new share fits), capacity {name: quantity}, free {name: quantity} (what is
                 left; empty when not open)
  claims[]:      claim (namespace/name), request, pool, device, kind, profile, placementStart,
                 placementSize (MIG), shareID, consumedCapacity {name: quantity}, interval (the
                 time-slice interval the claim's config sets), configError, pods[] (reservedFor)
  taints[]:      key, value, effect, devices[] (the GPU's devices carrying it)
  unpublished[]: claims[] entries on devices no current slice publishes (a node or pool gone, or
                 a pool being updated)
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import yaml

from driver.allocator.capacity import consumption, fits
from driver.allocator.cluster import Snapshot
from driver.allocator.model import Device, DeviceId, slice_from_object
from driver.allocator.pools import Pool
from driver.allocator.scoring import counters_fit
from driver.allocator.state import AllocatedState
from driver.claims.allocation import allocation_for_node
from driver.claims.config import config_for_request
from driver.claims.refs import ClaimError, ClaimRef
from driver.common.quantity import Amount, format_amount
from driver.inventory.devices import NOT_OFFERED_ATTRIBUTE

# The `type` attribute -> the kind; mig-mps and mig-timeslice are shares inside a MIG partition.
KIND_OF_TYPE = {
    "gpu": "whole",
    "mig": "mig",
    "mps": "mps",
    "timeslice": "timeslice",
    "mig-mps": "mig-mps",
    "mig-timeslice": "mig-timeslice",
}
SHARE_KINDS = ("mps", "timeslice", "mig-mps", "mig-timeslice")


@dataclass(frozen=True)
class ClaimHolding:
    claim: str
    request: str
    pool: str
    device: str
    kind: str | None  # None: the device is not published
    profile: str | None
    placement_start: int | None
    placement_size: int | None
    share_id: str | None
    consumed_capacity: dict[str, str]
    interval: str | None
    config_error: str | None
    pods: list[str]


@dataclass(frozen=True)
class MigPlaceable:
    device: str
    profile: str
    start: int
    size: int


@dataclass(frozen=True)
class ShareStatus:
    device: str
    kind: str
    count: int
    open: bool
    capacity: dict[str, str]
    free: dict[str, str]


@dataclass(frozen=True)
class TaintStatus:
    key: str
    value: str
    effect: str
    devices: list[str]


@dataclass(frozen=True)
class GpuStatus:
    index: int
    uuid: str
    product: str
    healthy: bool
    state: str
    offers: list[str]
    not_offered: str | None
    whole_free: bool
    mig_placeable: list[MigPlaceable]
    shares: list[ShareStatus]
    claims: list[ClaimHolding]
    taints: list[TaintStatus]


@dataclass(frozen=True)
class NodeStatus:
    name: str
    problem: str | None
    gpus: list[GpuStatus]


@dataclass(frozen=True)
class ClusterStatus:
    nodes: list[NodeStatus]
    unpublished: list[ClaimHolding]


Holdings = dict[DeviceId, list[ClaimHolding]]  # by the device held


# --- the model ------------------------------------------------------------------------------------


def cluster_status(
    slices: Iterable[dict[str, Any]], claims: Iterable[dict[str, Any]], driver: str, nodes: Collection[str] = ()
) -> ClusterStatus:
    """The status of every node with `driver`'s slices, or of `nodes` only (named ones without
    slices included, with a problem saying so)."""
    ours_slices = [slice_from_object(s) for s in slices if (s.get("spec") or {}).get("driver") == driver]
    snapshot = Snapshot.from_slices(ours_slices)
    ours = [c for c in claims if _our_results(c, driver)]
    state = AllocatedState.from_allocations(c["status"]["allocation"] for c in ours)
    published = {d.id: d for pools in snapshot.pools.values() for p in pools for d in p.all_devices}
    holdings: Holdings = {}
    for claim in ours:
        for holding in _holdings(claim, driver, published):
            holdings.setdefault((driver, holding.pool, holding.device), []).append(holding)
    names = sorted(nodes) if nodes else sorted(snapshot.pools)
    node_list = [_node(name, snapshot.pools.get(name), driver, state, holdings) for name in names]
    # The driver's pool is named after its node: that is where an unpublished device was.
    unpublished = [h for key in sorted(holdings.keys() - published.keys()) for h in holdings[key]]
    unpublished = [h for h in unpublished if not nodes or h.pool in nodes]
    return ClusterStatus(node_list, unpublished)


def _our_results(claim: dict[str, Any], driver: str) -> list[dict[str, Any]]:
    allocation = (claim.get("status") or {}).get("allocation") or {}
    return [r for r in (allocation.get("devices") or {}).get("results") or () if r.get("driver") == driver]


def _attribute(device: Device, name: str) -> Any:
    kind_value = device.attributes.get(name)
    return None if kind_value is None else kind_value[1]


def _pods(claim: dict[str, Any]) -> list[str]:
    """Who reserved the claim: pods as namespace/name (a pod shares its claim's namespace)."""
    namespace = claim["metadata"].get("namespace", "")
    refs = (claim.get("status") or {}).get("reservedFor") or ()
    return [f"{namespace if r.get('resource') == 'pods' else r.get('resource')}/{r.get('name')}" for r in refs]


def _holdings(claim: dict[str, Any], driver: str, published: dict[DeviceId, Device]) -> list[ClaimHolding]:
    """What the claim holds of `driver`'s devices, read as the node plugin reads it at prepare."""
    metadata = claim["metadata"]
    ref = ClaimRef(metadata.get("namespace", ""), metadata.get("name", ""), metadata.get("uid", ""))
    pods = _pods(claim)
    held = []
    for pool in sorted({str(r.get("pool", "")) for r in _our_results(claim, driver)}):
        allocation = allocation_for_node(claim, ref, driver, pool)
        for allocated in allocation.devices:
            try:
                interval, error = config_for_request(allocation.configs, allocated.request).interval, None
            except ClaimError as err:
                interval, error = None, str(err)
            device = published.get((driver, pool, allocated.device))
            held.append(
                ClaimHolding(
                    claim=f"{ref.namespace}/{ref.name}",
                    request=allocated.request,
                    pool=pool,
                    device=allocated.device,
                    kind=None if device is None else KIND_OF_TYPE.get(_attribute(device, "type")),
                    profile=None if device is None else _attribute(device, "profile"),
                    placement_start=None if device is None else _attribute(device, "placementStart"),
                    placement_size=None if device is None else _attribute(device, "placementSize"),
                    share_id=allocated.share_id,
                    consumed_capacity=allocated.consumed_capacity,
                    interval=interval,
                    config_error=error,
                    pods=pods,
                )
            )
    return held


def _node(name: str, pools: list[Pool] | None, driver: str, state: AllocatedState, holdings: Holdings) -> NodeStatus:
    ours = [p for p in pools or () if p.driver == driver]
    if not ours:
        return NodeStatus(name, f"publishes no {driver} devices", [])
    problems = [f"pool {p.name} is being updated" for p in ours if p.incomplete]
    problems += [f"pool {p.name} is invalid: {p.invalid}" for p in ours if p.invalid]
    gpus = [gpu for pool in ours for gpu in _pool_gpus(pool, driver, state, holdings)]
    return NodeStatus(name, "; ".join(problems) or None, sorted(gpus, key=lambda g: g.index))


def _pool_gpus(pool: Pool, driver: str, state: AllocatedState, holdings: Holdings) -> list[GpuStatus]:
    """The pool's devices grouped by GPU (their `index` attribute)."""
    by_index: dict[int, list[Device]] = {}
    for device in pool.all_devices:
        index = _attribute(device, "index")
        if isinstance(index, int):
            by_index.setdefault(index, []).append(device)
    available = state.counters_left(pool)
    return [_gpu(i, devices, driver, state, available, holdings) for i, devices in by_index.items()]


def _gpu(
    index: int,
    devices: list[Device],
    driver: str,
    state: AllocatedState,
    available: dict[str, dict[str, Amount]],
    holdings: Holdings,
) -> GpuStatus:
    kinds = {d.id: KIND_OF_TYPE.get(_attribute(d, "type")) for d in devices}
    # Without counters (no DRAPartitionableDevices) a GPU offers one kind, so "anything on it
    # allocated" is what takes the whole GPU either way.
    in_use = any(state.is_allocated(d.id) for d in devices)
    whole = [d for d in devices if kinds[d.id] == "whole"]
    whole_free = bool(whole) and not in_use and counters_fit(whole[0], available)
    mig = [
        MigPlaceable(d.id[2], _attribute(d, "profile"), _attribute(d, "placementStart"), _attribute(d, "placementSize"))
        for d in devices
        if kinds[d.id] == "mig" and not state.is_allocated(d.id) and counters_fit(d, available)
    ]
    shares = [_share(d, str(kinds[d.id]), state, available) for d in devices if kinds[d.id] in SHARE_KINDS]
    taints = _taints(devices)
    if not in_use:
        summary = "free"
    elif mig or any(s.open for s in shares):  # a GPU in use has no whole GPU free
        summary = "partial"
    else:
        summary = "full"
    any_uuid = next((u for d in devices for u in (_attribute(d, "uuid"), _attribute(d, "parentUUID")) if u), "")
    return GpuStatus(
        index=index,
        uuid=any_uuid,
        product=str(next((_attribute(d, "productName") for d in devices if _attribute(d, "productName")), "")),
        healthy=not any(t.key.startswith(f"{driver}/") for t in taints),
        state=summary,
        offers=sorted({k for k in kinds.values() if k}, key=list(KIND_OF_TYPE.values()).index),
        not_offered=next((str(n) for d in devices if (n := _attribute(d, NOT_OFFERED_ATTRIBUTE))), None),
        whole_free=whole_free,
        mig_placeable=mig,
        shares=shares,
        claims=[h for d in devices for h in holdings.get(d.id, ())],
        taints=taints,
    )


def _share(device: Device, kind: str, state: AllocatedState, available: dict[str, dict[str, Amount]]) -> ShareStatus:
    """A share device: open when its GPU is not taken by other devices (its counters are drawn by
    its own shares already, or still free) and the smallest share its policies allow still fits."""
    smallest = {n: c.policy.minimum for n, c in device.capacity.items() if c.policy and c.policy.minimum is not None}
    consumed = consumption(smallest, device.capacity)
    gpu_ok = device.id in state.shared or counters_fit(device, available)
    open_ = (
        device.id not in state.exclusive
        and gpu_ok
        and consumed is not None
        and fits(consumed, device.capacity, state.shared.get(device.id, {}))
    )
    return ShareStatus(
        device=device.id[2],
        kind=kind,
        count=state.share_count.get(device.id, 0),
        open=open_,
        capacity=_quantities({n: c.value for n, c in device.capacity.items()}),
        free=_quantities(state.capacity_left(device)) if open_ else {},
    )


def _quantities(amounts: dict[str, Amount]) -> dict[str, str]:
    return {name: format_amount(value) for name, value in sorted(amounts.items())}


def _taints(devices: list[Device]) -> list[TaintStatus]:
    """The GPU's taints, each once with the devices that carry it."""
    carriers: dict[tuple[str, str, str], list[str]] = {}
    for device in devices:
        for taint in device.taints:
            carriers.setdefault((taint.key, taint.value, taint.effect), []).append(device.id[2])
    return [TaintStatus(key, value, effect, names) for (key, value, effect), names in sorted(carriers.items())]


# --- renderings -----------------------------------------------------------------------------------


def _json_name(name: str) -> str:
    if name == "share_id":
        return "shareID"  # as the API spells it
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def to_document(status: Any) -> dict[str, Any]:
    """A model (this one, or driver/usage_report's) as JSON-ready data with the documented field names."""
    return asdict(status, dict_factory=lambda items: {_json_name(k): v for k, v in items})


def render_json(status: Any) -> str:
    return json.dumps(to_document(status), indent=2) + "\n"


def render_yaml(status: Any) -> str:
    return yaml.safe_dump(to_document(status), sort_keys=False)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]]


def _amounts(amounts: dict[str, str]) -> str:
    return ", ".join(f"{name} {value}" for name, value in amounts.items())


def _free_text(gpu: GpuStatus) -> str:
    if gpu.state == "free":
        return "all: " + ", ".join(gpu.offers)
    parts: list[str] = []  # a GPU in use has no whole GPU free
    if gpu.mig_placeable:
        starts: dict[str, list[str]] = {}
        for placement in gpu.mig_placeable:
            starts.setdefault(placement.profile, []).append(str(placement.start))
        parts.append("mig " + " ".join(f"{profile}@{','.join(s)}" for profile, s in starts.items()))
    parts += [f"{share.kind} {_amounts(share.free)}" for share in gpu.shares if share.open]
    return "; ".join(parts) or "-"


def _holds_text(holding: ClaimHolding) -> str:
    if holding.kind == "mig":
        text = f"mig {holding.profile} at {holding.placement_start}"
    elif holding.kind == "whole":
        text = "whole GPU"
    else:
        text = " ".join(filter(None, [holding.kind or "unpublished device", _amounts(holding.consumed_capacity)]))
    if holding.interval:
        text += f", interval {holding.interval}"
    if holding.config_error:
        text += f" (bad config: {holding.config_error})"
    return text


def _claim_row(holding: ClaimHolding, node: str, gpu: str) -> list[str]:
    return [holding.claim, node, gpu, holding.device, _holds_text(holding), ", ".join(holding.pods) or "-"]


def _taint_text(taint: TaintStatus) -> str:
    return f"{taint.key}={taint.value}:{taint.effect}" if taint.value else f"{taint.key}:{taint.effect}"


def _devices_text(devices: list[str]) -> str:
    return ", ".join(devices) if len(devices) <= 3 else f"{devices[0]} and {len(devices) - 1} more"


def render_table(status: ClusterStatus) -> str:
    gpus = [(node, gpu) for node in status.nodes for gpu in node.gpus]
    rows = [
        [node.name, str(gpu.index), gpu.product, "healthy" if gpu.healthy else "unhealthy", gpu.state, _free_text(gpu)]
        for node, gpu in gpus
    ]
    lines = table(["NODE", "GPU", "PRODUCT", "HEALTH", "STATE", "FREE"], rows)
    lines += [f"{node.name}: {node.problem}" for node in status.nodes if node.problem]
    lines += [f"{node.name} GPU {gpu.index} offers no {gpu.not_offered}" for node, gpu in gpus if gpu.not_offered]
    claims = [_claim_row(h, node.name, str(gpu.index)) for node, gpu in gpus for h in gpu.claims]
    claims += [_claim_row(h, h.pool, "?") for h in status.unpublished]
    if claims:
        lines += ["", *table(["CLAIM", "NODE", "GPU", "DEVICE", "HOLDS", "PODS"], claims)]
    taints = [
        [node.name, str(gpu.index), _taint_text(t), _devices_text(t.devices)] for node, gpu in gpus for t in gpu.taints
    ]
    if taints:
        lines += ["", *table(["NODE", "GPU", "TAINT", "DEVICES"], taints)]
    return "\n".join(lines) + "\n"


RENDERERS = {"table": render_table, "json": render_json, "yaml": render_yaml}
