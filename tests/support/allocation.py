"""The allocator on small, hand-built inventories: mock dgx-h100 slices, the chart's DeviceClasses, claims."""

from __future__ import annotations

import re
from typing import Any

import yaml

from driver.allocator.cluster import ClusterAllocator, Placement, Snapshot
from driver.allocator.model import claim_from_object, class_from_object, slice_from_object
from driver.allocator.state import AllocatedState
from driver.inventory.discovery import discover_gpus
from driver.inventory.offers import node_inventory
from driver.inventory.sharing import SharingConfig
from driver.inventory.slices import build_slices
from driver.nvml.session import NvmlSession
from tests.support import ROOT

DRIVER = "gpu.fgpu.dev"


def h100_slices(*nodes: str) -> list[dict[str, Any]]:
    inventory = node_inventory(discover_gpus(NvmlSession.open("mock:dgx-h100")), SharingConfig())
    return [s for node in nodes for s in build_slices(DRIVER, node, inventory, generation=1, owner=None)]


def first_gpus(count: int, node: str = "n1") -> list[dict[str, Any]]:
    """A node with the first `count` GPUs of a DGX H100: their devices and counter sets only."""
    mine = re.compile(rf"gpu-({'|'.join(map(str, range(count)))})(-|$)")
    kept = []
    for slice_ in h100_slices(node):
        spec = slice_["spec"]
        spec["devices"] = [d for d in spec.get("devices", ()) if mine.match(d["name"])]
        spec["sharedCounters"] = [c for c in spec.get("sharedCounters", ()) if mine.match(c["name"])]
        kept.append(slice_)
    return kept


CLASSES = [d for d in yaml.safe_load_all((ROOT / "daemonset" / "deviceclasses.yaml").read_text()) if d]
# The second class carries an opaque config, so results show a class's config as upstream copies it.
CLASSES[1] = {
    **CLASSES[1],
    "spec": {**CLASSES[1]["spec"], "config": [{"opaque": {"driver": DRIVER, "parameters": {"a": 1}}}]},
}


def allocator(slices: list[dict[str, Any]], policy: str = "binpack", allocated: tuple = ()) -> ClusterAllocator:
    snapshot = Snapshot.from_slices([slice_from_object(s) for s in slices])
    classes = {c.name: c for c in map(class_from_object, CLASSES)}
    return ClusterAllocator(snapshot, classes, AllocatedState.from_allocations(allocated), policy)  # type: ignore[arg-type]


def claim(name: str, *requests: dict[str, Any], **devices: Any) -> Any:
    metadata = {"name": name, "namespace": "ns", "uid": f"uid-{name}"}
    return claim_from_object({"metadata": metadata, "spec": {"devices": {"requests": list(requests), **devices}}})


def exactly(cls: str, name: str = "r", selector: str | None = None, **more: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"deviceClassName": cls, **more}
    if selector:
        body["selectors"] = [{"cel": {"expression": selector}}]
    return {"name": name, "exactly": body}


def profile(name: str) -> str:
    return f'device.attributes["{DRIVER}"].profile == "{name}"'


def place(cluster: ClusterAllocator, c: Any) -> Placement:
    outcome = cluster.allocate(c)
    assert isinstance(outcome, Placement), outcome
    cluster.commit(outcome)
    return outcome


def devices(placement: Placement) -> list[str]:
    return [r["device"] for r in placement.allocation["devices"]["results"]]
