"""The allocator kept from pass to pass: the snapshot of the pools and the results its state counts.

Slices and nodes are gathered afresh only when a node's labels change; a slice added, changed or
deleted touches only its pool. The allocator's state is told only what changed in the claims and
ledgers, and the allocator which nodes' pods changed (follow), so its per-node caches survive for
the nodes nothing touched; a standby keeps it current too, so that it places claims at once when it
wins the lease. This module alone keeps the count of what the allocator holds: placements committed
by a pass are counted here, reservations set aside and put back here. A share is counted with its
tenant (its claim's namespace and uid, the tenancy of its class: driver/claims/tenancy.py) where
its claim's status has it; a share known only from a ledger (the claim's status not written yet, or
a reservation) does not say which request it is for, so it is counted without one and counted
again, with it, once the claim's status has it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from driver.allocator.cluster import ClusterAllocator, HeldResult, Placement, Snapshot
from driver.allocator.lifetimes import expected_end
from driver.allocator.model import Slice, class_from_object
from driver.allocator.policies import Policy
from driver.allocator.pools import Node
from driver.allocator.state import AllocatedState
from driver.claims.tenancy import Tenant
from driver.controller.ledger import Ledgers, ResultKey, allocated_results, results_of
from driver.kube.informer import Informer
from driver.scheduling.nodefit import NodeRoom


@dataclass
class Counted:
    """The allocator kept between passes and the results its state counts."""

    allocator: ClusterAllocator
    key: tuple[int, int]  # the snapshot and the classes it was built on
    results: dict[ResultKey, dict[str, Any]]
    tenants: dict[ResultKey, Tenant] = field(default_factory=dict)  # the shares counted with one
    unnamed: set[ResultKey] = field(default_factory=set)  # shares counted from a ledger: no tenant yet

    def held(self, key: ResultKey) -> HeldResult:
        return self.results[key], self.tenants.get(key)

    def count(self, key: ResultKey, result: dict[str, Any], tenant: Tenant | None) -> HeldResult:
        """The result as counted from now on (the caller adds it to the allocator)."""
        self.results[key] = result
        if tenant is not None:
            self.tenants[key] = tenant
        if result.get("shareID") and "request" not in result:
            self.unnamed.add(key)
        return result, tenant

    def uncount(self, key: ResultKey) -> HeldResult:
        """The result as it was counted, no longer (the caller releases it from the allocator)."""
        self.unnamed.discard(key)
        return self.results.pop(key), self.tenants.pop(key, None)


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
    def __init__(
        self, informers: dict[str, Informer], ledgers: Ledgers, policy: Policy, lifetime_hints: bool = True
    ) -> None:
        self._informers, self._ledgers, self._policy = informers, ledgers, policy
        self._lifetime_hints = lifetime_hints
        self._snapshot: Snapshot | None = None
        self._counted: Counted | None = None
        # node -> (its object as last read, its labels): what the snapshot was gathered for
        self._node_labels: dict[str, tuple[Any, tuple[tuple[str, str], ...]]] = {}
        self._snapshot_slices: tuple[int, dict[str, Slice]] = (-1, {})  # informer version, slices by name
        self._room: NodeRoom | None = None  # the last room the allocator placed with (follow)

    def snapshot(self) -> Snapshot:
        """Slices and nodes as the allocator sees them: gathered afresh only when a node's labels
        change (other node updates come often and matter not); a slice added, changed or deleted
        touches only its pool, for the nodes that see it (and the allocator's caches of those)."""
        relabelled = self._nodes_relabelled()
        slices_version = self._informers["slices"].version
        if self._snapshot is None or relabelled:
            slices = self._informers["slices"].items()
            nodes = [Node(name, dict(labels)) for name, (_, labels) in sorted(self._node_labels.items())]
            self._snapshot = Snapshot.from_slices(slices, nodes)
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

    def _nodes_relabelled(self) -> bool:
        """Whether a node came, went or changed its labels since last asked: the labels are read
        again only from node objects the informer replaced (at 5,000 nodes, sorting every node's
        labels for each pass took an eighth of the controller's time)."""
        before, now = self._node_labels, {}
        relabelled = False
        for obj in self._informers["nodes"].items():
            name = obj["metadata"]["name"]
            kept = before.get(name)
            if kept is None or kept[0] is not obj:
                labels = tuple(sorted((obj["metadata"].get("labels") or {}).items()))
                relabelled = relabelled or kept is None or kept[1] != labels
                kept = (obj, labels)
            now[name] = kept
        self._node_labels = now
        return relabelled or len(now) != len(before)

    def allocator(self) -> ClusterAllocator:
        """Everything the claims hold and the ledgers record (as of the ledger versions the pass's
        writes are conditioned on). The allocator is kept from pass to pass and told only what
        changed, so its per-node caches survive for the nodes nothing touched."""
        snapshot = self.snapshot()
        claims = self._informers["claims"].items()
        results = allocated_results(claims, self._ledgers.objects())
        key = (id(snapshot), self._informers["classes"].version)
        counted = self._counted
        if counted is None or counted.key != key:
            classes = {}
            for obj in self._informers["classes"].items():
                cls = class_from_object(obj)
                classes[cls.name] = cls
            allocator = ClusterAllocator(snapshot, classes, AllocatedState(), self._policy, self._lifetime_hints)
            counted = Counted(allocator, key, {})
            self._counted = counted
        # Shares first counted from a ledger, now in their claim's status: counted again, with a tenant.
        named = {k for k in counted.unnamed & results.keys() if "request" in results[k]}
        gone = [counted.uncount(k) for k in (counted.results.keys() - results.keys()) | named]
        added = results.keys() - counted.results.keys()
        by_uid = {obj["metadata"].get("uid", ""): obj for obj in claims} if added else {}
        state = counted.allocator.state
        new = [counted.count(k, results[k], _tenant(state, k, results[k], by_uid)) for k in added]
        counted.allocator.recount(gone, new, _ends(new, by_uid))
        counted.unnamed &= counted.results.keys()  # not those set aside since (set_aside)
        return counted.allocator

    def follow(self, room: NodeRoom) -> NodeRoom:
        """A room for pods made afresh from the caches (fit.py): the kept allocator is told which
        nodes hold other pods, or have other facts, than in the room it placed with before (what
        was placed on that one since counted), so its policy reads those nodes' room again
        (ClusterAllocator.pods_changed): kube-scheduler places the pods without claims, and no
        allocation tells the allocator of them. Returns the room."""
        if self._counted is not None:
            before = self._room
            self._counted.allocator.pods_changed(room.changed_since(before) if before is not None else room.nodes)
        self._room = room
        return room

    def forget(self) -> None:
        """The claims and ledgers are read afresh: the next pass counts them from the start."""
        self._counted = None

    def count(self, placements: Iterable[tuple[dict[str, Any], Placement]]) -> None:
        """Placements just committed to the allocator: counted, so the next pass does not add them
        again when it finds them in the claims (or takes them out if they were never written)."""
        if self._counted is not None:
            state = self._counted.allocator.state
            for obj, placement in placements:
                for key, result in results_of(obj["metadata"].get("uid", ""), placement.allocation).items():
                    configs = placement.allocation["devices"].get("config") or ()
                    tenant = state.share_tenant(result, configs, placement.claim.namespace, placement.claim.uid)
                    self._counted.count(key, result, tenant)

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
        keys = {k: r for k, r in counted.items() if k[0] in uids} if held else {}
        if held:
            allocator.release("", {"devices": {"results": held}})
            for key in keys:
                del counted[key]
        return SetAside(allocator, held, counted, keys)


def _ends(new: Sequence[HeldResult], by_uid: dict[str, Any]) -> dict[str, float]:
    """When the claims of the new shares counted with a tenant are expected to end, where they say."""
    uids = {tenant.claim_uid for _, tenant in new if tenant is not None}
    found = {uid: expected_end(by_uid[uid].get("metadata") or {}) for uid in uids if uid in by_uid}
    return {uid: end for uid, end in found.items() if end is not None}


def _tenant(state: AllocatedState, key: ResultKey, result: dict[str, Any], by_uid: dict[str, Any]) -> Tenant | None:
    """Whose share the result is, where its claim's own allocation has it (a ledger's result names
    no request, so no class: not known until the claim's status has it)."""
    claim = by_uid.get(key[0])
    allocation = ((claim or {}).get("status") or {}).get("allocation")
    if claim is None or not allocation or "request" not in result:
        return None
    configs = (allocation.get("devices") or {}).get("config") or ()
    return state.share_tenant(result, configs, claim["metadata"].get("namespace", ""), key[0])
