"""Gates: pods' scheduling gates lifted once their claims are allocated (and their gang is whole:
our labelled gang, or the pod's PodGroup or operator's gang, groups.py); and which gated pods wait for which claim
(read by the gates and by the Events, reporter.py)."""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import wait
from typing import Any

from driver.controller import metrics
from driver.controller.groups import Groups, in_some_gang
from driver.controller.replica import Replica
from driver.kube.errors import KubeError
from driver.kube.informer import Informer, object_key
from driver.scheduling.opt_in import GANG_LABEL, SCHEDULING_GATE, gang_size, gated, opted_in, pending, pod_claim_names

log = logging.getLogger(__name__)


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
        self, replica: Replica, gated_pods: GatedPods, placed: Callable[[dict[str, Any]], bool] | None = None
    ) -> None:
        """`placed`: whether a pod's gate is another's to lift (a pod without claims that the
        controller places: placed_pods.py)."""
        self._replica, self._gated = replica, gated_pods
        self._placed = placed or (lambda pod: False)
        self._informers = replica.informers

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
        pods_of = self._gated.by_claim()
        keys = {pod for claim in claims for pod in pods_of.get(claim, ())}
        pods = [p for key in keys if (p := self._informers["pods"].get(key)) is not None]
        if pods:
            whole = self._whole_gangs()
            groups = self._replica.groups() if any(in_some_gang(p) for p in pods) else None
            for pod in pods:
                self._lift(pod, whole, groups)

    def lift_all(self) -> None:
        """Every gated pod whose claims are allocated, the patches sent concurrently."""
        whole = self._whole_gangs()
        pods = [p for p in self._informers["pods"].items() if gated(p)]
        if pods and self._replica.acting():
            groups = self._replica.groups()
            wait([self._replica.writers.submit(self._lift, pod, whole, groups) for pod in pods])

    def _lift(self, pod: dict[str, Any], whole_gangs: dict[str, bool], groups: Groups | None) -> None:
        """Lift our gate once every opt-in claim of the pod is allocated and its gang is whole (its
        labelled gang, and its PodGroup's: minCount pods with every opt-in claim allocated)."""
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
            if gang and not whole_gangs.get(f"{namespace}/{gang}"):
                return
        gates = [g for g in pod["spec"]["schedulingGates"] if g.get("name") != SCHEDULING_GATE]
        try:
            self._informers["pods"].update(self._replica.api.set_scheduling_gates(pod, gates))
        except KubeError as error:
            log.warning("cannot lift the gate of pod %s: %s", object_key(pod), error)
            return
        metrics.GATES_LIFTED.inc()
