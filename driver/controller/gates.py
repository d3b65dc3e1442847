"""Gates: pods' scheduling gates lifted once their claims are allocated (and their gang is whole:
our labelled gang, or the pod's PodGroup or operator's gang, groups.py); and which gated pods wait for which claim
(read by the gates and by the Events, reporter.py).

A gate is lifted only once the claim watch delivered the allocations we wrote (or after
DELIVERY_WAIT_S): kube-scheduler watches the same API server, and a pod it sees before its claim
cache has the allocation makes it try to allocate the claim itself ("allocated elsewhere in the
meantime") and retry the pod.

Before the gate goes, the pod's `status.nominatedNodeName` is set to the node its claims were
allocated on: kube-scheduler reads no node out of an allocation, and unhinted it runs its filters
on every node of the cluster to find the one the allocation admits (at 5,000 nodes most of its time
a pod); a nominated node it tries first, alone (and counts the pod's requests there for the pods it
places meanwhile). A hint, not a pin: where that node no longer fits the pod, kube-scheduler goes
on to the others as before (refusals.py)."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import wait
from typing import Any

from driver.controller import metrics
from driver.controller.fit import allocated_node
from driver.controller.groups import Groups, in_some_gang
from driver.controller.replica import Replica
from driver.kube.errors import KubeError
from driver.kube.informer import Informer, object_key
from driver.scheduling.opt_in import (
    GANG_LABEL,
    SCHEDULING_GATE,
    gang_size,
    gated,
    opted_in,
    owner_pod,
    pending,
    pod_claim_names,
)

log = logging.getLogger(__name__)
# A watch event comes within milliseconds; past this the watch is behind or broken, and a pod must
# not be stranded at its gate for it (kube-scheduler retries a pod it saw too early: it costs a cycle).
DELIVERY_WAIT_S = 2.0


class GatedPods:
    """Claim key -> gated pods that use it, rebuilt when the pods change (kube-controller-manager
    names a pod's claims in its status after it makes them, so this is read when a unit is written)."""

    def __init__(self, pods: Informer) -> None:
        self._pods = pods
        self._lock = threading.Lock()  # read from the writers' threads
        self._of: tuple[int, dict[str, list[str]]] = (-1, {})

    def by_claim(self) -> dict[str, list[str]]:
        with self._lock:
            version = self._pods.version
            if self._of[0] != version:
                out: dict[str, list[str]] = defaultdict(list)
                for pod in self._pods.items():
                    if gated(pod) and (names := pod_claim_names(pod)) is not None:
                        for name in names:
                            out[f"{pod['metadata']['namespace']}/{name}"].append(object_key(pod))
                self._of = (version, out)
            return self._of[1]


class GateLifter:
    def __init__(
        self,
        replica: Replica,
        gated_pods: GatedPods,
        placed: Callable[[dict[str, Any]], bool] | None = None,
        delivery_wait_s: float = DELIVERY_WAIT_S,
    ) -> None:
        """`placed`: whether a pod's gate is another's to lift (a pod without claims that the
        controller places: placed_pods.py). `delivery_wait_s`: how long the pods lifted together
        wait, at most, for the watch to deliver their claims."""
        self._replica, self._gated = replica, gated_pods
        self._placed = placed or (lambda pod: False)
        self._informers = replica.informers
        self._delivery_wait_s = delivery_wait_s

    def _whole_gangs(self) -> dict[str, bool]:
        """Gang -> whether every one of its claims exists and is allocated."""
        members: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
        for obj in self._informers["claims"].items():
            if opted_in(obj) and (labels := obj["metadata"].get("labels") or {}).get(GANG_LABEL):
                members[f"{obj['metadata']['namespace']}/{labels[GANG_LABEL]}", gang_size(labels)].append(obj)
        return {
            gang: len(claims) >= size > 0 and not any(pending(c) for c in claims)
            for (gang, size), claims in members.items()
        }

    def lift_pods(self, claims: Iterable[str]) -> None:
        """The gates of the pods of claims just written, as far as their other claims allow."""
        pods = [p for key in self._pods_of(claims) if (p := self._informers["pods"].get(key)) is not None]
        if pods:
            whole = functools.cache(self._whole_gangs)  # read only if a pod's claim is in a gang
            groups = self._replica.groups() if any(in_some_gang(p) for p in pods) else None
            deadline = self._delivery_deadline()
            for pod in pods:
                self._lift(pod, whole, groups, deadline)

    def _pods_of(self, claims: Iterable[str]) -> set[str]:
        """The pods that use these claims: a claim made from a pod's template, its owner, read from
        the claim at once; a claim made on its own, the gated pods that name it, from the index of
        every gated pod (rebuilt whenever a pod changes: too dear for each claim written, at 4,000
        pods). Another pod naming a template's claim is lifted by the pass's lift_all."""
        keys: set[str] = set()
        shared: list[str] = []
        for claim in claims:
            owner = owner_pod(self._informers["claims"].get(claim) or {})
            if owner is not None:
                keys.add(owner.key)
            else:
                shared.append(claim)
        if shared:
            pods_of = self._gated.by_claim()
            keys.update(pod for claim in shared for pod in pods_of.get(claim, ()))
        return keys

    def lift_all(self) -> None:
        """Every gated pod whose claims are allocated, the patches sent concurrently (all waiting
        for the watch until one deadline, not each in turn)."""
        whole = functools.cache(self._whole_gangs)
        pods = [p for p in self._informers["pods"].items() if gated(p)]
        if pods and self._replica.acting():
            groups = self._replica.groups()
            deadline = self._delivery_deadline()
            lifts = {self._replica.writers.submit(self._lift, pod, whole, groups, deadline): pod for pod in pods}
            wait(lifts)
            for lift, pod in lifts.items():  # a refusal is logged by _lift; anything else would vanish here
                if (error := lift.exception()) is not None:
                    log.error("lifting the gate of pod %s failed", object_key(pod), exc_info=error)

    def _delivery_deadline(self) -> float:
        return time.monotonic() + self._delivery_wait_s

    def _delivered(self, claims: list[dict[str, Any]], deadline: float) -> bool:
        """Whether the watch delivered every claim at the version we hold (our own write), waiting
        until `deadline` (time.monotonic()) at most."""
        informer = self._informers["claims"]
        return all(informer.wait_delivered(claim, max(0.0, deadline - time.monotonic())) for claim in claims)

    def _lift(
        self, pod: dict[str, Any], whole_gangs: Callable[[], dict[str, bool]], groups: Groups | None, deadline: float
    ) -> None:
        """Lift our gate once every opt-in claim of the pod is allocated and its gang is whole (its
        labelled gang, and its PodGroup's: minCount pods with every opt-in claim allocated), and
        the watch delivered the claims (or `deadline` passed: lifted all the same, and counted)."""
        if not gated(pod) or self._placed(pod) or (names := pod_claim_names(pod)) is None:
            return
        if groups is not None and (group := groups.of_pod(pod)) is not None and not groups.state(group).whole:
            return
        namespace = pod["metadata"]["namespace"]
        used = [self._informers["claims"].get(f"{namespace}/{name}") for name in names]
        for claim in used:
            if claim is None or pending(claim):
                return
            gang = (claim["metadata"].get("labels") or {}).get(GANG_LABEL) if opted_in(claim) else None
            if gang and not whole_gangs().get(f"{namespace}/{gang}"):
                return
        claims = [claim for claim in used if claim is not None]
        early = not self._delivered(claims, deadline)
        gates = [g for g in pod["spec"]["schedulingGates"] if g.get("name") != SCHEDULING_GATE]
        api = self._replica.api
        try:
            if node := node_to_nominate(pod, claims):
                pod = api.nominate_node(pod, node)
            self._informers["pods"].update(api.set_scheduling_gates(pod, gates))
        except KubeError as error:
            log.warning("cannot lift the gate of pod %s: %s", object_key(pod), error)
            return
        metrics.GATES_LIFTED.inc()
        if early:
            log.info("lifted the gate of pod %s before the watch delivered its claims", object_key(pod))
            metrics.GATES_LIFTED_EARLY.inc()


def node_to_nominate(pod: dict[str, Any], claims: list[dict[str, Any]]) -> str:
    """The one node the pod's allocated claims name, for kube-scheduler to try first; "" where
    they name none (devices reachable from several nodes) or several (the pod fits nowhere:
    kube-scheduler says so), or where the pod is nominated to it already."""
    nodes = {node for claim in claims if (node := allocated_node(claim))}
    if len(nodes) != 1:
        return ""
    node = nodes.pop()
    return "" if (pod.get("status") or {}).get("nominatedNodeName") == node else node
