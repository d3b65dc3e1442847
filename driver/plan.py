"""`fgpu plan`: an offline dry run of the allocator over files of slices, classes and claims."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

import yaml

from driver.allocator.cluster import ClusterAllocator, Failure, Snapshot
from driver.allocator.explain import node_picture
from driver.allocator.model import ObjectError, claim_from_object, class_from_object, slice_from_object
from driver.allocator.pools import Node
from driver.allocator.scoring import Policy
from driver.allocator.state import AllocatedState


def read_objects(paths: list[Path]) -> list[dict[str, Any]]:
    """Every object in the files: YAML or JSON, several documents a file, Lists unpacked."""
    objects: list[dict[str, Any]] = []
    for path in paths:
        try:
            documents = list(yaml.safe_load_all(path.read_text()))
        except (OSError, yaml.YAMLError) as error:
            raise ObjectError(f"{path}: {error}") from None
        for document in documents:
            if not document:
                continue
            if not isinstance(document, dict):
                raise ObjectError(f"{path}: expected Kubernetes objects, found {type(document).__name__}")
            objects.extend(
                document.get("items") or [] if str(document.get("kind", "")).endswith("List") else [document]
            )
    return objects


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
    slices = [slice_from_object(o) for o in by_kind.get("ResourceSlice", [])]
    nodes = [Node(o["metadata"]["name"], o["metadata"].get("labels") or {}) for o in by_kind.get("Node", [])]
    classes = {c.name: c for c in (class_from_object(o) for o in by_kind.get("DeviceClass", []))}
    claims = [claim_from_object(o) for o in by_kind.get("ResourceClaim", [])]
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
