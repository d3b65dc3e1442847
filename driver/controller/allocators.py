"""The allocator kept from pass to pass: the snapshot of the pools and the results its state counts.

Slices and nodes are gathered afresh only when a node's labels change; a slice added, changed or
deleted touches only its pool. The allocator's state is told only what changed in the claims and
ledgers, so its per-node caches survive for the nodes nothing touched; a standby keeps it current
too, so that it places claims at once when it wins the lease. This module alone keeps the count of
what the allocator holds: placements committed by a pass are counted here, reservations set aside
and put back here."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from driver.allocator.cluster import ClusterAllocator, Placement, Snapshot
from driver.allocator.model import Slice, class_from_object
from driver.allocator.pools import Node
from driver.allocator.scoring import Policy
from driver.allocator.state import AllocatedState
from driver.controller.informer import Informer
from driver.controller.ledger import Ledgers, ResultKey, allocated_results, results_of


@dataclass
class Counted:
    """The allocator kept between passes and the results its state counts."""

    allocator: ClusterAllocator
    key: tuple[int, int]  # the snapshot and the classes it was built on
    results: dict[ResultKey, dict[str, Any]]


@dataclass
class SetAside:
    """Reserved devices freed for their own claim while it is placed (AllocatorCache.set_aside)."""

    allocator: ClusterAllocator
    reserved: list[dict[str, Any]]
    counted: dict[ResultKey, dict[str, Any]]  # the results the kept allocator counts
    keys: dict[ResultKey, dict[str, Any]]  # the reservations' among them

    def put_back(self) -> None:
        """Placing failed: the devices are held for the claim again."""
        if self.reserved:
            self.allocator.add("", {"devices": {"results": self.reserved}})
            self.counted.update(self.keys)


class AllocatorCache:
    def __init__(self, informers: dict[str, Informer], ledgers: Ledgers, policy: Policy) -> None:
        self._informers, self._ledgers, self._policy = informers, ledgers, policy
        self._snapshot: Snapshot | None = None
        self._counted: Counted | None = None
        self._snapshot_nodes = -1  # hash of the nodes (and labels) the snapshot was gathered for
        self._snapshot_slices: tuple[int, dict[str, Slice]] = (-1, {})  # informer version, slices by name

    def snapshot(self) -> Snapshot:
        """Slices and nodes as the allocator sees them: gathered afresh only when a node's labels
        change (other node updates come often and matter not); a slice added, changed or deleted
        touches only its pool, for the nodes that see it (and the allocator's caches of those)."""
        nodes = sorted(
            (n["metadata"]["name"], tuple(sorted((n["metadata"].get("labels") or {}).items())))
            for n in self._informers["nodes"].items()
        )
        slices_version = self._informers["slices"].version
        if self._snapshot is None or hash(tuple(nodes)) != self._snapshot_nodes:
            slices = self._informers["slices"].items()
            self._snapshot = Snapshot.from_slices(slices, [Node(name, dict(labels)) for name, labels in nodes])
            self._snapshot_nodes = hash(tuple(nodes))
            self._snapshot_slices = (slices_version, {s.name: s for s in slices})
        elif slices_version != self._snapshot_slices[0]:
            before, now = self._snapshot_slices[1], {s.name: s for s in self._informers["slices"].items()}
            added = [s for name, s in now.items() if before.get(name) is not s]
            removed = [s for name, s in before.items() if now.get(name) is not s]
            counted = self._counted
            if counted is not None and counted.allocator.snapshot is self._snapshot:
                counted.allocator.update_slices(added, removed)
            else:
                self._snapshot.update(added, removed)
            self._snapshot_slices = (slices_version, now)
        return self._snapshot

    def allocator(self) -> ClusterAllocator:
        """Everything the claims hold and the ledgers record (as of the ledger versions the pass's
        writes are conditioned on). The allocator is kept from pass to pass and told only what
        changed, so its per-node caches survive for the nodes nothing touched."""
        snapshot = self.snapshot()
        results = allocated_results(self._informers["claims"].items(), self._ledgers.objects())
        key = (id(snapshot), self._informers["classes"].version)
        counted = self._counted
        if counted is None or counted.key != key:
            classes = {}
            for obj in self._informers["classes"].items():
                cls = class_from_object(obj)
                classes[cls.name] = cls
            state = AllocatedState()
            for result in results.values():
                state.add_result(result)
            self._counted = Counted(ClusterAllocator(snapshot, classes, state, self._policy), key, results)
            return self._counted.allocator
        gone = [counted.results[k] for k in counted.results.keys() - results.keys()]
        new = [results[k] for k in results.keys() - counted.results.keys()]
        counted.allocator.release("", {"devices": {"results": gone}})
        counted.allocator.add("", {"devices": {"results": new}})
        counted.results = results
        return counted.allocator

    def forget(self) -> None:
        """The claims and ledgers are read afresh: the next pass counts them from the start."""
        self._counted = None

    def count(self, placements: Iterable[tuple[dict[str, Any], Placement]]) -> None:
        """Placements just committed to the allocator: counted, so the next pass does not add them
        again when it finds them in the claims (or takes them out if they were never written)."""
        if self._counted is not None:
            for obj, placement in placements:
                self._counted.results.update(results_of(obj["metadata"].get("uid", ""), placement.allocation))

    def set_aside(
        self,
        allocator: ClusterAllocator,
        objects: Sequence[dict[str, Any]],
        reserved: Mapping[str, list[dict[str, Any]]],
    ) -> SetAside:
        """Free the devices reserved for these claims (`reserved`: the pass's reservations,
        making_room.py), to place them; the caller puts them back if placing fails. Placed, a
        reservation stays out of the allocator's count until a pass finds it in the ledgers again
        (it is dropped there once the claim is allocated)."""
        uids = {o["metadata"].get("uid", "") for o in objects}
        held = [r for uid in uids for r in reserved.get(uid, ())]
        counted = self._counted.results if self._counted is not None else {}
        keys = {k: r for k, r in counted.items() if k[0] in uids}
        if held:
            allocator.release("", {"devices": {"results": held}})
            for key in keys:
                del counted[key]
        return SetAside(allocator, held, counted, keys)
