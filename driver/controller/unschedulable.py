"""Pods that wait at fgpu's gate for claims that fit nowhere, shown unschedulable to node autoscalers.

Karpenter and Cluster Autoscaler add nodes for pods kube-scheduler marked unschedulable (the
condition PodScheduled=False, reason Unschedulable); a pod at fgpu's gate is never tried by
kube-scheduler, so without this it never looks pending to them. After a pass, each gated pod of a
unit that fit nowhere (and for which making room reserved nothing) gets that condition, with the
controller's reason as its message, and keeps its gate. An autoscaler adds a node for it (it
simulates the pod's claims on its node types' templates, docs/autoscaling.md); the node's slices
appear; the next pass places the claims there and lifts the gate; kube-scheduler binds the pod
and sets PodScheduled=True.

Why not lift the gate instead (handing the claims to kube-scheduler): a gate cannot be put back,
kube-scheduler would allocate the claims itself, first fit and a gang one pod at a time, while the
controller writes allocations on the same devices (it does not see kube-scheduler's before they
are written). With the gate kept, only the controller ever allocates these claims."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from driver.controller import metrics
from driver.controller.api import ControllerApi
from driver.controller.clock import WallClock
from driver.controller.gates import GatedPods
from driver.kube.errors import KubeError
from driver.kube.informer import Informer, object_key

log = logging.getLogger(__name__)
REASON = "Unschedulable"  # corev1.PodReasonUnschedulable: what the autoscalers look for
MAX_MESSAGE = 1024  # the reason can name many nodes


def unschedulable_condition(message: str, now: str) -> dict[str, str]:
    return {"type": "PodScheduled", "status": "False", "reason": REASON, "message": message,
            "lastTransitionTime": now}  # fmt: skip


def marked(pod: dict[str, Any], message: str) -> bool:
    """Whether the pod already carries this condition with this message."""
    return any(
        c.get("type") == "PodScheduled" and c.get("reason") == REASON and c.get("message") == message
        for c in (pod.get("status") or {}).get("conditions") or []
    )


class UnschedulableMarker:
    def __init__(
        self,
        api: ControllerApi,
        pods: Informer,
        gated: GatedPods,
        reason_of: Callable[[dict[str, Any]], str | None],
        wall_clock: WallClock,
    ) -> None:
        """`reason_of`: why a claim was not placed, as its Event said (reporter.py)."""
        self._api, self._pods, self._gated, self._reason_of, self._wall_clock = api, pods, gated, reason_of, wall_clock

    def mark(self, units: Iterable[list[dict[str, Any]]], reserved: Iterable[str]) -> None:
        """Mark the gated pods of these units' claims, less the claims with a reservation (uids):
        those will fit once their evictions are through."""
        held = set(reserved)
        by_claim = self._gated.by_claim()
        for unit in units:
            for claim in unit:
                if claim["metadata"].get("uid") in held:
                    continue
                reason = self._reason_of(claim) or "no node has room for it"
                message = f"fgpu: claim {claim['metadata']['name']}: {reason}"[:MAX_MESSAGE]
                for key in by_claim.get(object_key(claim), []):
                    if (pod := self._pods.get(key)) is not None and not marked(pod, message):
                        self._write(pod, message)

    def _write(self, pod: dict[str, Any], message: str) -> None:
        meta = pod["metadata"]
        try:
            self._pods.update(
                self._api.set_pod_condition(pod, unschedulable_condition(message, self._wall_clock.timestamp()))
            )
        except KubeError as error:  # the next pass tries again
            log.warning("cannot mark pod %s/%s unschedulable: %s", meta["namespace"], meta["name"], error)
            return
        metrics.MARKED_UNSCHEDULABLE.inc()
