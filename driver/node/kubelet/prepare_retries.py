"""Ask kubelet to try again, now, the prepares it could not do while this node had no working
plugin (a crash, a reboot with the plugin late, the NVIDIA driver unloaded).

Kubelet's SyncPod gives up on a pod whose NodePrepareResources failed without failing the sync,
so the pod worker tries it again only at its periodic resync (`syncFrequency`, 60-90 s with its
jitter), not after the usual 10 s back-off. Any change of a pod's annotations makes kubelet sync
that pod at once (its pod config sees an update). So once this instance is registered, or the
driver is back, every claim allocated a device of ours on this node (its pool) that is not prepared
here, or was prepared for a call kubelet cancelled before the answer (`PreparedClaim.answered`: also
asked at once), has the pods it is reserved for annotated `<driver>/prepare-retry` (the time), with a Normal
Event saying why. A claim allocated to this node can only be used by pods on this node, so the
claims alone name the pods: the plugin reads no pods (their specs may hold secrets)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from driver.kube.client import JsonObject, KubeApi
from driver.kube.errors import ConflictError, KubeError, NotFoundError
from driver.kube.events import object_event
from driver.node.background import BackgroundWorker

log = logging.getLogger(__name__)

EVENT_REASON = "PrepareRetried"


def retry_annotation(driver: str) -> str:
    return f"{driver}/prepare-retry"


@dataclass(frozen=True)
class WaitingPod:
    namespace: str
    name: str
    uid: str
    claims: tuple[str, ...]  # those of its claims that wait for us
    claim_uids: tuple[str, ...]  # and their UIDs


def waiting_pods(claims: Iterable[JsonObject], driver: str, pool: str, prepared: Collection[str]) -> list[WaitingPod]:
    """The pods that `claims` with a device of `driver` in `pool` are reserved for, where the claim
    is not among the `prepared` UIDs."""
    waiting: dict[tuple[str, str, str], list[tuple[str, str]]] = {}
    for claim in claims:
        meta, status = claim["metadata"], claim.get("status") or {}
        if meta.get("uid") in prepared or meta.get("deletionTimestamp"):
            continue
        results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or ()
        if not any(r.get("driver") == driver and r.get("pool") == pool for r in results):
            continue
        for consumer in status.get("reservedFor") or ():
            if consumer.get("resource") == "pods" and not consumer.get("apiGroup"):
                key = (meta["namespace"], consumer["name"], consumer["uid"])
                waiting.setdefault(key, []).append((meta["name"], meta["uid"]))
    return [
        WaitingPod(ns, name, uid, tuple(n for n, _ in sorted(found)), tuple(u for _, u in sorted(found)))
        for (ns, name, uid), found in sorted(waiting.items())
    ]


def _utc_now() -> datetime:
    return datetime.now(UTC)


class PrepareRetries(BackgroundWorker):
    """`request(why)` from any thread; the pods are found and annotated on this worker's thread, so
    that kubelet's registration call and the health monitor never wait for the API server."""

    thread_name = "prepare-retries"

    def __init__(
        self,
        api: KubeApi,
        driver: str,
        node: str,
        prepared: Callable[[], Collection[str]],
        clock: Callable[[], datetime] = _utc_now,
        asked: Callable[[Collection[str]], object] = lambda uids: None,
    ) -> None:
        """`prepared`: the claims kubelet knows are prepared here; `asked`: told the claims whose
        pods were annotated (kubelet has been asked about them)."""
        super().__init__()
        self._api = api
        self._driver = driver
        self._node = node  # also the name of the node's pool (prepare's rule)
        self._prepared = prepared
        self._clock = clock
        self._asked = asked
        self._wanted = threading.Event()
        self._why = ""
        self._again_at: float | None = None
        self._guard = threading.Lock()

    def request(self, why: str, again_after_s: float = 0.0) -> None:
        """A pass now, and with `again_after_s`, one more then."""
        with self._guard:
            self._why = why
            if again_after_s:
                self._again_at = time.monotonic() + again_after_s
        self._wanted.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wanted.set()
        super().stop(timeout_s)

    def _run(self) -> None:
        while True:
            with self._guard:
                again_at = self._again_at
            self._wanted.wait(None if again_at is None else max(0.0, again_at - time.monotonic()))
            if self._stop.is_set():
                return
            self._wanted.clear()
            with self._guard:
                why = self._why
                if self._again_at is not None and self._again_at <= time.monotonic():
                    self._again_at = None  # this pass is the one asked for then
            try:
                self.retry_once(why)
            except KubeError as err:
                log.warning("cannot ask kubelet to retry waiting pods: %s", err)
            except Exception:
                log.exception("asking kubelet to retry waiting pods failed")

    def retry_once(self, why: str) -> list[str]:
        """Annotate the pods waiting for one of our prepares; their namespace/name."""
        prepared = set(self._prepared())
        claims = self._api.list_all_claims(from_cache=True)  # every node's plugin lists them after a rollout
        waiting = [pod for pod in waiting_pods(claims, self._driver, self._node, prepared) if self._retry(pod, why)]
        self._asked({uid for pod in waiting for uid in pod.claim_uids})
        retried = [f"{pod.namespace}/{pod.name}" for pod in waiting]
        if retried:
            log.info("%s: asked kubelet to retry the prepares of %s", why, ", ".join(retried))
        return retried

    def _retry(self, pod: WaitingPod, why: str) -> bool:
        now = self._clock()
        # Microseconds: a second request within the same second must still change the pod.
        stamp = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        try:
            self._api.annotate_pod(pod.namespace, pod.name, pod.uid, {retry_annotation(self._driver): stamp})
        except (NotFoundError, ConflictError):
            return False  # gone, or another pod of that name by now
        message = f"{why}: asked kubelet to prepare claim(s) {', '.join(pod.claims)} now, not at its next pod sync"
        meta = {"namespace": pod.namespace, "name": pod.name, "uid": pod.uid}
        event = object_event("v1", "Pod", meta, EVENT_REASON, message, f"{self._driver}/{self._node}", now, False)
        try:
            self._api.create_event(pod.namespace, event)
        except KubeError as err:
            log.warning("pod %s/%s: cannot record an event of the retry: %s", pod.namespace, pod.name, err)
        return True
