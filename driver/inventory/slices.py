"""Devices -> ResourceSlice objects within the API limits (pure)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from driver.common.quantity import format_quantity
from driver.inventory.devices import CounterSet, Inventory, PublishedDevice

MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_WITH_COUNTERS = 64  # a slice where any device consumes counters
MAX_COUNTER_SETS_PER_SLICE = 8
SPEC_HASH_ANNOTATION = "gpu.fgpu.dev/spec-hash"


def device_json(device: PublishedDevice) -> dict[str, Any]:
    body: dict[str, Any] = {"name": device.name}
    if device.attributes:
        body["attributes"] = {name: {attr.kind: attr.value} for name, attr in sorted(device.attributes.items())}
    if device.capacity:
        body["capacity"] = {name: _capacity_json(device, name) for name in sorted(device.capacity)}
    if device.consumes:
        body["consumesCounters"] = [
            {"counterSet": counter_set, "counters": _counters_json(counters)}
            for counter_set, counters in sorted(device.consumes.items())
        ]
    if device.allow_multiple_allocations:
        body["allowMultipleAllocations"] = True
    if device.taints:
        body["taints"] = [
            {"key": t.key, "value": t.value, "effect": t.effect, "timeAdded": t.time_added} for t in device.taints
        ]
    return body


def _capacity_json(device: PublishedDevice, name: str) -> dict[str, Any]:
    capacity: dict[str, Any] = {"value": format_quantity(device.capacity[name])}
    policy = device.request_policies.get(name)
    if policy is not None:
        valid_range = {"min": format_quantity(policy.minimum), "step": format_quantity(policy.step)}
        if policy.maximum is not None:
            valid_range["max"] = format_quantity(policy.maximum)
        capacity["requestPolicy"] = {"default": format_quantity(policy.default), "validRange": valid_range}
    return capacity


def _counters_json(counters: dict[str, int]) -> dict[str, Any]:
    return {name: {"value": format_quantity(value)} for name, value in sorted(counters.items())}


def counter_set_json(counter_set: CounterSet) -> dict[str, Any]:
    return {"name": counter_set.name, "counters": _counters_json(counter_set.counters)}


def chunk_devices(devices: list[PublishedDevice], limit: int = MAX_DEVICES_PER_SLICE) -> list[list[PublishedDevice]]:
    return [devices[i : i + limit] for i in range(0, len(devices), limit)] or [[]]


def slice_name(node: str, driver: str, index: int) -> str:
    return f"{node}-{driver}-{index}"


def spec_hash(spec: dict[str, Any]) -> str:
    """A digest of a slice spec without the pool generation, to tell whether a slice must change."""
    stripped = {**spec, "pool": {k: v for k, v in spec["pool"].items() if k != "generation"}}
    return hashlib.sha256(json.dumps(stripped, sort_keys=True).encode()).hexdigest()[:32]


def build_slices(
    driver: str, node: str, inventory: Inventory, generation: int, owner: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """The node's pool (named after the node) as ResourceSlices, each owned by the Node if given:
    counter sets in slices of their own, then devices, each slice within the API's limits."""
    limit = MAX_DEVICES_WITH_COUNTERS if any(d.consumes for d in inventory.devices) else MAX_DEVICES_PER_SLICE
    counter_chunks = [
        inventory.counter_sets[i : i + MAX_COUNTER_SETS_PER_SLICE]
        for i in range(0, len(inventory.counter_sets), MAX_COUNTER_SETS_PER_SLICE)
    ]
    device_chunks = chunk_devices(inventory.devices, limit) if inventory.devices or not counter_chunks else []
    contents: list[tuple[str, list[dict[str, Any]]]] = [
        ("sharedCounters", [counter_set_json(c) for c in chunk]) for chunk in counter_chunks
    ] + [("devices", [device_json(d) for d in chunk]) for chunk in device_chunks]
    slices = []
    for index, (key, items) in enumerate(contents):
        spec = {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": len(contents)},
            key: items,
        }
        metadata: dict[str, Any] = {
            "name": slice_name(node, driver, index),
            "annotations": {SPEC_HASH_ANNOTATION: spec_hash(spec)},
        }
        if owner is not None:
            metadata["ownerReferences"] = [owner]
        slices.append({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": metadata, "spec": spec})
    return slices


def node_owner(node: dict[str, Any]) -> dict[str, Any]:
    """An owner reference to the Node, so the slices go when the node object goes."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "name": node["metadata"]["name"],
        "uid": node["metadata"]["uid"],
        "controller": True,
    }
