"""Hypothesis strategies for allocation scenarios: nodes with GPUs offered whole, as MIG placements,
as MPS shares and as MPS shares inside a MIG placement (counters make them exclusive; a shared
device draws its counters once however many claims hold it), taints, and claims mixing classes,
counts, firstAvailable, constraints, selectors (some that fail at runtime), tolerations and capacity."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

DRIVER = "gpu.fgpu.dev"
GiB = 2**30
# A small MIG geometry: 4 memory slices, profiles by size with their placements.
MIG_PLACEMENTS = {1: (0, 1, 2, 3), 2: (0, 2), 4: (0,)}

CLASSES = [
    {"name": "gpu", "expression": f'device.attributes["{DRIVER}"].type == "gpu"'},
    {"name": "mig", "expression": f'device.attributes["{DRIVER}"].type == "mig"'},
    {"name": "mps", "expression": f'device.attributes["{DRIVER}"].type == "mps"'},
    {"name": "mig-mps", "expression": f'device.attributes["{DRIVER}"].type == "mig-mps"'},
    {"name": "any", "expression": f'device.driver == "{DRIVER}"'},
]
SELECTORS = [
    f'device.attributes["{DRIVER}"].gpu == 0',
    f'device.attributes["{DRIVER}"].gpu >= 1',
    f'device.capacity["{DRIVER}"].memory.compareTo(quantity("20Gi")) >= 0',
    f'device.capacity["{DRIVER}"].memory.isLessThan(quantity("15Gi"))',
    f'device.attributes["{DRIVER}"].driverVersion.isGreaterThan(semver("550.0.0"))',
    f'device.attributes["{DRIVER}"].model in ["H100", "A100"]',
    'device.attributes["other.example.com"].size() == 0',
    f'has(device.attributes["{DRIVER}"].slices) && device.attributes["{DRIVER}"].slices <= 2',
    f'device.attributes["{DRIVER}"].exists(name, name == "slices")',
    "device.allowMultipleAllocations",
    f'device.attributes["{DRIVER}"].undefinedAttribute == 1',  # a runtime error wherever it is evaluated
]


def device_class(spec: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"selectors": [{"cel": {"expression": spec["expression"]}}]}
    body["config"] = [{"opaque": {"driver": DRIVER, "parameters": {"class": spec["name"]}}}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": spec["name"]}, "spec": body}


def _attrs(kind: str, gpu: int, model: str, version: str, **extra: int) -> dict[str, Any]:
    attrs = {"type": {"string": kind}, "gpu": {"int": gpu}, "model": {"string": model}}
    attrs["driverVersion"] = {"version": version}
    attrs.update({k: {"int": v} for k, v in extra.items()})
    return attrs


@st.composite
def gpu_devices(draw: st.DrawFn, gpu: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    model = draw(st.sampled_from(["H100", "A100", "L4"]))
    version = draw(st.sampled_from(["535.4.1", "550.1.0", "560.0.0-rc.1"]))
    memory_gib = draw(st.sampled_from([16, 40, 80]))
    counters = {f"slice-{k}": {"value": "1"} for k in range(4)}
    counter_set = f"gpu-{gpu}"
    everything = {"counterSet": counter_set, "counters": counters}
    devices = []
    kinds = draw(st.sets(st.sampled_from(["whole", "mig", "mps", "mig-mps"]), min_size=1))
    taint = draw(st.sampled_from([None, None, None, "NoSchedule", "NoExecute", "None"]))
    if "whole" in kinds:
        device = {"name": f"gpu-{gpu}", "attributes": _attrs("gpu", gpu, model, version)}
        device["capacity"] = {"memory": {"value": f"{memory_gib}Gi"}}
        device["consumesCounters"] = [everything]
        if taint:
            device["taints"] = [{"key": "fgpu.dev/unhealthy", "value": "xid", "effect": taint}]
        devices.append(device)
    if "mig" in kinds:
        for size, starts in MIG_PLACEMENTS.items():
            for start in draw(st.sets(st.sampled_from(starts), min_size=1)):
                device = {"name": f"gpu-{gpu}-mig-{size}-{start}"}
                device["attributes"] = _attrs("mig", gpu, model, version, slices=size)
                device["capacity"] = {"memory": {"value": f"{memory_gib * size // 4}Gi"}}
                used = {f"slice-{k}": {"value": "1"} for k in range(start, start + size)}
                device["consumesCounters"] = [{"counterSet": counter_set, "counters": used}]
                devices.append(device)
    if "mps" in kinds:
        device = {"name": f"gpu-{gpu}-mps", "attributes": _attrs("mps", gpu, model, version)}
        device.update(_shares(memory_gib, [everything]))
        devices.append(device)
    if "mig-mps" in kinds:  # shares inside a partition: the placement's counters, once for all its shares
        for size, starts in MIG_PLACEMENTS.items():
            for start in draw(st.sets(st.sampled_from(starts), max_size=len(starts))):
                device = {"name": f"gpu-{gpu}-mig-{size}-{start}-mps"}
                device["attributes"] = _attrs("mig-mps", gpu, model, version, slices=size)
                used = {f"slice-{k}": {"value": "1"} for k in range(start, start + size)}
                device.update(_shares(memory_gib * size // 4, [{"counterSet": counter_set, "counters": used}]))
                devices.append(device)
    return {"name": counter_set, "counters": counters}, devices


def _shares(memory_gib: int, consumes: list[dict[str, Any]]) -> dict[str, Any]:
    """What makes a device MPS shares: multiple allocations, consumable memory and clients."""
    policy = {"default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi", "max": f"{memory_gib}Gi"}}
    return {
        "allowMultipleAllocations": True,
        "capacity": {
            "memory": {"value": f"{memory_gib}Gi", "requestPolicy": policy},
            "clients": {"value": "4", "requestPolicy": {"default": "1", "validValues": ["1"]}},
        },
        "consumesCounters": consumes,
    }


@st.composite
def node_slices(draw: st.DrawFn, node: str) -> list[dict[str, Any]]:
    gpus = [draw(gpu_devices(i)) for i in range(draw(st.integers(1, 3)))]
    generation = draw(st.sampled_from([1, 1, 1, 2]))

    def slice_(index: int, count: int, key: str, items: list[Any], gen: int = generation) -> dict[str, Any]:
        spec = {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": gen, "resourceSliceCount": count},
        }
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{gen}-{index}"},
            "spec": {**spec, key: items},
        }

    slices = [
        slice_(0, 2, "sharedCounters", [c for c, _ in gpus]),
        slice_(1, 2, "devices", [d for _, ds in gpus for d in ds]),
    ]
    shape = draw(st.sampled_from(["current", "current", "current", "incomplete", "stale-older"]))
    if shape == "incomplete":
        slices[1]["spec"]["pool"]["resourceSliceCount"] = slices[0]["spec"]["pool"]["resourceSliceCount"] = 3
    elif shape == "stale-older" and generation == 2:
        slices.append(
            slice_(1, 2, "devices", [{"name": "stale-gpu", "attributes": _attrs("gpu", 9, "H100", "550.1.0")}], gen=1)
        )
    return slices


@st.composite
def shared_pool(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Network-attached GPUs: a pool offered to all nodes, or to the nodes a selector picks."""
    counters, devices = draw(gpu_devices(7))
    in_zone_a = {"nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}
    where = draw(st.sampled_from([{"allNodes": True}, {"nodeSelector": in_zone_a}]))
    pool = {"name": "fabric", "generation": 1, "resourceSliceCount": 2}

    def slice_(index: int, key: str, items: list[Any]) -> dict[str, Any]:
        metadata = {"name": f"fabric-{index}"}
        spec = {"driver": DRIVER, "pool": pool, **where, key: items}
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": metadata, "spec": spec}

    return [slice_(0, "sharedCounters", [counters]), slice_(1, "devices", devices)]


@st.composite
def requests(draw: st.DrawFn, name: str) -> dict[str, Any]:
    def exactly(draw_count: bool = True) -> dict[str, Any]:
        cls = draw(st.sampled_from([c["name"] for c in CLASSES]))
        body: dict[str, Any] = {"deviceClassName": cls}
        if draw(st.integers(0, 9)) == 0:
            body["allocationMode"] = "All"
        elif draw_count:
            body["count"] = draw(st.integers(1, 3))
        chosen = draw(st.lists(st.sampled_from(SELECTORS[:-1] if draw(st.integers(0, 19)) else SELECTORS), max_size=2))
        if chosen:
            body["selectors"] = [{"cel": {"expression": e}} for e in chosen]
        if draw(st.booleans()):
            body["tolerations"] = [
                draw(
                    st.sampled_from(
                        [
                            {"key": "fgpu.dev/unhealthy", "operator": "Exists"},
                            {"key": "fgpu.dev/unhealthy", "operator": "Equal", "value": "xid", "effect": "NoSchedule"},
                            {"operator": "Exists", "effect": "NoExecute"},
                        ]
                    )
                )
            ]
        if cls in ("mps", "mig-mps", "any") and draw(st.booleans()):
            body["capacity"] = {"requests": {"memory": draw(st.sampled_from(["512Mi", "3Gi", "10Gi", "30Gi", "70Gi"]))}}
        if draw(st.integers(0, 29)) == 0:
            body["adminAccess"] = True
        return body

    if draw(st.integers(0, 3)) == 0:
        subs = [{"name": f"s{i}", **exactly()} for i in range(draw(st.integers(1, 3)))]
        for sub in subs:
            sub.pop("adminAccess", None)  # not allowed in subrequests
        return {"name": name, "firstAvailable": subs}
    return {"name": name, "exactly": exactly()}


@st.composite
def claims(draw: st.DrawFn, name: str) -> dict[str, Any]:
    reqs = [draw(requests(f"r{i}")) for i in range(draw(st.integers(1, 2)))]
    devices: dict[str, Any] = {"requests": reqs}
    if draw(st.integers(0, 3)) == 0:
        attribute = draw(st.sampled_from([f"{DRIVER}/gpu", f"{DRIVER}/model", "other.example.com/x"]))
        key = draw(st.sampled_from(["matchAttribute", "distinctAttribute"]))
        named = draw(st.sampled_from([[], [r["name"] for r in reqs]]))
        devices["constraints"] = [{key: attribute, **({"requests": named} if named else {})}]
    if draw(st.booleans()):
        devices["config"] = [
            {"requests": [reqs[0]["name"]], "opaque": {"driver": DRIVER, "parameters": {"claim": name}}}
        ]
    metadata = {"name": name, "namespace": "default", "uid": f"uid-{name}"}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": metadata,
        "spec": {"devices": devices},
    }


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    nodes = [f"node-{i}" for i in range(draw(st.integers(1, 2)))]
    slices = [s for node in nodes for s in draw(node_slices(node))]
    if draw(st.integers(0, 3)) == 0:
        slices += draw(shared_pool())
    zones = [draw(st.sampled_from("ab")) for _ in nodes]
    node_objects = [
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": n, "labels": {"zone": z}}}
        for n, z in zip(nodes, zones, strict=True)
    ]
    earlier = [draw(claims(f"earlier-{i}")) for i in range(draw(st.integers(0, 4)))]
    return {
        "classes": [device_class(c) for c in CLASSES],
        "nodes": node_objects,
        "slices": slices,
        "earlier": earlier,
        "claim": draw(claims("new")),
    }
