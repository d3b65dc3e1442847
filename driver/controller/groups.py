"""Upstream gangs: PodGroups (`scheduling.k8s.io/v1beta1`, Kubernetes 1.37's GenericWorkload) with a
gang policy, read as gangs of the controller.

A pod names its group in `spec.schedulingGroup.podGroupName`. A PodGroup whose
`spec.schedulingPolicy.gang` is set admits none of its pods until `minCount` of them can be bound
(kube-scheduler's GangScheduling plugin: PreEnqueue waits for minCount pods, Permit holds those
scheduled until minCount are, then schedules the group in one cycle). The controller keeps to the
same rule for the claims it places, so that a group is never half allocated while kube-scheduler
waits for the rest:

- a pod is a member once every claim it uses exists (a claim from a template once the pod's status
  names it); the opt-in claims of the members are placed all or none, once minCount members exist;
- the members' gates are lifted together, once minCount of them have every opt-in claim allocated.

A claim is in a group through the pods that use it (by name, through their status, or the pod that
owns it) or the PodGroup that owns it (a group's own claim). A pod whose group does not exist, or
cannot be read, waits, as kube-scheduler keeps it waiting. A group with the basic policy is no
gang: its claims are placed one by one. Our own gang labels (driver/scheduling/opt_in.py) come first where a claim
carries them.

The pods of workload operators that make no PodGroup (JobSet, Kubeflow Trainer, LeaderWorkerSet,
KubeRay) are grouped by the same rule, each operator's gang read from its pods' labels and
annotations (driver/scheduling/framework_gangs.py) as a PodGroup of that size that always exists."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from driver.kube.informer import object_key
from driver.scheduling.framework_gangs import pod_framework_gang
from driver.scheduling.opt_in import gated, known_claim_names, opted_in, pending, pod_claim_names

JsonObject = dict[str, Any]
FINISHED = ("Succeeded", "Failed")


def group_name(pod: JsonObject) -> str | None:
    """The PodGroup the pod names (in its namespace), if any."""
    return ((pod.get("spec") or {}).get("schedulingGroup") or {}).get("podGroupName") or None


def in_some_gang(pod: JsonObject) -> bool:
    """Whether the pod may be in a gang group: it names a PodGroup, or an operator's labels put it
    in one."""
    return group_name(pod) is not None or pod_framework_gang(pod) is not None


def min_count(podgroup: JsonObject) -> int | None:
    """The gang's minCount; None for a group without a gang policy (basic)."""
    gang = (((podgroup.get("spec") or {}).get("schedulingPolicy")) or {}).get("gang")
    if gang is None:
        return None
    try:
        return max(1, int(gang.get("minCount", 1)))
    except (TypeError, ValueError):
        return 1


def _agreed(known: int | None, size: int) -> int:
    """One size for a gang whose pods disagree (a template changed): the largest, so that none is
    placed short; 0 (unreadable) wins."""
    return size if known is None else (0 if 0 in (known, size) else max(known, size))


@dataclass
class GroupState:
    """Where a gang group stands, as the controller places its claims and lifts its pods' gates."""

    size: int  # minCount; 0: no such PodGroup (its pods wait for it)
    present: int = 0  # pods with every claim made
    done: int = 0  # of those, pods whose opt-in claims are all allocated
    pending: set[str] = field(default_factory=set)  # opt-in claims of present pods still to place
    allocated: list[JsonObject] = field(default_factory=list)  # opt-in claims of its pods, allocated
    released: bool = False  # a pod using an opt-in claim has been let go (no gate of ours)

    @property
    def whole(self) -> bool:
        return self.size > 0 and self.done >= self.size


class Groups:
    """The gang groups of one moment: which claims and pods are in which, and where each stands.
    `claim` reads a claim by key (the claim cache)."""

    def __init__(
        self,
        podgroups: Iterable[JsonObject],
        pods: Iterable[JsonObject],
        claim: Callable[[str], JsonObject | None],
    ) -> None:
        self._podgroups = {object_key(g): g for g in podgroups}
        self._framework_sizes: dict[str, int] = {}  # an operator's gang -> its size (framework_gangs.py)
        self._claim = claim
        self._pods: dict[str, list[JsonObject]] = defaultdict(list)  # gang group -> its live pods
        self._by_pod_uid: dict[str, str] = {}
        self._by_claim: dict[str, str] = {}  # claim key -> gang group (through the pods that name it)
        self._states: dict[str, GroupState] = {}
        for pod in pods:
            meta = pod["metadata"]
            if meta.get("deletionTimestamp") or (pod.get("status") or {}).get("phase") in FINISHED:
                continue
            if (name := group_name(pod)) is not None:
                key = f"{meta['namespace']}/{name}"
            elif (framework := pod_framework_gang(pod)) is not None:
                key = f"{meta['namespace']}/{framework.name}"
                self._framework_sizes[key] = _agreed(self._framework_sizes.get(key), framework.size)
            else:
                continue
            if not self._gang(key):
                continue
            self._pods[key].append(pod)
            self._by_pod_uid[meta.get("uid", "")] = key
            for claim_name in known_claim_names(pod):
                claim_key = f"{meta['namespace']}/{claim_name}"
                self._by_claim[claim_key] = min(key, self._by_claim.get(claim_key, key))  # one, whatever the order

    def _gang(self, key: str) -> bool:
        """Whether the group is a gang, or may be one (not found: its pods wait)."""
        if key in self._framework_sizes:
            return True
        podgroup = self._podgroups.get(key)
        return podgroup is None or min_count(podgroup) is not None

    def podgroup(self, key: str) -> JsonObject | None:
        return self._podgroups.get(key)

    def exists(self, key: str) -> bool:
        """Whether the group's size is known: its PodGroup is there, or an operator's pods say it."""
        return key in self._podgroups or key in self._framework_sizes

    def of_pod(self, pod: JsonObject) -> str | None:
        """The gang group the pod is in."""
        return self._by_pod_uid.get(pod["metadata"].get("uid", ""))

    def of_claim(self, claim: JsonObject) -> str | None:
        """The gang group the claim is in: through a pod that uses it, or its owner (a pod, or the
        PodGroup of a group's own claim)."""
        meta = claim["metadata"]
        if (key := self._by_claim.get(object_key(claim))) is not None:
            return key
        for owner in meta.get("ownerReferences") or ():
            if owner.get("kind") == "Pod" and (key := self._by_pod_uid.get(owner.get("uid", ""))) is not None:
                return key
            if owner.get("kind") == "PodGroup":
                key = f"{meta.get('namespace', '')}/{owner.get('name', '')}"
                if (podgroup := self._podgroups.get(key)) is not None and min_count(podgroup) is not None:
                    return key
        return None

    def state(self, key: str) -> GroupState:
        if key not in self._states:
            self._states[key] = self._measure(key)
        return self._states[key]

    def _measure(self, key: str) -> GroupState:
        podgroup = self._podgroups.get(key)
        if key in self._framework_sizes:
            state = GroupState(size=self._framework_sizes[key])
        else:
            state = GroupState(size=(min_count(podgroup) or 0) if podgroup is not None else 0)
        allocated: dict[str, JsonObject] = {}
        namespace = key.split("/", 1)[0]
        for pod in self._pods.get(key, ()):
            names = pod_claim_names(pod)
            claims = [self._claim(f"{namespace}/{name}") for name in names or ()]
            ours = [c for c in claims if c is not None and opted_in(c)]
            for claim in ours:
                if not pending(claim):
                    allocated[object_key(claim)] = claim
            if ours and not gated(pod) and all(not pending(c) for c in ours):
                state.released = True
            if names is None or any(c is None for c in claims):
                continue  # not a member yet: a claim it uses is not made
            state.present += 1
            waiting = {object_key(c) for c in ours if pending(c)}
            state.pending |= waiting
            state.done += not waiting
        state.allocated = list(allocated.values())
        return state
