"""A size as a claim request's fields and back: the device class, the selector that pins a size's
kind and partition, and the capacity requests. Shared by the template patches (patch.py) and the
webhook's Initial mode (initial.py), so both write a size the same way."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from driver.common.quantity import parse_quantity
from driver.inventory.devices import MPS_DEFAULT_COMPUTE, SHARE_DEFAULT_MEMORY
from driver.sizing.sizes import DEVICE_CLASSES, KIND_OF_CLASS, MIG_KINDS, GpuModel, Size

MIB = 2**20
SHARE_KINDS = frozenset({"mps", "timeslice", "mig-mps", "mig-timeslice"})
_PROFILE = re.compile(r'profile(?: == |\.startsWith\()"([^"]+)"')  # what selector() and the examples write

JsonObject = dict[str, Any]


def selector(size: Size, product: str) -> JsonObject:
    """What pins a size: a MIG partition by its profile, anything else by the GPU product the usage
    was seen on (a MIG request's profile selector would match no whole GPU)."""
    attribute, value = ("profile", size.profile) if size.kind in MIG_KINDS else ("productName", product)
    return {"cel": {"expression": f'device.attributes["gpu.fgpu.dev"].{attribute} == "{value}"'}}


def capacity_requests(size: Size) -> dict[str, str]:
    requests = {}
    if size.memory_mib is not None:
        requests["memory"] = f"{size.memory_mib}Mi"
    if size.compute_percent is not None:
        requests["compute"] = str(size.compute_percent)
    return requests


def resize_ops(base: str, current: Size, target: Size, product: str, capacity: Mapping[str, str]) -> list[JsonObject]:
    """The JSON patch operations turning the request at `base` (its `exactly`) of size `current`,
    whose capacity requests are `capacity`, into `target`: the class where the kind changes, the
    selectors where the kind or partition does, and the capacity (the request's other capacities
    kept where the kind stays)."""
    ops: list[JsonObject] = []
    if target.kind != current.kind:
        ops.append({"op": "replace", "path": f"{base}/deviceClassName", "value": DEVICE_CLASSES[target.kind]})
    if (target.kind, target.profile) != (current.kind, current.profile):
        ops.append({"op": "add", "path": f"{base}/selectors", "value": [selector(target, product)]})
    requests = capacity_requests(target) if target.kind != current.kind else dict(capacity) | capacity_requests(target)
    if requests:
        ops.append({"op": "add", "path": f"{base}/capacity", "value": {"requests": requests}})
    elif capacity:
        ops.append({"op": "remove", "path": f"{base}/capacity"})
    return ops


def request_size(exactly: Mapping[str, Any], gpu: GpuModel) -> Size:
    """The size an `exactly` request asks for, the class defaults filled in (a share's 1Gi, MPS's
    10%); ValueError where it is not one of ours or its MIG profile cannot be read."""
    kind = KIND_OF_CLASS.get(str(exactly.get("deviceClassName", "")))
    if kind is None:
        raise ValueError(f"device class {exactly.get('deviceClassName')!r} is not fgpu's")
    requests = (exactly.get("capacity") or {}).get("requests") or {}
    memory = mib(requests.get("memory"))
    compute = whole(requests.get("compute"))
    if kind in SHARE_KINDS and memory is None:
        memory = SHARE_DEFAULT_MEMORY // MIB
    if kind in ("mps", "mig-mps") and compute is None:
        compute = MPS_DEFAULT_COMPUTE
    return Size(kind, memory, compute, _profile(exactly, gpu) if kind in MIG_KINDS else None)


def mib(text: Any) -> int | None:
    return None if text is None else -(-parse_quantity(str(text)) // MIB)


def whole(text: Any) -> int | None:
    return None if text is None else int(parse_quantity(str(text)))


def _profile(exactly: Mapping[str, Any], gpu: GpuModel) -> str:
    """The MIG profile a request's selectors pin, by its name on `gpu`."""
    pinned = pinned_profile(exactly)
    names = [o.name for o in gpu.mig_ladder if pinned and o.name.startswith(pinned)]
    if names:
        return names[0]
    raise ValueError(f"no MIG profile of {gpu.product_name} read from its selectors")


def pinned_profile(exactly: Mapping[str, Any]) -> str | None:
    """The MIG profile (or its prefix) a request's selectors pin: `profile == "3g.40gb"`,
    `profile.startsWith("3g")`; None where none does."""
    for item in exactly.get("selectors") or ():
        match = _PROFILE.search(str(((item or {}).get("cel") or {}).get("expression", "")))
        if match:
            return match.group(1)
    return None
