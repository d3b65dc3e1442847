"""Devices -> ResourceSlice objects within the API limits (pure)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from driver.devices import Device

MAX_DEVICES_PER_SLICE = 128
SPEC_HASH_ANNOTATION = "gpu.fgpu.dev/spec-hash"
BINARY_SUFFIXES = (("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10))


def format_quantity(value: int) -> str:
    """The canonical Kubernetes form of a whole number: the largest binary suffix that divides it."""
    for suffix, factor in BINARY_SUFFIXES:
        if value and value % factor == 0:
            return f"{value // factor}{suffix}"
    return str(value)


def device_json(device: Device) -> dict[str, Any]:
    body: dict[str, Any] = {"name": device.name}
    if device.attributes:
        body["attributes"] = {name: {attr.kind: attr.value} for name, attr in sorted(device.attributes.items())}
    if device.capacity:
        body["capacity"] = {name: {"value": format_quantity(v)} for name, v in sorted(device.capacity.items())}
    return body


def chunk_devices(devices: list[Device], limit: int = MAX_DEVICES_PER_SLICE) -> list[list[Device]]:
    return [devices[i : i + limit] for i in range(0, len(devices), limit)] or [[]]


def slice_name(node: str, driver: str, index: int) -> str:
    return f"{node}-{driver}-{index}"


def spec_hash(spec: dict[str, Any]) -> str:
    """A digest of a slice spec without the pool generation, to tell whether a slice must change."""
    stripped = {**spec, "pool": {k: v for k, v in spec["pool"].items() if k != "generation"}}
    return hashlib.sha256(json.dumps(stripped, sort_keys=True).encode()).hexdigest()[:32]


def build_slices(
    driver: str, node: str, devices: list[Device], generation: int, owner: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """The node's pool (named after the node) as ResourceSlices, each owned by the Node if given."""
    chunks = chunk_devices(devices)
    slices = []
    for index, chunk in enumerate(chunks):
        spec = {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": len(chunks)},
            "devices": [device_json(device) for device in chunk],
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
