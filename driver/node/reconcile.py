"""Missed unprepares: kubelet may never call NodeUnprepareResources for a claim (node restarts,
pods force-deleted while the plugin was down). A prepared claim that no longer exists in the API
server, or was re-created with another UID, is unprepared once it has been missing for a grace
period. An API server that cannot be reached proves nothing, so nothing is unprepared then.

Each pass also repairs the claims' status.devices (claim_status.py): a prepared claim that lacks
its entries gets them, and removals that failed are tried again. And it finds GPUs reset under
prepared claims without an event (an admin's `nvidia-smi -r` of a healthy GPU): where a claim's
MIG instance is gone, that GPU's claims are checked and made again (ClaimPreparer.check_prepared)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from driver.claims.refs import ClaimRef
from driver.kube.client import KubeApi
from driver.kube.errors import KubeError, NotFoundError
from driver.node.background import BackgroundWorker
from driver.node.prepare import ClaimPreparer
from driver.node.state import PreparedClaims

log = logging.getLogger(__name__)


class ClaimReconciler(BackgroundWorker):
    thread_name = "claim-reconciler"

    def __init__(
        self,
        api: KubeApi,
        preparer: ClaimPreparer,
        claims: PreparedClaims,
        grace_s: float = 300.0,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._api = api
        self._preparer = preparer
        self._claims = claims
        self._grace_s = grace_s
        self._interval_s = interval_s
        self._clock = clock
        self._missing_since: dict[str, float] = {}
        super().__init__()

    def reconcile_once(self) -> list[str]:
        """One pass; returns the UIDs it unprepared."""
        now = self._clock()
        prepared = {uid: c for uid, c in self._claims.all().items() if c.state == "PrepareCompleted"}
        for uid in set(self._missing_since) - set(prepared):
            del self._missing_since[uid]
        self._preparer.status.retry_clears()
        for index in sorted(self._preparer.prepare_again.gpus_missing_partitions()):
            log.warning("GPU %d: a prepared claim's MIG instance is gone (a GPU reset); checking its claims", index)
            self._preparer.check_prepared(index)
        unprepared = []
        for uid, claim in prepared.items():
            try:
                current = self._api.get_claim(claim.namespace, claim.name)
                gone = (current.get("metadata") or {}).get("uid") != uid
            except NotFoundError:
                gone = True
            except KubeError as err:
                log.warning("cannot check claim %s/%s: %s; trying again later", claim.namespace, claim.name, err)
                continue
            if not gone:
                self._missing_since.pop(uid, None)
                self._preparer.refresh_status(ClaimRef(claim.namespace, claim.name, uid), current)
                continue
            since = self._missing_since.setdefault(uid, now)
            if now - since < self._grace_s:
                continue
            log.warning(
                "claim %s/%s (uid %s) is gone from the API server since %.0fs; unpreparing it",
                claim.namespace,
                claim.name,
                uid,
                now - since,
            )
            error = self._preparer.unprepare([ClaimRef(claim.namespace, claim.name, uid)])[uid]
            if not error:
                unprepared.append(uid)
                del self._missing_since[uid]
        return unprepared

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.reconcile_once()
            except Exception:
                log.exception("reconciling prepared claims failed")
