"""Gates and events: pods' scheduling gates lifted once their claims are allocated (and their gang
is whole: our labelled gang, or the pod's PodGroup, groups.py), and one Event per claim and reason
when a claim waits or cannot be placed."""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from driver.controller import metrics
from driver.controller.clock import wall_now
from driver.controller.groups import Groups, group_name
from driver.controller.informer import Informer, object_key
from driver.kube.client import KubeError
from driver.kube.events import object_event
from driver.scheduling.opt_in import GANG_LABEL, SCHEDULING_GATE, gang_size, gated, opted_in, pending, pod_claim_names

log = logging.getLogger(__name__)
COMPONENT = "fgpu-controller"


class Gates:
    """The Controller's gates and events (controller.py builds the state named here). Uses its
    acting() (controller.py) and _groups() (placing.py)."""

    api: Any
    informers: dict[str, Informer]
    _writers: ThreadPoolExecutor
    _pods_lock: threading.Lock
    _pods_of: tuple[int, dict[str, list[str]]]
    _reported: dict[str, str]

    def _gated_pods_by_claim(self) -> dict[str, list[str]]:
        """Claim key -> gated pods that use it, rebuilt when the pods change (kube-controller-manager
        names a pod's claims in its status after it makes them, so this is read when a unit is written)."""
        with self._pods_lock:
            version = self.informers["pods"].version
            if self._pods_of[0] != version:
                out: dict[str, list[str]] = defaultdict(list)
                for pod in self.informers["pods"].items():
                    if gated(pod) and (names := pod_claim_names(pod)) is not None:
                        for name in names:
                            out[f"{pod['metadata']['namespace']}/{name}"].append(object_key(pod))
                self._pods_of = (version, out)
            return self._pods_of[1]

    def _whole_gangs(self) -> dict[str, bool]:
        """Gang -> whether every one of its claims exists and is allocated."""
        members: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
        for obj in self.informers["claims"].items():
            if opted_in(obj) and (labels := obj["metadata"].get("labels") or {}).get(GANG_LABEL):
                members[f"{obj['metadata']['namespace']}/{labels[GANG_LABEL]}", gang_size(labels)].append(obj)
        return {
            gang: len(claims) >= size > 0 and not any(pending(c) for c in claims)
            for (gang, size), claims in members.items()
        }

    def _lift_pods(self, claims: Iterable[str]) -> None:
        pods_of = self._gated_pods_by_claim()
        keys = {pod for claim in claims for pod in pods_of.get(claim, ())}
        pods = [p for key in keys if (p := self.informers["pods"].get(key)) is not None]
        if pods:
            whole = self._whole_gangs()
            groups = self._groups() if any(group_name(p) for p in pods) else None
            for pod in pods:
                self._lift(pod, whole, groups)

    def _lift_gates(self) -> None:
        """Every gated pod whose claims are allocated, the patches sent concurrently."""
        whole = self._whole_gangs()
        pods = [p for p in self.informers["pods"].items() if gated(p)]
        if pods and self.acting():
            groups = self._groups()
            wait([self._writers.submit(self._lift, pod, whole, groups) for pod in pods])

    def _lift(self, pod: dict[str, Any], whole_gangs: dict[str, bool], groups: Groups | None) -> None:
        """Lift our gate once every opt-in claim of the pod is allocated and its gang is whole (its
        labelled gang, and its PodGroup's: minCount pods with every opt-in claim allocated)."""
        if not gated(pod) or (names := pod_claim_names(pod)) is None:
            return
        if groups is not None and (group := groups.of_pod(pod)) is not None and not groups.state(group).whole:
            return
        namespace = pod["metadata"]["namespace"]
        used = [self.informers["claims"].get(f"{namespace}/{name}") for name in names]
        for claim in used:
            if claim is None or pending(claim):
                return
            gang = (claim["metadata"].get("labels") or {}).get(GANG_LABEL) if opted_in(claim) else None
            if gang and not whole_gangs.get(f"{namespace}/{gang}"):
                return
        gates = [g for g in pod["spec"]["schedulingGates"] if g.get("name") != SCHEDULING_GATE]
        try:
            self.informers["pods"].update(self.api.set_scheduling_gates(pod, gates))
        except KubeError as error:
            log.warning("cannot lift the gate of pod %s: %s", object_key(pod), error)
            return
        metrics.GATES_LIFTED.inc()

    def _report(self, obj: dict[str, Any] | None, reason: str, warning: bool = True, why: str = "") -> None:
        """One Event per claim and reason (not one a pass), on the claim and on the gated pods that
        wait for it (where users look: kubectl describe pod); `why` is the Event's reason."""
        if obj is None:
            return
        meta = obj["metadata"]
        if self._reported.get(meta.get("uid", "")) == reason:
            return
        self._reported[meta.get("uid", "")] = reason
        log.info("claim %s/%s: %s", meta["namespace"], meta["name"], reason)
        pods = self._gated_pods_by_claim().get(object_key(obj), [])
        subjects = [("resource.k8s.io/v1", "ResourceClaim", obj)]
        subjects += [("v1", "Pod", pod) for key in pods if (pod := self.informers["pods"].get(key)) is not None]
        why = why or ("FailedAllocation" if warning else "WaitingForGang")
        for api_version, kind, subject in subjects:
            message = reason if kind == "ResourceClaim" else f"claim {meta['name']}: {reason}"
            self._event(api_version, kind, subject, why, message, warning)

    def _report_group(
        self,
        podgroup: dict[str, Any] | None,
        claims: Iterable[dict[str, Any] | None],
        reason: str,
        warning: bool = True,
    ) -> None:
        """As _report, for each claim of a PodGroup's gang, and once on the PodGroup itself."""
        for obj in claims:
            self._report(obj, reason, warning)
        if podgroup is None or self._reported.get(uid := podgroup["metadata"].get("uid", "")) == reason:
            return
        self._reported[uid] = reason
        why = "FailedAllocation" if warning else "WaitingForGang"
        self._event("scheduling.k8s.io/v1beta1", "PodGroup", podgroup, why, reason, warning)

    def _event(
        self, api_version: str, kind: str, subject: dict[str, Any], reason: str, message: str, warning: bool
    ) -> None:
        meta = subject["metadata"]
        event = object_event(api_version, kind, meta, reason, message, COMPONENT, wall_now(), warning)
        try:
            self.api.create_event(meta["namespace"], event)
        except KubeError as error:
            log.warning("cannot record an event for %s %s/%s: %s", kind, meta["namespace"], meta["name"], error)
