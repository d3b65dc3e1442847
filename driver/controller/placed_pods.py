"""Pods without claims placed by the controller (`--place-pods`): the gated pods of the namespaces
that opt in, each pinned to the node the policy picks.

In a namespace the platform team labelled `gpu.fgpu.dev/place-pods=fgpu` (driver/scheduling/opt_in.py)
the webhook gates the pods that use no claim, and each pass places them as claims without device
requests, with the allocator and the policy that place the claims: where a pod's CPU and memory
strand the fewest GPUs (under fragmentation), its fit read by the room (driver/scheduling/nodefit.py:
taints, nodeSelector, node affinity, requests). One patch then pins the pod to the node chosen and
lifts the gate: required node affinity `matchFields metadata.name In [node]`, added to each of its
terms (kube-apiserver lets a gated pod's node affinity narrow, never widen); kube-scheduler binds it
there. From that patch on the room counts it on that node (fit.py: a pod pinned to one node) until
it is bound or gone.

Nothing waits at the gate for long: a pod that fits none of fgpu's nodes (the nodes whose GPUs the
allocator sees), or that sets what the room does not evaluate (inter-pod affinity, topology
spread, host ports, persistent volumes: kube-scheduler could refuse the one node it is pinned to,
and a pinned pod is never placed again), or a field beyond the bounds below, is let go as it came,
gate lifted without affinity, for kube-scheduler to place (a node without GPUs, or later), with an
Event saying why. Only a pod whose namespace has spent its share of the pass's search waits, for
the next pass."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

from driver.allocator.cluster import Failure
from driver.allocator.model import Claim, claim_from_object
from driver.controller.pass_context import Pass
from driver.controller.replica import Replica
from driver.controller.reporter import Reporter
from driver.controller.search_shares import share_spent
from driver.kube.errors import KubeError
from driver.kube.informer import Informer, object_key
from driver.scheduling.nodefit import NodeRoom, PodNeeds
from driver.scheduling.opt_in import (
    SCHEDULING_GATE,
    claimless,
    gated,
    held_by_another_gate,
    placement_exempt,
    places_pods,
)

log = logging.getLogger(__name__)
JsonObject = dict[str, Any]
# What the room reads of a pod for every node, bounded: beyond these a pod is left to kube-scheduler.
MAX_TERMS = 16  # required node affinity terms
MAX_REQUIREMENTS = 32  # matchExpressions and matchFields of one term
MAX_VALUES = 256  # values of one requirement
MAX_TOLERATIONS = 64
MAX_NODE_SELECTOR = 64
RELEASED = "NotPlacedByFgpu"  # the Event's reason when a pod is let go without a node


@dataclass(frozen=True)
class Release:
    """A pod's gate to lift: pinned to a node (its new affinity), or let go as it came (None)."""

    pod: JsonObject
    affinity: JsonObject | None


def out_of_bounds(pod: JsonObject) -> str | None:
    """What the controller will not read of the pod, in one line naming the field (None: it reads
    it): a field of the wrong type or beyond the bounds above."""
    spec = pod.get("spec") or {}
    selector = spec.get("nodeSelector") or {}
    if not isinstance(selector, dict) or len(selector) > MAX_NODE_SELECTOR:
        return f"spec.nodeSelector: a map of at most {MAX_NODE_SELECTOR} labels"
    tolerations = spec.get("tolerations") or []
    if not isinstance(tolerations, list) or len(tolerations) > MAX_TOLERATIONS:
        return f"spec.tolerations: a list of at most {MAX_TOLERATIONS}"
    affinity = spec.get("affinity") or {}
    node_affinity = affinity.get("nodeAffinity") or {} if isinstance(affinity, dict) else None
    if not isinstance(node_affinity, dict):
        return "spec.affinity.nodeAffinity: an object"
    field = "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms"
    terms = (node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or []
    if not isinstance(terms, list) or len(terms) > MAX_TERMS:
        return f"{field}: a list of at most {MAX_TERMS} terms"
    for i, term in enumerate(terms):
        if not isinstance(term, dict):
            return f"{field}[{i}]: an object"
        requirements = [*(term.get("matchExpressions") or ()), *(term.get("matchFields") or ())]
        if len(requirements) > MAX_REQUIREMENTS:
            return f"{field}[{i}]: at most {MAX_REQUIREMENTS} matchExpressions and matchFields"
        if any(not isinstance(r, dict) or len(r.get("values") or ()) > MAX_VALUES for r in requirements):
            return f"{field}[{i}]: requirements of at most {MAX_VALUES} values"
    return None


def unevaluated(pod: JsonObject) -> str | None:
    """What the pod sets that the room does not evaluate and kube-scheduler may refuse a node for
    (None: nothing): pinned to a node it refuses, the pod would wait there for ever."""
    spec = pod.get("spec") or {}
    affinity = spec.get("affinity") or {}
    for kind in ("podAffinity", "podAntiAffinity"):
        if (affinity.get(kind) or {}).get("requiredDuringSchedulingIgnoredDuringExecution"):
            return f"spec.affinity.{kind} is required"
    spread = spec.get("topologySpreadConstraints") or ()
    if any(c.get("whenUnsatisfiable", "DoNotSchedule") == "DoNotSchedule" for c in spread):
        return "spec.topologySpreadConstraints: DoNotSchedule"
    containers = [*(spec.get("initContainers") or ()), *(spec.get("containers") or ())]
    if any(port.get("hostPort") for c in containers for port in c.get("ports") or ()):
        return "a container asks for a hostPort"
    if any(v.get("persistentVolumeClaim") or v.get("ephemeral") for v in spec.get("volumes") or ()):
        return "spec.volumes: a persistent volume"
    return None


def pinned_affinity(pod: JsonObject, node: str) -> JsonObject:
    """The pod's affinity narrowed to `node`: `matchFields metadata.name In [node]` added to each
    required node affinity term (kube-apiserver allows a gated pod only additions to each term, the
    terms neither added nor removed), or one term of it alone where the pod has none."""
    affinity = copy.deepcopy((pod.get("spec") or {}).get("affinity") or {})
    node_affinity = affinity.setdefault("nodeAffinity", {})
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    field = {"key": "metadata.name", "operator": "In", "values": [node]}
    terms = required.get("nodeSelectorTerms") or []
    narrowed = [{**t, "matchFields": [*(t.get("matchFields") or ()), field]} for t in terms]
    node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] = {
        **required,
        "nodeSelectorTerms": narrowed or [{"matchFields": [field]}],
    }
    return affinity


def as_claim(pod: JsonObject) -> Claim:
    """The pod as the allocator places it: a claim without device requests, the pod's own name."""
    meta = pod["metadata"]
    return claim_from_object({"metadata": {k: meta.get(k, "") for k in ("namespace", "name", "uid")}, "spec": {}})


class PodPlacer:
    """Places the gated pods without claims of the opted-in namespaces (`namespaces`: the informer
    of the Namespaces labelled so). `room`: what the nodes have left for pods (fit.py)."""

    def __init__(
        self, replica: Replica, namespaces: Informer, reporter: Reporter, room: Callable[[], NodeRoom]
    ) -> None:
        self._replica, self._namespaces, self._reporter, self._room = replica, namespaces, reporter, room
        self._pods = replica.informers["pods"]
        self._told: dict[str, str] = {}  # pod uid -> the last Event told: one per pod and message

    def owns(self, pod: JsonObject) -> bool:
        """Whether the pod's gate is this placer's to lift (the claims' gate lifter leaves it)."""
        meta = pod.get("metadata") or {}
        return (
            gated(pod)
            and claimless(pod)
            and not meta.get("deletionTimestamp")
            and placement_exempt(pod) is None
            and (namespace := self._namespaces.get(f"/{meta.get('namespace', '')}")) is not None
            and places_pods(namespace)
        )

    def waiting(self) -> list[JsonObject]:
        """The pods this placer places, oldest first; not while another scheduling gate holds
        one (Kueue's admission gate, say: held_by_another_gate)."""
        return sorted(
            (p for p in self._pods.items() if self.owns(p) and not held_by_another_gate(p)),
            key=lambda p: (p["metadata"].get("creationTimestamp", ""), object_key(p)),
        )

    def place(self, current: Pass) -> None:
        """Place the waiting pods one at a time on the pass's allocator and room, each counted where
        it goes before the next is placed; their patches go out from the writers."""
        pods = self.waiting()
        uids = {p["metadata"].get("uid", "") for p in pods}
        self._told = {uid: told for uid, told in self._told.items() if uid in uids}  # of pods still waiting
        if not pods:
            return
        room = self._room()
        room.pods_of = {as_claim(p).key: [PodNeeds.from_object(p)] for p in pods}  # this room places pods alone
        writes: list[Future[None]] = []
        for pod in pods:
            if self._replica.stopped():
                break
            self._replica.progress.beat()
            release = self._decide(current, pod, room)
            if release is not None:
                writes.append(self._replica.writers.submit(self._release, release))
        wait(writes)

    def _decide(self, current: Pass, pod: JsonObject, room: NodeRoom) -> Release | None:
        """Where the pod goes (None: it waits for the next pass)."""
        meta = pod["metadata"]
        if (why := out_of_bounds(pod) or unevaluated(pod)) is not None:
            self._tell(pod, f"fgpu does not place this pod ({why}): kube-scheduler places it", warning=True)
            return Release(pod, None)
        namespace = meta["namespace"]
        if (budget := current.shares.budget(namespace)) is None:
            self._tell(pod, share_spent(namespace), warning=False, reason="SearchShareSpent")
            return None
        claim = as_claim(pod)
        outcome = current.allocator.allocate(claim, room=room, budget=budget)
        if isinstance(outcome, Failure):
            if budget.exhausted:  # not a finished search: placed again next pass
                self._tell(pod, outcome.reason, warning=False, reason="WaitingForPlacement")
                return None
            self._tell(pod, f"no node of fgpu's fits the pod ({outcome.reason}): kube-scheduler places it")
            return Release(pod, None)
        current.allocator.commit(outcome)  # no devices: the policy's view of the node is measured again
        room.take(outcome)
        log.info("pod %s placed on node %s", object_key(pod), outcome.node)
        return Release(pod, pinned_affinity(pod, outcome.node))

    def _release(self, release: Release) -> None:
        """One patch: the node affinity (where pinned) and the gates less ours. A failed patch
        (the pod changed, an outage) leaves the pod gated: the next pass places it again, on a
        room read afresh."""
        pod = release.pod
        gates = [g for g in pod["spec"].get("schedulingGates") or () if g.get("name") != SCHEDULING_GATE]
        api = self._replica.api
        try:
            if release.affinity is None:
                updated = api.set_scheduling_gates(pod, gates)
            else:
                updated = api.place_pod(pod, release.affinity, gates)
        except KubeError as error:
            log.warning("cannot release pod %s: %s", object_key(pod), error)
            return
        self._pods.update(updated)

    def _tell(self, pod: JsonObject, message: str, warning: bool = False, reason: str = RELEASED) -> None:
        """One Event per pod and message."""
        uid = pod["metadata"].get("uid", "")
        if self._told.get(uid) == message:
            return
        self._told[uid] = message
        log.info("pod %s: %s", object_key(pod), message)
        self._reporter.event("v1", "Pod", pod, reason, message, warning)
