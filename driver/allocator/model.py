"""The allocator's domain objects, and their conversion from Kubernetes objects (plain dicts as the
API server returns them). Everything past this module works on these dataclasses."""

from __future__ import annotations

import contextlib
import functools
import json
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from driver.allocator.cel import device_input
from driver.allocator.lifetimes import expected_end
from driver.claims.config import Tenancy
from driver.claims.tenancy import class_tenancy
from driver.common.quantity import Amount, QuantityError, parse_quantity

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


# Attributes that tell one GPU from another (its identity and where it sits). Devices keep their
# own values of these; every other attribute goes into the shape they share with devices of the
# same kind (a MIG profile at one placement is the same shape on every GPU of every node). Which
# names are listed only decides how much is shared, never what a device reads.
OWN_ATTRIBUTES = frozenset({"uuid", "parentUUID", "index", "minor", "pciBusID", "pcieRoot", "numaNode"})
MISSING = object()  # what a selector reads from a device that lacks the attribute or capacity


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class DeviceShape:
    """What devices of identical hardware share: parsed once, referenced by all of them."""

    driver: str
    attributes: dict[str, tuple[str, Any]]  # all but the ones each device keeps (OWN_ATTRIBUTES)
    own_index: dict[str, int]  # name of an own attribute -> its position in Device.own
    capacity: dict[str, Capacity]
    allow_multiple_allocations: bool
    taints: tuple[Taint, ...]
    binds_to_node: bool
    per_device_placement: bool


@dataclass(slots=True, eq=False)
class Device:
    id: DeviceId
    shape: DeviceShape
    own: tuple[tuple[str, Any], ...]  # values of the shape's own attributes (shared by a GPU's devices)
    consumes: tuple[tuple[str, dict[str, Amount]], ...]
    placement: NodePlacement  # the slice's, or the device's own

    @property
    def attributes(self) -> dict[str, tuple[str, Any]]:
        """All attributes as published (built on each call: for reports, not for the search)."""
        merged = dict(self.shape.attributes)
        merged.update((name, self.own[i]) for name, i in self.shape.own_index.items())
        return merged

    @property
    def capacity(self) -> dict[str, Capacity]:
        return self.shape.capacity

    @property
    def allow_multiple_allocations(self) -> bool:
        return self.shape.allow_multiple_allocations

    @property
    def taints(self) -> tuple[Taint, ...]:
        return self.shape.taints

    @property
    def binds_to_node(self) -> bool:
        return self.shape.binds_to_node

    @property
    def per_device_placement(self) -> bool:
        return self.shape.per_device_placement

    def cel_input(self) -> dict[str, Any]:
        """The CEL `device` variable (built on demand: selector results are shared, see allocate.py)."""
        capacity = {name: cap.value for name, cap in self.shape.capacity.items()}
        return device_input(self.id[0], self.attributes, capacity, self.shape.allow_multiple_allocations)

    def _own_or_shared(self, name: str) -> tuple[str, Any] | None:
        index = self.shape.own_index.get(name)
        return self.own[index] if index is not None else self.shape.attributes.get(name)

    def attribute(self, qualified: str) -> tuple[str, Any] | None:
        """An attribute by fully qualified name; bare names belong to the driver's domain."""
        value = self._own_or_shared(qualified)
        if value is not None:
            return value
        domain, _, name = qualified.partition("/")
        return self._own_or_shared(name) if name and domain == self.id[0] else None

    def read(self, what: tuple[str, ...]) -> Any:
        """What a selector reads (see cel.device_reads): everything its result can depend on. In the
        driver's domain both the bare and the qualified name are read, whichever CEL sees."""
        if what[0] == "driver":
            return self.id[0]
        if what[0] == "allowMultipleAllocations":
            return self.shape.allow_multiple_allocations
        _, domain, ident = what
        names = (ident, f"{domain}/{ident}") if domain == self.id[0] else (f"{domain}/{ident}",)
        if what[0] == "attributes":
            return tuple(self._own_or_shared(name) or MISSING for name in names)
        return tuple(getattr(self.shape.capacity.get(name), "value", MISSING) for name in names)


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
    _tenancy: dict[str, Tenancy] = field(default_factory=dict, compare=False, repr=False)  # by driver

    def tenancy(self, driver: str) -> Tenancy:
        """Whose shares of `driver`'s devices may meet this class's (driver/claims/tenancy.py): read
        from its configs once, the search asks on every device other tenants hold shares of."""
        found = self._tenancy.get(driver)
        if found is None:
            found = self._tenancy[driver] = class_tenancy(self.configs, driver)
        return found


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
    # When it is expected to end (seconds since the epoch; lifetimes.py): only ever a preference.
    expected_end: float | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @functools.cached_property
    def search_key(self) -> Hashable:
        """All the device search reads of the claim (its requests and constraints): claims with
        equal keys fit the same devices (names, configs and labels only shape the result)."""
        return tuple(tuple(map(_request_key, alternatives)) for alternatives in self.requests), self.constraints


@dataclass(frozen=True)
class Placement:
    """A claim's allocation on a node, found and not yet committed."""

    claim: Claim
    node: str
    allocation: dict[str, Any]


@dataclass(frozen=True)
class Failure:
    """Why a claim fits nowhere (empty where the caller did not ask)."""

    claim: Claim
    reason: str


def _request_key(request: Request) -> Hashable:
    capacity = tuple(sorted(request.capacity.items())) if request.capacity is not None else None
    return (
        request.name,
        request.parent,
        request.class_name,
        request.selectors,
        request.mode,
        request.count,
        request.admin_access,
        request.tolerations,
        capacity,
    )


def _quantity(value: Any, where: str) -> Amount:
    try:
        return parse_quantity(value)
    except QuantityError as error:
        raise ObjectError(f"{where}: {error}") from None


def _placement(spec: dict[str, Any]) -> NodePlacement:
    return NodePlacement(spec.get("nodeName") or "", bool(spec.get("allNodes")), spec.get("nodeSelector"))


_KINDS = ("string", "int", "bool", "version")


def _attribute(value: dict[str, Any], where: str) -> tuple[str, Any]:
    for kind in _KINDS:
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


def _counters(raw: dict[str, Any] | None, where: str) -> dict[str, Amount]:
    """Counters by content: the same published counters are one dict (never modified)."""
    key = tuple((name, value.get("value")) for name, value in (raw or {}).items())
    try:
        return _interned_counters(key)
    except (QuantityError, TypeError):  # a bad or unhashable value: the plain parse names it
        return {name: _quantity(value, where) for name, value in key}


@functools.lru_cache(maxsize=4096)
def _interned_counters(key: tuple[tuple[str, Any], ...]) -> dict[str, Amount]:
    return {name: parse_quantity(value) for name, value in key}


# Shapes by content; one lives as long as a device refers to it.
_SHAPES: weakref.WeakValueDictionary[tuple[Any, ...], DeviceShape] = weakref.WeakValueDictionary()


class _SliceParser:
    """One slice's devices. Values the slice repeats (a GPU's own attributes, shared by all its MIG
    placements and shares) are kept once; shapes and counters are shared across slices."""

    def __init__(self, driver: str, pool: str, placement: NodePlacement, per_device: bool) -> None:
        self.driver, self.pool, self.placement, self.per_device = driver, pool, placement, per_device
        self._own: dict[tuple[tuple[str, Any], ...], tuple[tuple[str, Any], ...]] = {}
        self._is_own: dict[str, bool] = {}  # attribute name -> kept by the device (OWN_ATTRIBUTES)

    def device(self, raw: dict[str, Any]) -> Device:
        name = raw.get("name") or ""
        where = f"device {self.driver}/{self.pool}/{name}"  # for messages; cheap next to what follows
        shared: list[tuple[str, str, Any]] = []
        own_names: list[str] = []
        own: list[tuple[str, Any]] = []
        for key, value in (raw.get("attributes") or {}).items():
            if type(value) is dict and len(value) == 1:  # the usual case: a single kind, no scan
                ((kind, plain),) = value.items()
                if kind not in _KINDS:
                    kind, plain = _attribute(value, f"{where} attribute {key}")
            else:
                kind, plain = _attribute(value, f"{where} attribute {key}")
            is_own = self._is_own.get(key)
            if is_own is None:
                is_own = self._is_own[key] = key.rpartition("/")[2] in OWN_ATTRIBUTES
            if is_own:
                own_names.append(key)
                own.append((kind, plain))
            else:
                shared.append((key, kind, plain))
        own_tuple = tuple(own)
        with contextlib.suppress(TypeError):  # an unhashable value (not a valid attribute) is kept as it is
            own_tuple = self._own.setdefault(own_tuple, own_tuple)
        return Device(
            id=(self.driver, self.pool, name),
            shape=self._shape(raw, shared, tuple(own_names), where),
            own=own_tuple,
            consumes=_device_consumes(raw.get("consumesCounters") or (), where),
            placement=_placement(raw) if self.per_device else self.placement,
        )

    def _shape(
        self, raw: dict[str, Any], shared: list[tuple[str, str, Any]], own: tuple[str, ...], where: str
    ) -> DeviceShape:
        capacity = raw.get("capacity") or {}
        taints = tuple((t.get("key", ""), t.get("value", ""), t.get("effect", "")) for t in raw.get("taints") or ())
        flags = (bool(raw.get("allowMultipleAllocations")), bool(raw.get("bindsToNode")), self.per_device)
        try:
            capacity_key = tuple(
                (k, v.get("value"), json.dumps(v["requestPolicy"], sort_keys=True) if "requestPolicy" in v else None)
                for k, v in capacity.items()
            )
            key = (self.driver, tuple(shared), own, capacity_key, taints, flags)
            found = _SHAPES.get(key)
        except TypeError:  # unhashable values: a shape of its own
            key, found = None, None
        if found is not None:
            return found
        shape = DeviceShape(
            driver=self.driver,
            attributes={name: (kind, value) for name, kind, value in shared},
            own_index={name: index for index, name in enumerate(own)},
            capacity={
                k: Capacity(_quantity(v.get("value"), f"{where} capacity {k}"), _policy(v.get("requestPolicy"), where))
                for k, v in capacity.items()
            },
            allow_multiple_allocations=flags[0],
            taints=tuple(Taint(*t) for t in taints),
            binds_to_node=flags[1],
            per_device_placement=flags[2],
        )
        if key is not None:
            _SHAPES[key] = shape
        return shape


# What devices draw, by the published text (repr of decoded JSON: equal exactly when the values
# are): a device like one seen before costs one repr and one lookup. Cleared when it grows past
# what a cluster's kinds of devices can fill (then it fills again).
_CONSUMES: dict[str, tuple[tuple[str, dict[str, Amount]], ...]] = {}
_CONSUMES_LIMIT = 65536


def _device_consumes(raw: Sequence[dict[str, Any]], where: str) -> tuple[tuple[str, dict[str, Amount]], ...]:
    if not raw:
        return ()
    text = repr(raw)
    found = _CONSUMES.get(text)
    if found is None:
        found = tuple((c["counterSet"], _counters(c.get("counters"), where)) for c in raw)
        if len(_CONSUMES) >= _CONSUMES_LIMIT:
            _CONSUMES.clear()
        _CONSUMES[text] = found
    return found


def slice_from_object(obj: dict[str, Any]) -> Slice:
    spec = obj.get("spec") or {}
    name = (obj.get("metadata") or {}).get("name", "")
    pool = spec.get("pool") or {}
    driver, pool_name = spec.get("driver", ""), pool.get("name", "")
    placement = _placement(spec)
    per_device = bool(spec.get("perDeviceNodeSelection"))
    parser = _SliceParser(driver, pool_name, placement, per_device)
    where = f"ResourceSlice {name}"
    return Slice(
        name=name,
        driver=driver,
        pool=pool_name,
        generation=int(pool.get("generation") or 0),
        slice_count=int(pool.get("resourceSliceCount") or 1),
        placement=placement,
        per_device_placement=per_device,
        devices=tuple(parser.device(d) for d in spec.get("devices") or ()),
        counter_sets={s["name"]: _counters(s.get("counters"), where) for s in spec.get("sharedCounters") or ()},
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
        expected_end=expected_end(metadata),
    )
