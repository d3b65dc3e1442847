"""Publishes, for every Node labelled with a machine type, the ResourceSlices fgpu's plugin on
that machine would, and removes them when the node goes.

Two informers (the labelled Nodes, the slices this publisher wrote) wake one loop that makes the
API server hold what the nodes call for: a node's pool is written whole (its slices created,
replaced or deleted, the pool generation above any it had) or left alone when its slices' spec
hashes match; the slices of a node no longer there (or no longer labelled) are deleted. The slices
are owned by their Node, so the garbage collector removes them too when this publisher is down.
Writes go out from a pool of threads, each pool's writes in order."""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from driver.fleet.machine_types import MACHINE_LABEL, MachineType, MachineTypeError, machine_inventory, machine_type_of
from driver.inventory.slices import SPEC_HASH_ANNOTATION, build_slices, node_owner
from driver.kube.errors import KubeError, NotFoundError
from driver.kube.informer import Informer

log = logging.getLogger(__name__)
PUBLISHER_LABEL = "gpu.fgpu.dev/published-by"
PUBLISHER = "fgpu-fleet"
RETRY_S = 1.0  # after a pass with failed writes


@dataclass(frozen=True)
class FleetNode:
    """A labelled Node as the publisher keeps it."""

    name: str
    uid: str
    machine_type: MachineType | None  # None: the label names no machine type we can publish
    problem: str = ""


@dataclass(frozen=True)
class PublishedSlice:
    """One of our slices as the publisher keeps it."""

    name: str
    node: str
    generation: int
    spec_hash: str
    resource_version: str


@dataclass(frozen=True)
class PassResult:
    written: int  # pools written (created, changed or removed)
    failed: int  # pools whose writes failed


def fleet_node(default_offer: str) -> Callable[[dict[str, Any]], FleetNode]:
    def transform(node: dict[str, Any]) -> FleetNode:
        metadata = node["metadata"]
        try:
            return FleetNode(metadata["name"], metadata["uid"], machine_type_of(node, default_offer))
        except MachineTypeError as err:
            return FleetNode(metadata["name"], metadata["uid"], None, str(err))

    return transform


def published_slice(body: dict[str, Any]) -> PublishedSlice:
    metadata, spec = body["metadata"], body["spec"]
    return PublishedSlice(
        name=metadata["name"],
        node=spec.get("nodeName") or "",
        generation=int(spec["pool"]["generation"]),
        spec_hash=(metadata.get("annotations") or {}).get(SPEC_HASH_ANNOTATION, ""),
        resource_version=metadata.get("resourceVersion", ""),
    )


class FleetPublisher:
    """The loop; `api` lists and watches (list_pages, watch) and writes slices (create_slice,
    replace_slice, delete_slice): driver.kube.client.ClientKubeApi."""

    def __init__(self, api: Any, driver: str, default_offer: str, workers: int = 16) -> None:
        self._api = api
        self._driver = driver
        self._changed = threading.Event()
        self._stop = threading.Event()
        self.nodes = Informer(api, "nodes", self._changed, label_selector=MACHINE_LABEL,
                              transform=fleet_node(default_offer))  # fmt: skip
        self.slices = Informer(api, "slices", self._changed, label_selector=f"{PUBLISHER_LABEL}={PUBLISHER}",
                               transform=published_slice)  # fmt: skip
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fleet-write")
        self._reported: dict[str, str] = {}  # node -> the problem last logged for it
        self._wanted: dict[str, tuple[MachineType, dict[str, str]]] = {}  # node -> its type, _wanted_hashes
        self.passes = 0

    def run(self) -> None:
        """Publish until stop()."""
        self.nodes.start()
        self.slices.start()
        while not self._stop.is_set():
            self._changed.wait()
            if self._stop.is_set():
                break
            self._changed.clear()
            if self.nodes.synced.is_set() and self.slices.synced.is_set() and self.reconcile().failed:
                self._stop.wait(RETRY_S)
                self._changed.set()
        self._pool.shutdown(wait=True)

    def stop(self) -> None:
        self._stop.set()
        self.nodes.stop()
        self.slices.stop()
        self._changed.set()

    def reconcile(self) -> PassResult:
        """One pass: every node's pool written where it differs."""
        by_node: dict[str, list[PublishedSlice]] = defaultdict(list)
        for published in self.slices.items():
            by_node[published.node].append(published)
        writes = []
        for node in self.nodes.items():
            existing = by_node.pop(node.name, [])
            if node.machine_type is None:
                self._report(node)
                if existing:
                    writes.append(self._pool.submit(self._write_pool, node.name, [], existing))
                continue
            if not _up_to_date(existing, self._wanted_hashes(node)):
                generation = max((s.generation for s in existing), default=0) + 1
                writes.append(self._pool.submit(self._write_pool, node.name, self._desired(node, generation), existing))
        for node_name, existing in by_node.items():  # nodes gone or no longer labelled
            writes.append(self._pool.submit(self._write_pool, node_name, [], existing))
        present = {node.name for node in self.nodes.items()}
        self._wanted = {name: wanted for name, wanted in self._wanted.items() if name in present}
        self._reported = {name: problem for name, problem in self._reported.items() if name in present}
        failed = sum(not write.result() for write in writes)
        self.passes += 1
        return PassResult(written=len(writes) - failed, failed=failed)

    def _wanted_hashes(self, node: FleetNode) -> dict[str, str]:
        """Slice name -> spec hash of the node's pool: what a pass compares with what is published.
        Kept per node and machine type (a spec names its node, not its generation or owner), so
        that a pass, which any node's heartbeat starts, builds no slices for the nodes up to date."""
        assert node.machine_type is not None
        kept = self._wanted.get(node.name)
        if kept is None or kept[0] != node.machine_type:
            hashes = {
                s["metadata"]["name"]: s["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
                for s in self._desired(node, 0)
            }
            kept = self._wanted[node.name] = (node.machine_type, hashes)
        return kept[1]

    def _desired(self, node: FleetNode, generation: int) -> list[dict[str, Any]]:
        assert node.machine_type is not None
        owner = node_owner({"metadata": {"name": node.name, "uid": node.uid}})
        slices = build_slices(self._driver, node.name, machine_inventory(node.machine_type), generation, owner)
        for body in slices:
            body["metadata"]["labels"] = {PUBLISHER_LABEL: PUBLISHER}
        return slices

    def _report(self, node: FleetNode) -> None:
        if self._reported.get(node.name) != node.problem:
            log.warning("node %s: %s; publishing nothing for it", node.name, node.problem)
            self._reported[node.name] = node.problem

    def _write_pool(self, node: str, desired: list[dict[str, Any]], existing: list[PublishedSlice]) -> bool:
        """Make the node's pool `desired`: replace what is there by name, create the rest, delete
        what is left. False when a write failed (logged; the loop tries again)."""
        by_name = {s.name: s for s in existing}
        try:
            for body in desired:
                name = body["metadata"]["name"]
                if name in by_name:
                    body["metadata"]["resourceVersion"] = by_name.pop(name).resource_version
                    self.slices.update(self._api.replace_slice(name, body))
                else:
                    self.slices.update(self._api.create_slice(body))
            for gone in by_name.values():
                self._api.delete_slice(gone.name)
                self.slices.forget({"metadata": {"name": gone.name}})
        except NotFoundError as err:  # the node went meanwhile: the garbage collector has its slices
            log.info("node %s: %s", node, err)
        except KubeError as err:
            log.warning("publishing the slices of node %s failed: %s; trying again", node, err)
            return False
        return True


def _up_to_date(existing: list[PublishedSlice], wanted: dict[str, str]) -> bool:
    have = {s.name: s.spec_hash for s in existing}
    return wanted == have and len({s.generation for s in existing}) <= 1
