"""Events: one per claim and reason when a claim waits or cannot be placed, on the claim and on the
gated pods that wait for it (where users look: kubectl describe pod), once on a PodGroup for its
gang; and the Events other parts of the controller record on pods and claims."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from driver.controller.api import ControllerApi
from driver.controller.clock import WallClock
from driver.controller.gates import GatedPods
from driver.kube.errors import KubeError
from driver.kube.events import object_event
from driver.kube.informer import Informer, object_key

log = logging.getLogger(__name__)
COMPONENT = "fgpu-controller"


class Reporter:
    def __init__(self, api: ControllerApi, pods: Informer, gated: GatedPods, wall_clock: WallClock) -> None:
        self._api, self._pods, self._gated, self._wall_clock = api, pods, gated, wall_clock
        self._reported: dict[str, str] = {}  # claim (or PodGroup) uid -> last failure reported as an Event

    def report(self, obj: dict[str, Any] | None, reason: str, warning: bool = True, why: str = "") -> None:
        """One Event per claim and reason (not one a pass), on the claim and on the gated pods that
        wait for it (where users look: kubectl describe pod); `why` is the Event's reason."""
        if obj is None:
            return
        meta = obj["metadata"]
        if self._reported.get(meta.get("uid", "")) == reason:
            return
        self._reported[meta.get("uid", "")] = reason
        log.info("claim %s/%s: %s", meta["namespace"], meta["name"], reason)
        pods = self._gated.by_claim().get(object_key(obj), [])
        subjects = [("resource.k8s.io/v1", "ResourceClaim", obj)]
        subjects += [("v1", "Pod", pod) for key in pods if (pod := self._pods.get(key)) is not None]
        why = why or ("FailedAllocation" if warning else "WaitingForGang")
        for api_version, kind, subject in subjects:
            message = reason if kind == "ResourceClaim" else f"claim {meta['name']}: {reason}"
            self.event(api_version, kind, subject, why, message, warning)

    def reason_of(self, obj: dict[str, Any]) -> str | None:
        """The last failure reported for this claim, if any."""
        return self._reported.get(obj["metadata"].get("uid", ""))

    def report_group(
        self,
        podgroup: dict[str, Any] | None,
        claims: Iterable[dict[str, Any] | None],
        reason: str,
        warning: bool = True,
    ) -> None:
        """As report, for each claim of a PodGroup's gang, and once on the PodGroup itself."""
        for obj in claims:
            self.report(obj, reason, warning)
        if podgroup is None or self._reported.get(uid := podgroup["metadata"].get("uid", "")) == reason:
            return
        self._reported[uid] = reason
        why = "FailedAllocation" if warning else "WaitingForGang"
        self.event("scheduling.k8s.io/v1beta1", "PodGroup", podgroup, why, reason, warning)

    def event(
        self, api_version: str, kind: str, subject: dict[str, Any], reason: str, message: str, warning: bool
    ) -> None:
        meta = subject["metadata"]
        event = object_event(api_version, kind, meta, reason, message, COMPONENT, self._wall_clock.now(), warning)
        try:
            self._api.create_event(meta["namespace"], event)
        except KubeError as error:
            log.warning("cannot record an event for %s %s/%s: %s", kind, meta["namespace"], meta["name"], error)
