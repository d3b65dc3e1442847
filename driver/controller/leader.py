"""Leader election on a coordination.k8s.io Lease: replicas race to hold it; only the holder acts.
A holder that cannot renew within the lease duration steps down before another can take over."""

from __future__ import annotations

import datetime
import logging
import threading
from typing import Any

from driver.kube import KubeError, NotFoundError

log = logging.getLogger(__name__)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _format(moment: datetime.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(text: str | None) -> datetime.datetime | None:
    if not text:
        return None
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


class LeaderElector:
    def __init__(
        self, api: Any, namespace: str, name: str, identity: str, lease_s: int = 15, renew_s: float = 5.0
    ) -> None:
        self.api, self.namespace, self.name, self.identity = api, namespace, name, identity
        self.lease_s, self.renew_s = lease_s, renew_s
        self.is_leader = threading.Event()
        self._renewed_at: datetime.datetime | None = None

    def try_acquire_or_renew(self) -> bool:
        now = _now()
        try:
            lease = self.api.get_lease(self.namespace, self.name)
        except NotFoundError:
            lease = None
        except KubeError as error:
            return self._failed(f"cannot read lease: {error}")
        spec = (lease or {}).get("spec") or {}
        holder = spec.get("holderIdentity")
        renewed = _parse(spec.get("renewTime"))
        expired = renewed is None or now > renewed + datetime.timedelta(
            seconds=spec.get("leaseDurationSeconds") or self.lease_s
        )
        if holder and holder != self.identity and not expired:
            return self._failed("")
        new_spec = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.lease_s,
            "renewTime": _format(now),
            "acquireTime": spec.get("acquireTime") if holder == self.identity else _format(now),
            "leaseTransitions": (spec.get("leaseTransitions") or 0) + (holder not in (None, self.identity)),
        }
        try:
            if lease is None:
                body = {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                }
                self.api.create_lease(self.namespace, {**body, "spec": new_spec})
            else:
                self.api.replace_lease(self.namespace, {**lease, "spec": new_spec})  # resourceVersion: a race loses
        except KubeError as error:
            return self._failed(f"cannot write lease: {error}")
        if not self.is_leader.is_set():
            log.info("became leader (lease %s/%s)", self.namespace, self.name)
        self._renewed_at = now
        self.is_leader.set()
        return True

    def _failed(self, why: str) -> bool:
        if self.is_leader.is_set():
            deadline = (self._renewed_at or _now()) + datetime.timedelta(seconds=self.lease_s - self.renew_s)
            if _now() < deadline:
                return True  # keep leading until the lease could have run out
            log.warning("lost leadership: %s", why or "another replica holds the lease")
            self.is_leader.clear()
        return False

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.try_acquire_or_renew()
            stop.wait(self.renew_s if self.is_leader.is_set() else self.renew_s / 2)
        self.is_leader.clear()
