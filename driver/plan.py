"""`fgpu plan`: an offline dry run of the allocator over files of slices, classes and claims."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO, TypeVar

from driver.allocator.cluster import ClusterAllocator, Failure, Snapshot
from driver.allocator.explain import node_picture
from driver.allocator.model import ObjectError, claim_from_object, class_from_object, slice_from_object
from driver.allocator.pools import Node
from driver.allocator.scoring import Policy
from driver.allocator.state import AllocatedState
from driver.yamlfile import YamlFileError, load_yaml_documents

T = TypeVar("T")


def read_objects(paths: list[Path]) -> list[dict[str, Any]]:
    """Every object in the files: YAML or JSON, several documents a file, Lists unpacked."""
    objects: list[dict[str, Any]] = []
    for path in paths:
        try:
            documents = load_yaml_documents(path)
        except YamlFileError as error:
            raise ObjectError(str(error)) from None
        if not any(documents):
            raise ObjectError(f"{path}: no objects in it (empty); give a file of Kubernetes objects")
        for number, document in enumerate(documents, 1):
            if not document:
                continue
            where = f"{path}: document {number}"
            if isinstance(document, dict) and str(document.get("kind", "")).endswith("List"):
                items = document.get("items") or []
                if not isinstance(items, list):
                    raise ObjectError(f"{where}: items is a {type(items).__name__}, not a list of objects")
                objects.extend(_checked(item, f"{where}, items[{i}]") for i, item in enumerate(items))
            else:
                objects.append(_checked(document, where))
    return objects


def _checked(obj: Any, where: str) -> dict[str, Any]:
    """An object the allocator can name in what it reports: a mapping with a kind and metadata.name."""
    if not isinstance(obj, dict):
        raise ObjectError(f"{where}: expected a Kubernetes object, found {type(obj).__name__}")
    metadata = obj.get("metadata")
    if not isinstance(metadata, dict) or not metadata.get("name") or not isinstance(metadata["name"], str):
        raise ObjectError(f"{where}: {obj.get('kind') or 'object'} without metadata.name; give every object a name")
    return obj


def _converted(convert: Callable[[dict[str, Any]], T], obj: dict[str, Any]) -> T:
    """The model's conversions trust the shape the API server guarantees; a hand-written file may
    break it anywhere, so any such failure becomes one line naming the object."""
    try:
        return convert(obj)
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        if isinstance(err, ObjectError):
            raise
        raise ObjectError(f"{obj['kind']} {obj['metadata']['name']}: not a valid {obj['kind']}: {err!r}") from None


def plan(
    slice_paths: list[Path],
    class_paths: list[Path],
    claim_paths: list[Path],
    policy: Policy,
    out: TextIO,
    as_json: bool = False,
) -> int:
    objects = read_objects(slice_paths) + read_objects(class_paths) + read_objects(claim_paths)
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for obj in objects:
        by_kind.setdefault(str(obj.get("kind")), []).append(obj)
    slices = [_converted(slice_from_object, o) for o in by_kind.get("ResourceSlice", [])]
    nodes = [Node(o["metadata"]["name"], o["metadata"].get("labels") or {}) for o in by_kind.get("Node", [])]
    classes = {c.name: c for c in (_converted(class_from_object, o) for o in by_kind.get("DeviceClass", []))}
    claims = [_converted(claim_from_object, o) for o in by_kind.get("ResourceClaim", [])]
    state = AllocatedState.from_allocations(c.allocation for c in claims if c.allocation)
    cluster = ClusterAllocator(Snapshot.from_slices(slices, nodes), classes, state, policy)
    report: list[dict[str, Any]] = []
    failed = 0
    for claim in (c for c in claims if not c.allocation):
        outcome = cluster.allocate(claim)
        if isinstance(outcome, Failure):
            failed += 1
            report.append({"claim": claim.key, "error": outcome.reason})
            continue
        cluster.commit(outcome)
        devices = [
            r["device"] + (" (share)" if "shareID" in r else "") for r in outcome.allocation["devices"]["results"]
        ]
        report.append({"claim": claim.key, "node": outcome.node, "devices": devices, "allocation": outcome.allocation})
    nodes_report = {node: node_picture(cluster, node) for node in sorted(cluster.snapshot.pools)}
    if as_json:
        json.dump({"claims": report, "nodes": nodes_report}, out, indent=2)
        out.write("\n")
        return 1 if failed else 0
    for entry in report:
        if "error" in entry:
            out.write(f"{entry['claim']}: cannot allocate: {entry['error']}\n")
        else:
            out.write(f"{entry['claim']}: {entry['node']}: {', '.join(entry['devices'])}\n")
    out.write(f"\n{len(report) - failed} allocated, {failed} failed\n\nfree capacity per node:\n")
    for node, lines in nodes_report.items():
        out.write(f"{node}\n" + "".join(f"{line}\n" for line in lines))
    return 1 if failed else 0
