"""Leader election on a coordination.k8s.io Lease, by client-go's rules.

Nothing here trusts another machine's clock. A standby judges expiry by when it saw the Lease
change (its resourceVersion or spec), on its own monotonic clock: it takes over only after seeing
no change for a whole lease duration. The holder acts only until `renew deadline` after the start
of its last successful renewal, also on its monotonic clock (which keeps counting while the process
is stopped), and stops at once when it sees another holder. renew deadline < lease duration, so
the holder has stopped before a standby can take over, given clocks that run at about the same
rate. That narrows the window for two acting replicas; it cannot close it (a replica may be stopped
between its check and its write), so the writes are fenced as well (see ledger.py).

A replica whose loop is stalled (progress.py) neither takes nor renews the Lease, and stops acting
at once: its elector thread runs on while the stuck one holds the process, and would otherwise
keep the Lease from the standby for as long as the stall lasts."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from driver.controller.clock import WALL_CLOCK, WallClock, monotonic
from driver.kube.errors import ConflictError, KubeError, NotFoundError

log = logging.getLogger(__name__)
JITTER = 1.2  # client-go's JitterFactor: the renew deadline must leave room for a late retry


@dataclass(frozen=True)
class LeaseTimings:
    lease_s: float = 15.0  # a standby takes over after seeing the Lease unchanged this long
    renew_deadline_s: float = 10.0  # the holder stops acting this long after its last renewal began
    retry_s: float = 2.0  # how often the holder renews and a standby looks

    def __post_init__(self) -> None:
        if not 0 < self.retry_s * JITTER < self.renew_deadline_s < self.lease_s:
            raise ValueError(
                f"lease timings need 0 < {JITTER} x retry ({self.retry_s}) < renew deadline"
                f" ({self.renew_deadline_s}) < lease duration ({self.lease_s})"
            )


class LeaderElector:
    def __init__(
        self,
        api: Any,
        namespace: str,
        name: str,
        identity: str,
        timings: LeaseTimings | None = None,
        on_change: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = monotonic,
        wall_clock: WallClock = WALL_CLOCK,
        stalled: Callable[[], bool] = lambda: False,
    ) -> None:
        """`stalled`: whether this replica's loop has stopped making progress (progress.py)."""
        self.api, self.namespace, self.name, self.identity = api, namespace, name, identity
        self.timings = timings or LeaseTimings()
        self._on_change = on_change or (lambda leading: None)
        self._clock, self._wall_clock, self._stalled = clock, wall_clock, stalled
        self._observed: tuple[str, dict[str, Any]] | None = None  # (resourceVersion, spec) last seen
        self._observed_at = -math.inf
        self._valid_until = -math.inf  # when this replica must stop acting, unless it renews

    def leading(self) -> bool:
        return self._clock() < self._valid_until

    def try_acquire_or_renew(self) -> bool:
        if self._stalled():
            self._stop_leading("the controller's loop is stalled: the lease is left to expire")
            return False
        started = self._clock()
        try:
            lease = self.api.get_lease(self.namespace, self.name)
        except NotFoundError:
            lease = None
        except KubeError as error:
            log.warning("cannot read the lease: %s", error)
            return False  # a holder keeps acting until its deadline: the others cannot take over sooner
        spec = (lease or {}).get("spec") or {}
        self._observe(((lease or {}).get("metadata") or {}).get("resourceVersion", ""), spec)
        holder = spec.get("holderIdentity")
        if holder and holder != self.identity and self._clock() < self._observed_at + self.timings.lease_s:
            self._stop_leading(f"{holder} holds the lease")
            return False
        try:
            written = self._write(lease, spec, holder)
        except ConflictError:
            self._stop_leading("another replica wrote the lease first")
            return False
        except KubeError as error:
            log.warning("cannot write the lease: %s", error)
            return False
        self._observe(written["metadata"].get("resourceVersion", ""), written.get("spec") or {})
        was_leading = self.leading()
        self._valid_until = started + self.timings.renew_deadline_s
        if not self.leading():  # the answer came after the deadline: a standby may be counting already
            log.warning("the lease was written too late to act on (%.1f s)", self._clock() - started)
            return False
        if not was_leading:
            log.info("became leader (lease %s/%s)", self.namespace, self.name)
            self._on_change(True)
        return True

    def _observe(self, version: str, spec: dict[str, Any]) -> None:
        """Expiry counts from when this replica saw the record change, never from its renewTime."""
        if self._observed != (version, spec):
            self._observed, self._observed_at = (version, spec), self._clock()

    def _write(self, lease: dict[str, Any] | None, spec: dict[str, Any], holder: str | None) -> dict[str, Any]:
        now = self._wall_clock.timestamp(precise=True)
        new_spec = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": math.ceil(self.timings.lease_s),
            "renewTime": now,
            "acquireTime": spec.get("acquireTime") if holder == self.identity else now,
            "leaseTransitions": (spec.get("leaseTransitions") or 0) + (holder not in (None, "", self.identity)),
        }
        if lease is None:
            body: dict[str, Any] = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease"}
            body["metadata"] = {"name": self.name, "namespace": self.namespace}
            return self.api.create_lease(self.namespace, {**body, "spec": new_spec})
        return self.api.replace_lease(self.namespace, {**lease, "spec": new_spec})  # resourceVersion: a race loses

    def _stop_leading(self, why: str) -> None:
        if self.leading():
            log.warning("lost leadership: %s", why)
            self._valid_until = -math.inf
            self._on_change(False)

    def release(self) -> None:
        """Hand the lease over at once (on shutdown, after the last write): a standby need not wait
        for it to expire."""
        if not self.leading() or self._observed is None:
            return
        version, spec = self._observed
        lease = {"metadata": {"name": self.name, "namespace": self.namespace, "resourceVersion": version}}
        try:
            self.api.replace_lease(self.namespace, {**lease, "spec": {**spec, "holderIdentity": ""}})
        except KubeError as error:
            log.warning("cannot release the lease: %s", error)
        self._valid_until = -math.inf

    def _next_try(self) -> float:
        """Seconds to the next attempt: the retry period, or sooner when the holder's lease runs out."""
        if self.leading():
            return self.timings.retry_s
        expires_in = self._observed_at + self.timings.lease_s - self._clock()
        return max(0.01, min(self.timings.retry_s, expires_in + 0.01))

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.try_acquire_or_renew()
            stop.wait(self._next_try())
