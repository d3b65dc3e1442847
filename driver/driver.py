"""Prepare and unprepare: what kubelet's NodePrepareResources / NodeUnprepareResources mean here.

Independent of gRPC: the plugin services translate messages to and from these calls. Every claim
of a batch gets its own result; an error names the claim and the reason and leaves the state of
every other claim alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from driver.cdi import CdiDevice, CdiWriter
from driver.claims import ClaimAllocation, ClaimError, ClaimRef, allocation_for_node
from driver.devices import whole_gpu_name
from driver.discovery import GpuInfo
from driver.kube import KubeApi, KubeError, NotFoundError
from driver.state import PreparedClaim, PreparedClaims, PreparedDevice

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrepareResult:
    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class Driver:
    def __init__(
        self,
        driver_name: str,
        node_name: str,
        gpus: list[GpuInfo],
        api: KubeApi,
        claims: PreparedClaims,
        cdi: CdiWriter,
    ) -> None:
        self.driver_name = driver_name
        self.pool = node_name
        self._gpus = {whole_gpu_name(gpu): gpu for gpu in gpus}
        self._api = api
        self._claims = claims
        self._cdi = cdi
        # Serialises check-then-act on one claim UID when kubelet retries while a call runs.
        self._claim_locks: dict[str, threading.Lock] = {}
        self._claim_locks_guard = threading.Lock()

    # --- prepare --------------------------------------------------------------------------------

    def prepare(self, refs: list[ClaimRef]) -> dict[str, PrepareResult]:
        results: dict[str, PrepareResult] = {}
        fresh: list[PreparedClaim] = []
        for ref in refs:
            with self._claim_lock(ref.uid):
                results[ref.uid] = self._per_claim(ref, lambda r=ref: self._prepare_one(r, fresh))
        if fresh:
            try:
                self._claims.commit(prepared=fresh)
            except OSError as err:
                for claim in fresh:
                    self._cdi.remove(claim.uid)
                    results[claim.uid] = PrepareResult(error=f"claim {claim.namespace}/{claim.name}: {err}")
        return results

    def _prepare_one(self, ref: ClaimRef, fresh: list[PreparedClaim]) -> PrepareResult:
        ref.validate()
        existing = self._claims.get(ref.uid)
        if existing is not None:
            # Idempotent: the same answer; the spec is rewritten if it went missing (e.g. a reboot).
            if not self._cdi.spec_path(ref.uid).exists():
                self._cdi.write(ref.uid, self._cdi_devices(existing.device_nodes))
            return PrepareResult(devices=existing.devices)
        try:
            claim = self._api.get_claim(ref.namespace, ref.name)
        except NotFoundError as err:
            raise ClaimError("the claim does not exist in the API server") from err
        allocation = allocation_for_node(claim, ref, self.driver_name, self.pool)
        prepared = self._prepared_claim(allocation)
        self._cdi.write(ref.uid, self._cdi_devices(prepared.device_nodes))
        fresh.append(prepared)
        return PrepareResult(devices=prepared.devices)

    def _prepared_claim(self, allocation: ClaimAllocation) -> PreparedClaim:
        ref = allocation.claim
        requests_by_device: dict[str, list[str]] = {}
        for allocated in allocation.devices:
            if allocated.device not in self._gpus:
                raise ClaimError(f"device {allocated.device!r} is not a device of this node's pool {self.pool}")
            requests_by_device.setdefault(allocated.device, [])
            if allocated.request not in requests_by_device[allocated.device]:
                requests_by_device[allocated.device].append(allocated.request)
        devices = tuple(
            PreparedDevice(
                request_names=tuple(requests),
                pool=self.pool,
                device=name,
                cdi_ids=(self._cdi.qualified_id(ref.uid, name),),
            )
            for name, requests in requests_by_device.items()
        )
        nodes = {name: (f"/dev/nvidia{self._gpus[name].minor}",) for name in requests_by_device}
        return PreparedClaim(ref.uid, ref.namespace, ref.name, devices, nodes)

    @staticmethod
    def _cdi_devices(device_nodes: dict[str, tuple[str, ...]]) -> list[CdiDevice]:
        return [CdiDevice(name=name, device_nodes=nodes) for name, nodes in device_nodes.items()]

    # --- unprepare ------------------------------------------------------------------------------

    def unprepare(self, refs: list[ClaimRef]) -> dict[str, str]:
        """Claim UID -> error ("" on success). Unknown claims succeed and touch nothing."""
        errors: dict[str, str] = {}
        done: list[str] = []
        for ref in refs:
            with self._claim_lock(ref.uid):
                result = self._per_claim(ref, lambda r=ref: self._unprepare_one(r))
            errors[ref.uid] = result.error
            if not result.error:
                done.append(ref.uid)
        if done:
            try:
                self._claims.commit(removed=done)
            except OSError as err:
                errors.update({uid: f"claim {uid}: {err}" for uid in done})
        with self._claim_locks_guard:
            for uid in done:
                self._claim_locks.pop(uid, None)
        return errors

    def _unprepare_one(self, ref: ClaimRef) -> PrepareResult:
        if not ref.uid:
            raise ClaimError("malformed request: the claim has no uid")
        self._cdi.remove(ref.uid)
        return PrepareResult()

    # --- helpers --------------------------------------------------------------------------------

    def _per_claim(self, ref: ClaimRef, action: Callable[[], PrepareResult]) -> PrepareResult:
        """Run one claim's work; whatever goes wrong becomes that claim's error, never the batch's."""
        try:
            return action()
        except ClaimError as err:
            message = f"claim {ref}: {err}"
        except KubeError as err:
            message = f"claim {ref}: cannot read the claim from the API server: {err}"
        except OSError as err:
            message = f"claim {ref}: {err}"
        except Exception as err:
            log.exception("unexpected error for claim %s", ref)
            message = f"claim {ref}: internal error: {err!r}"
        log.warning("%s", message)
        return PrepareResult(error=message)

    def _claim_lock(self, uid: str) -> threading.Lock:
        with self._claim_locks_guard:
            return self._claim_locks.setdefault(uid, threading.Lock())
