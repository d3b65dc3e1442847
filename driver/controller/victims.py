"""Who may be evicted to make room for a pending claim (making_room.py), read from the API objects.

A claim's allocation may be taken from it only by evicting every pod that uses it. It is
*movable* when each of those pods carries `gpu.fgpu.dev/movable: "true"` and is owned by a
controller that recreates it (a ReplicaSet, StatefulSet, Job...); nothing else is ever moved. It
is *preemptible* for a pending pod of higher priority whose `preemptionPolicy` is not `Never`,
whatever its annotation, as kube-scheduler preempts, but only in the pending claim's namespace
unless the controller is told to preempt across namespaces (making_room.py says why). Movable pods
of a higher priority than the pending pod are not moved for it. A member of a gang (our labels, a
PodGroup, a workload operator's: groups.py) is never taken: alone, that would split a running
gang, and whole gangs are not moved yet. Nor is a pod owned by the same controller as the pending
pod: a ReplicaSet's pod evicted for its sibling is made again and waits in turn; nor, to make
room, one whose controller had a pod moved within the last minute (making_room.py says why). Nor a
pod that is not yet Running on its claim's node: moved before it starts, it only waits again, and
its node (about to run it) is not one to empty."""

from __future__ import annotations

import calendar
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from driver.allocator.make_room import Holder
from driver.allocator.model import ObjectError, claim_from_object
from driver.controller.fit import allocated_node
from driver.controller.groups import in_some_gang
from driver.kube.informer import object_key
from driver.scheduling.opt_in import GANG_LABEL, MOVABLE_ANNOTATION, opted_in

JsonObject = dict[str, Any]


def movable(pod: JsonObject) -> bool:
    """Annotated movable and recreated by its controller when evicted."""
    meta = pod["metadata"]
    annotated = (meta.get("annotations") or {}).get(MOVABLE_ANNOTATION) == "true"
    return annotated and any(ref.get("controller") for ref in meta.get("ownerReferences") or ())


def _running_on(pod: JsonObject, node: str) -> bool:
    """Bound to `node` and Running there."""
    return (pod.get("spec") or {}).get("nodeName") == node and (pod.get("status") or {}).get("phase") == "Running"


def owners(pods: Iterable[JsonObject]) -> set[str]:
    """The uids of the controllers that own the pods."""
    refs = (ref for pod in pods for ref in pod["metadata"].get("ownerReferences") or ())
    return {ref["uid"] for ref in refs if ref.get("controller") and ref.get("uid")}


def priority(pod: JsonObject) -> int:
    """The pod's priority (resolved from its PriorityClass by the API server at creation)."""
    return int((pod.get("spec") or {}).get("priority") or 0)


def may_preempt(pods: Sequence[JsonObject]) -> bool:
    return bool(pods) and all((p.get("spec") or {}).get("preemptionPolicy") != "Never" for p in pods)


def _created(pod: JsonObject) -> float:
    stamp = pod["metadata"].get("creationTimestamp") or ""
    try:
        return float(calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        return 0.0


@dataclass(frozen=True)
class Candidate:
    """An allocated claim, whether the planner may take it (its Holder's `movable`), the pods that
    would go with it, and why."""

    holder: Holder
    pods: tuple[JsonObject, ...]
    preempted: bool  # taken for its lower priority, not because it is movable


def candidates(
    claims: Iterable[JsonObject],
    pods_of: Mapping[str, Sequence[JsonObject]],
    pending_priority: int,
    preempt: bool,
    spared: AbstractSet[str] = frozenset(),
    held_too: bool = False,
    within: str | None = None,
    owners_kept: AbstractSet[str] = frozenset(),
) -> list[Candidate]:
    """The allocated claims the planner may take from: those whose pods are all movable, Running
    on the claim's node and not of a higher priority than the pending pod, or, with `preempt`, of a
    lower priority (with `within`, only in that namespace). Claims in `spared` (uids: an eviction
    of theirs was refused lately), claims whose pods have an owner in `owners_kept` (controller
    uids: the pending pods' own, since a ReplicaSet's pod evicted for its sibling is only made
    again and waits in turn, and those moved lately), claims no pod uses and claims that cannot be
    read are left alone; with `held_too` the others are listed as well, not movable (compaction
    must see what holds a GPU)."""
    found = []
    for claim in claims:
        allocation = (claim.get("status") or {}).get("allocation") or {}
        node = allocated_node(claim) if allocation else ""
        pods = tuple(pods_of.get(object_key(claim), ()))
        if not node or claim["metadata"].get("deletionTimestamp"):
            continue
        top = max((priority(p) for p in pods), default=0)
        is_movable = bool(pods) and all(movable(p) and _running_on(p, node) for p in pods) and top <= pending_priority
        in_reach = within is None or claim["metadata"].get("namespace") == within
        preempted = preempt and in_reach and bool(pods) and top < pending_priority and not is_movable
        takeable = (is_movable or preempted) and claim["metadata"].get("uid") not in spared
        takeable = takeable and not _in_gang(claim, pods) and not (owners_kept and owners(pods) & owners_kept)
        if not (takeable or held_too):
            continue
        try:
            parsed = claim_from_object(claim)
        except ObjectError:
            continue
        started = max((_created(p) for p in pods), default=0.0)
        found.append(Candidate(Holder(parsed, node, allocation, takeable, started), pods, preempted and takeable))
    return found


def _in_gang(claim: JsonObject, pods: Sequence[JsonObject]) -> bool:
    """A member of a gang: taken alone it would split the gang, which runs only whole."""
    labelled = opted_in(claim) and bool((claim["metadata"].get("labels") or {}).get(GANG_LABEL))
    return labelled or any(in_some_gang(p) for p in pods)


@dataclass
class EvictionBudget:
    """At most `per_minute` evictions in any 60 seconds (time.monotonic())."""

    per_minute: int
    _times: deque[float] = field(default_factory=deque)

    def left(self, now: float) -> int:
        while self._times and now - self._times[0] >= 60.0:
            self._times.popleft()
        return max(0, self.per_minute - len(self._times))

    def spend(self, now: float) -> None:
        self._times.append(now)
