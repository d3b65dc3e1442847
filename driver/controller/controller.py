"""The controller loop: informer caches in, allocations and lifted scheduling gates out.

Claims opt in with the label `gpu.fgpu.dev/allocator=fgpu` (set it on a ResourceClaimTemplate's
metadata and every claim made from it carries it). Their pods carry the scheduling gate
`gpu.fgpu.dev/allocation`, so kube-scheduler leaves them alone until the controller has written
every claim's allocation; it then lifts the gate and kube-scheduler binds the pod to the node the
allocation names. Gangs: claims labelled `gpu.fgpu.dev/gang=<name>` and `gpu.fgpu.dev/gang-size=<n>`
are allocated together once all n exist, all or none."""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from driver.allocator.cluster import ClusterAllocator, Failure, Placement, Snapshot
from driver.allocator.model import Claim, ObjectError, claim_from_object, class_from_object, slice_from_object
from driver.allocator.pools import Node
from driver.allocator.scoring import Policy
from driver.allocator.state import AllocatedState
from driver.controller import metrics
from driver.controller.informer import Informer, object_key
from driver.controller.leader import LeaderElector
from driver.kube import ConflictError, KubeError

log = logging.getLogger(__name__)
OPT_IN_LABEL = "gpu.fgpu.dev/allocator"
OPT_IN_VALUE = "fgpu"
GANG_LABEL = "gpu.fgpu.dev/gang"
GANG_SIZE_LABEL = "gpu.fgpu.dev/gang-size"
SCHEDULING_GATE = "gpu.fgpu.dev/allocation"
DELETE_PROTECTION = "resource.kubernetes.io/delete-protection"
COMPONENT = "fgpu-controller"


def opted_in(claim: dict[str, Any]) -> bool:
    return ((claim.get("metadata") or {}).get("labels") or {}).get(OPT_IN_LABEL) == OPT_IN_VALUE


def pending(claim: dict[str, Any]) -> bool:
    meta = claim.get("metadata") or {}
    return opted_in(claim) and not (claim.get("status") or {}).get("allocation") and not meta.get("deletionTimestamp")


def pod_claim_names(pod: dict[str, Any]) -> list[str] | None:
    """The claims a pod uses, or None while one made from a template has no name yet."""
    statuses = {
        s["name"]: s.get("resourceClaimName") for s in (pod.get("status") or {}).get("resourceClaimStatuses") or ()
    }
    names = []
    for ref in (pod.get("spec") or {}).get("resourceClaims") or ():
        name = ref.get("resourceClaimName") or statuses.get(ref.get("name"))
        if not name:
            return None
        names.append(name)
    return names


def gang_of(claim: Claim) -> tuple[str, int] | None:
    name = claim.labels.get(GANG_LABEL)
    if not name:
        return None
    try:
        return f"{claim.namespace}/{name}", max(1, int(claim.labels.get(GANG_SIZE_LABEL, "1")))
    except ValueError:
        return f"{claim.namespace}/{name}", 0  # a size that is not a number: reported, never placed


class Controller:
    def __init__(
        self, api: Any, identity: str, policy: Policy = "binpack", lease_namespace: str = "kube-system"
    ) -> None:
        self.api, self.policy = api, policy
        self.changed = threading.Event()
        self.informers = {
            kind: Informer(api, kind, self.changed) for kind in ("slices", "classes", "claims", "pods", "nodes")
        }
        self.leader = LeaderElector(api, lease_namespace, "fgpu-controller", identity)
        self._snapshot: Snapshot | None = None
        self._snapshot_version: tuple[int, int] = (-1, -1)
        self._reported: dict[str, str] = {}  # claim uid -> last failure reported as an Event
        self.stop_event = threading.Event()

    # --- running ------------------------------------------------------------------------------

    def run(self) -> None:
        for informer in self.informers.values():
            informer.start()
        threading.Thread(target=self.leader.run, args=(self.stop_event,), name="leader", daemon=True).start()
        while not self.stop_event.is_set():
            self.changed.wait(timeout=5.0)
            self.stop_event.wait(0.05)  # let a burst of watch events land: one pass for all of them
            self.changed.clear()
            metrics.LEADER.set(self.leader.is_leader.is_set())
            if not self.leader.is_leader.is_set() or not all(i.synced.is_set() for i in self.informers.values()):
                continue
            try:
                self.run_pass()
            except KubeError as error:
                log.warning("pass ended early: %s", error)
                self.stop_event.wait(1.0)
                self.changed.set()

    def stop(self) -> None:
        self.stop_event.set()
        self.changed.set()
        for informer in self.informers.values():
            informer.stop()

    # --- one pass -----------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        version = (self.informers["slices"].version, self.informers["nodes"].version)
        if self._snapshot is None or version != self._snapshot_version:
            slices = []
            for obj in self.informers["slices"].items():
                try:
                    slices.append(slice_from_object(obj))
                except ObjectError as error:
                    log.warning("ignoring ResourceSlice: %s", error)
            nodes = [
                Node(n["metadata"]["name"], n["metadata"].get("labels") or {}) for n in self.informers["nodes"].items()
            ]
            self._snapshot, self._snapshot_version = Snapshot.from_slices(slices, nodes), version
        return self._snapshot

    def allocator(self) -> ClusterAllocator:
        classes = {}
        for obj in self.informers["classes"].items():
            cls = class_from_object(obj)
            classes[cls.name] = cls
        claims = self.informers["claims"].items()
        state = AllocatedState.from_allocations((c.get("status") or {}).get("allocation") for c in claims)
        return ClusterAllocator(self.snapshot(), classes, state, self.policy)

    def run_pass(self) -> None:
        waiting = sorted(
            (c for c in self.informers["claims"].items() if pending(c)),
            key=lambda c: (c["metadata"].get("creationTimestamp", ""), c["metadata"]["name"]),
        )
        metrics.PENDING.set(len(waiting))
        if waiting:
            self._allocate(waiting)
        self._lift_gates()

    def _allocate(self, waiting: list[dict[str, Any]]) -> None:
        allocator = self.allocator()
        gangs: dict[tuple[str, int], list[Claim]] = defaultdict(list)
        for obj in waiting:
            try:
                claim = claim_from_object(obj)
            except ObjectError as error:
                self._report(obj, f"cannot read the claim: {error}")
                continue
            gang = gang_of(claim)
            if gang is not None:
                gangs[gang].append(claim)
                continue
            self._allocate_one(allocator, claim, obj)
        for (name, size), members in gangs.items():
            self._allocate_gang(allocator, name, size, members)

    def _allocate_one(self, allocator: ClusterAllocator, claim: Claim, obj: dict[str, Any]) -> None:
        started = time.perf_counter()
        outcome = allocator.allocate(claim)
        metrics.ALLOCATION_SECONDS.observe(time.perf_counter() - started)
        if isinstance(outcome, Failure):
            metrics.ALLOCATIONS.labels("unschedulable").inc()
            self._report(obj, outcome.reason)
            return
        allocator.commit(outcome)
        if not self._write(obj, outcome):
            allocator.release(outcome.node, outcome.allocation)

    def _allocate_gang(self, allocator: ClusterAllocator, name: str, size: int, members: list[Claim]) -> None:
        objects = {c.key: self.informers["claims"].get(c.key) for c in members}
        if size == 0:
            for obj in objects.values():
                self._report(obj, f"label {GANG_SIZE_LABEL} must be a whole number")
            return
        allocated = [c for c in self._gang_claims(name) if not pending(c)]
        if len(members) + len(allocated) < size:
            for obj in objects.values():
                self._report(
                    obj,
                    f"gang {name} waits for {size - len(members) - len(allocated)} more claim(s) of {size}",
                    warning=False,
                )
            return
        outcome = allocator.allocate_gang(members)
        if isinstance(outcome, Failure):
            metrics.GANGS.labels("unschedulable").inc()
            for obj in objects.values():
                self._report(obj, outcome.reason)
            if allocated and len(allocated) < size:
                # Members left allocated by an interrupted pass: all or none, so give them back.
                self._take_back(allocator, allocated)
            return
        written: list[str] = []
        for placement in outcome:
            if not self._write(objects[placement.claim.key], placement):
                # All or none: a write that fails takes back the others.
                for rest in outcome:
                    allocator.release(rest.node, rest.allocation)
                self._take_back(None, [o for key in written if (o := self.informers["claims"].get(key))])
                metrics.GANGS.labels("interrupted").inc()
                return
            written.append(placement.claim.key)
        metrics.GANGS.labels("allocated").inc()

    def _gang_claims(self, gang: str) -> list[dict[str, Any]]:
        namespace, name = gang.split("/", 1)
        return [
            c
            for c in self.informers["claims"].items()
            if c["metadata"].get("namespace") == namespace
            and (c["metadata"].get("labels") or {}).get(GANG_LABEL) == name
        ]

    def _gang_whole(self, obj: dict[str, Any]) -> bool:
        """Whether a claim can be used: not in a gang, or every claim of its gang is allocated."""
        gang = gang_of(claim_from_object(obj)) if opted_in(obj) else None
        if gang is None:
            return True
        members = self._gang_claims(gang[0])
        return len(members) >= gang[1] and not any(pending(c) for c in members)

    # --- writes -------------------------------------------------------------------------------

    def _write(self, obj: dict[str, Any] | None, placement: Placement) -> bool:
        if obj is None:
            return False
        try:
            if DELETE_PROTECTION not in (obj["metadata"].get("finalizers") or []):
                meta = {
                    **obj["metadata"],
                    "finalizers": [*(obj["metadata"].get("finalizers") or []), DELETE_PROTECTION],
                }
                obj = self.api.replace_claim({**obj, "metadata": meta})
            allocation = {**placement.allocation, "allocationTimestamp": _now()}
            updated = self.api.replace_claim_status(
                {**obj, "status": {**(obj.get("status") or {}), "allocation": allocation}}
            )
        except ConflictError:
            metrics.CONFLICTS.inc()
            metrics.ALLOCATIONS.labels("conflict").inc()
            self.changed.set()  # the watch brings the fresh claim; the next pass retries on it
            return False
        except KubeError as error:  # an outage: nothing lost, the next pass tries again
            metrics.ALLOCATIONS.labels("error").inc()
            log.warning("cannot write the allocation of %s: %s", placement.claim.key, error)
            self.changed.set()
            return False
        self.informers["claims"].update(updated)
        metrics.ALLOCATIONS.labels("allocated").inc()
        log.info("allocated %s on %s", placement.claim.key, placement.node)
        return True

    def _take_back(self, allocator: ClusterAllocator | None, claims: Iterable[dict[str, Any]]) -> None:
        """Clear allocations we wrote; one that cannot be cleared now is retried on a later pass."""
        for obj in claims:
            status = {k: v for k, v in (obj.get("status") or {}).items() if k != "allocation"}
            try:
                self.informers["claims"].update(self.api.replace_claim_status({**obj, "status": status}))
            except KubeError as error:
                log.error("could not take back the allocation of %s: %s", object_key(obj), error)
                continue
            if allocator is not None:
                allocator.state.remove_allocation((obj.get("status") or {}).get("allocation"))

    def _lift_gates(self) -> None:
        claims = self.informers["claims"]
        for pod in self.informers["pods"].items():
            gates = (pod.get("spec") or {}).get("schedulingGates") or []
            if not any(g.get("name") == SCHEDULING_GATE for g in gates):
                continue
            names = pod_claim_names(pod)
            if names is None:
                continue
            namespace = pod["metadata"]["namespace"]
            used = [claims.get(f"{namespace}/{name}") for name in names]
            if any(c is None or pending(c) or not self._gang_whole(c) for c in used):
                continue
            try:
                self.informers["pods"].update(
                    self.api.set_scheduling_gates(pod, [g for g in gates if g.get("name") != SCHEDULING_GATE])
                )
            except KubeError as error:
                log.warning("cannot lift the gate of pod %s/%s: %s", namespace, pod["metadata"]["name"], error)
                continue
            metrics.GATES_LIFTED.inc()

    def _report(self, obj: dict[str, Any] | None, reason: str, warning: bool = True) -> None:
        """One Event per claim and reason (not one a pass)."""
        if obj is None:
            return
        meta = obj["metadata"]
        if self._reported.get(meta.get("uid", "")) == reason:
            return
        self._reported[meta.get("uid", "")] = reason
        log.info("claim %s/%s: %s", meta["namespace"], meta["name"], reason)
        now = _now()
        event = {
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "reason": "FailedAllocation" if warning else "WaitingForGang",
            "message": reason[:1024],
            "type": "Warning" if warning else "Normal",
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.api.create_event(meta["namespace"], event)
        except KubeError as error:
            log.warning("cannot record an event for %s/%s: %s", meta["namespace"], meta["name"], error)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
