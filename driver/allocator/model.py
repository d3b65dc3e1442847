"""The allocator's domain objects, and their conversion from Kubernetes objects (plain dicts as the
API server returns them). Everything past this module works on these dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from driver.allocator.cel import device_input
from driver.allocator.quantity import Amount, QuantityError, parse_quantity

DeviceId = tuple[str, str, str]  # driver, pool, device
MAX_RESULTS_PER_CLAIM = 32


class ObjectError(ValueError):
    """A Kubernetes object the allocator cannot read; the message names it and the field."""


@dataclass(frozen=True)
class RequestPolicy:
    default: Amount | None = None
    valid_values: tuple[Amount, ...] = ()
    minimum: Amount | None = None
    maximum: Amount | None = None
    step: Amount | None = None
    has_range: bool = False


@dataclass(frozen=True)
class Capacity:
    value: Amount
    policy: RequestPolicy | None = None


@dataclass(frozen=True)
class Taint:
    key: str
    value: str
    effect: str


@dataclass(frozen=True)
class Toleration:
    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""

    def tolerates(self, taint: Taint) -> bool:
        if self.effect and self.effect != taint.effect:
            return False
        if self.key and self.key != taint.key:
            return False
        if self.operator in ("", "Equal"):
            return self.value == taint.value
        return self.operator == "Exists"


@dataclass(frozen=True)
class NodePlacement:
    """Where a slice or device is available: a node name, all nodes, or a node selector."""

    node_name: str = ""
    all_nodes: bool = False
    node_selector: dict[str, Any] | None = None


@dataclass(eq=False)
class Device:
    id: DeviceId
    attributes: dict[str, tuple[str, Any]]
    capacity: dict[str, Capacity]
    consumes: tuple[tuple[str, dict[str, Amount]], ...] = ()
    allow_multiple_allocations: bool = False
    taints: tuple[Taint, ...] = ()
    binds_to_node: bool = False
    placement: NodePlacement = field(default_factory=NodePlacement)  # the slice's, or the device's own
    per_device_placement: bool = False
    selector_results: dict[str, bool] = field(default_factory=dict)  # expression -> matches (static)
    _cel: dict[str, Any] | None = None

    @property
    def cel(self) -> dict[str, Any]:
        if self._cel is None:
            capacity = {name: cap.value for name, cap in self.capacity.items()}
            self._cel = device_input(self.id[0], self.attributes, capacity, self.allow_multiple_allocations)
        return self._cel

    def attribute(self, qualified: str) -> tuple[str, Any] | None:
        """An attribute by fully qualified name; bare names belong to the driver's domain."""
        if qualified in self.attributes:
            return self.attributes[qualified]
        domain, _, name = qualified.partition("/")
        return self.attributes.get(name) if name and domain == self.id[0] else None


@dataclass(frozen=True)
class Slice:
    name: str
    driver: str
    pool: str
    generation: int
    slice_count: int
    placement: NodePlacement
    per_device_placement: bool
    devices: tuple[Device, ...]
    counter_sets: dict[str, dict[str, Amount]]


@dataclass(frozen=True)
class DeviceClass:
    name: str
    selectors: tuple[str, ...]
    configs: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class Request:
    """An `exactly` request, or one subrequest of `firstAvailable` (then `parent` is set)."""

    name: str
    class_name: str
    selectors: tuple[str, ...] = ()
    mode: str = "ExactCount"
    count: int = 1
    admin_access: bool | None = None
    tolerations: tuple[Toleration, ...] = ()
    capacity: dict[str, Amount] | None = None
    parent: str = ""
    raw_tolerations: tuple[dict[str, Any], ...] = ()

    @property
    def full_name(self) -> str:
        return f"{self.parent}/{self.name}" if self.parent else self.name

    def untolerated_taints(self, device: Device) -> list[Taint]:
        """The device's NoSchedule / NoExecute taints this request does not tolerate."""
        return [
            taint
            for taint in device.taints
            if taint.effect in ("NoSchedule", "NoExecute") and not any(t.tolerates(taint) for t in self.tolerations)
        ]

    @property
    def base_name(self) -> str:
        return self.parent or self.name


@dataclass(frozen=True)
class Constraint:
    requests: frozenset[str]
    match_attribute: str = ""
    distinct_attribute: str = ""

    def applies(self, request: Request) -> bool:
        if not self.requests:
            return True
        return request.base_name in self.requests or (bool(request.parent) and request.full_name in self.requests)


@dataclass(frozen=True)
class Claim:
    namespace: str
    name: str
    uid: str
    requests: tuple[tuple[Request, ...], ...]  # one tuple per request: itself, or its subrequests in order
    constraints: tuple[Constraint, ...]
    configs: tuple[dict[str, Any], ...]
    labels: dict[str, str]
    allocation: dict[str, Any] | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def _quantity(value: Any, where: str) -> Amount:
    try:
        return parse_quantity(value)
    except QuantityError as error:
        raise ObjectError(f"{where}: {error}") from None


def _placement(spec: dict[str, Any]) -> NodePlacement:
    return NodePlacement(spec.get("nodeName") or "", bool(spec.get("allNodes")), spec.get("nodeSelector"))


def _attribute(value: dict[str, Any], where: str) -> tuple[str, Any]:
    for kind in ("string", "int", "bool", "version"):
        if kind in value:
            return kind, value[kind]
    raise ObjectError(f"{where}: an attribute needs one of string, int, bool, version")


def _policy(policy: dict[str, Any] | None, where: str) -> RequestPolicy | None:
    if not policy:
        return None
    valid_range = policy.get("validRange")

    def optional(value: Any) -> Amount | None:
        return None if value is None else _quantity(value, where)

    return RequestPolicy(
        default=optional(policy.get("default")),
        valid_values=tuple(_quantity(v, where) for v in policy.get("validValues") or ()),
        minimum=optional((valid_range or {}).get("min")),
        maximum=optional((valid_range or {}).get("max")),
        step=optional((valid_range or {}).get("step")),
        has_range=valid_range is not None,
    )


def _device(raw: dict[str, Any], driver: str, pool: str, placement: NodePlacement, per_device: bool) -> Device:
    name = raw.get("name") or ""
    where = f"device {driver}/{pool}/{name}"
    return Device(
        id=(driver, pool, name),
        attributes={k: _attribute(v, f"{where} attribute {k}") for k, v in (raw.get("attributes") or {}).items()},
        capacity={
            k: Capacity(_quantity(v.get("value"), f"{where} capacity {k}"), _policy(v.get("requestPolicy"), where))
            for k, v in (raw.get("capacity") or {}).items()
        },
        consumes=tuple(
            (c["counterSet"], {n: _quantity(v.get("value"), where) for n, v in (c.get("counters") or {}).items()})
            for c in raw.get("consumesCounters") or ()
        ),
        allow_multiple_allocations=bool(raw.get("allowMultipleAllocations")),
        taints=tuple(Taint(t.get("key", ""), t.get("value", ""), t.get("effect", "")) for t in raw.get("taints") or ()),
        binds_to_node=bool(raw.get("bindsToNode")),
        placement=_placement(raw) if per_device else placement,
        per_device_placement=per_device,
    )


def slice_from_object(obj: dict[str, Any]) -> Slice:
    spec = obj.get("spec") or {}
    name = (obj.get("metadata") or {}).get("name", "")
    pool = spec.get("pool") or {}
    driver, pool_name = spec.get("driver", ""), pool.get("name", "")
    placement = _placement(spec)
    per_device = bool(spec.get("perDeviceNodeSelection"))
    where = f"ResourceSlice {name}"
    return Slice(
        name=name,
        driver=driver,
        pool=pool_name,
        generation=int(pool.get("generation") or 0),
        slice_count=int(pool.get("resourceSliceCount") or 1),
        placement=placement,
        per_device_placement=per_device,
        devices=tuple(_device(d, driver, pool_name, placement, per_device) for d in spec.get("devices") or ()),
        counter_sets={
            s["name"]: {n: _quantity(v.get("value"), where) for n, v in (s.get("counters") or {}).items()}
            for s in spec.get("sharedCounters") or ()
        },
    )


def class_from_object(obj: dict[str, Any]) -> DeviceClass:
    spec = obj.get("spec") or {}
    return DeviceClass(
        name=(obj.get("metadata") or {}).get("name", ""),
        selectors=tuple(s["cel"]["expression"] for s in spec.get("selectors") or () if s.get("cel")),
        configs=tuple(spec.get("config") or ()),
    )


def _request(raw: dict[str, Any], parent: str, where: str) -> Request:
    capacity = (raw.get("capacity") or {}).get("requests")
    mode = raw.get("allocationMode") or "ExactCount"
    return Request(
        name=raw.get("name", ""),
        class_name=raw.get("deviceClassName", ""),
        selectors=tuple(s["cel"]["expression"] for s in raw.get("selectors") or () if s.get("cel")),
        mode=mode,
        count=int(raw.get("count") or 1) if mode == "ExactCount" else 0,
        admin_access=raw.get("adminAccess"),
        tolerations=tuple(
            Toleration(t.get("key", ""), t.get("operator") or "Equal", t.get("value", ""), t.get("effect", ""))
            for t in raw.get("tolerations") or ()
        ),
        capacity=None if capacity is None else {k: _quantity(v, where) for k, v in capacity.items()},
        parent=parent,
        raw_tolerations=tuple(raw.get("tolerations") or ()),
    )


def claim_from_object(obj: dict[str, Any]) -> Claim:
    metadata = obj.get("metadata") or {}
    devices = (obj.get("spec") or {}).get("devices") or {}
    where = f"ResourceClaim {metadata.get('namespace', '')}/{metadata.get('name', '')}"
    requests: list[tuple[Request, ...]] = []
    for raw in devices.get("requests") or ():
        if raw.get("firstAvailable"):
            requests.append(tuple(_request(sub, raw["name"], where) for sub in raw["firstAvailable"]))
        elif raw.get("exactly"):
            requests.append((_request({**raw["exactly"], "name": raw["name"]}, "", where),))
        else:
            raise ObjectError(f"{where}: request {raw.get('name')!r} has neither exactly nor firstAvailable")
    return Claim(
        namespace=metadata.get("namespace", ""),
        name=metadata.get("name", ""),
        uid=metadata.get("uid", ""),
        requests=tuple(requests),
        constraints=tuple(
            Constraint(frozenset(c.get("requests") or ()), c.get("matchAttribute", ""), c.get("distinctAttribute", ""))
            for c in devices.get("constraints") or ()
        ),
        configs=tuple(devices.get("config") or ()),
        labels=dict(metadata.get("labels") or {}),
        allocation=(obj.get("status") or {}).get("allocation"),
    )
