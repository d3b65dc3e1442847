"""Prepare and unprepare: what kubelet's NodePrepareResources / NodeUnprepareResources mean here,
a batch of claims at a time.

Independent of gRPC: the plugin services translate messages to and from these calls. Every claim
of a batch gets its own result; an error names the claim and the reason and leaves the state of
every other claim alone.

Locking, outermost first: the node's claim lock (claim_locks.NodeClaimLock: one plugin instance's
claim operations at a time, during a rolling update), the claim's own lock (one operation on a
claim at a time: kubelet retries while a call runs), then the locks of the claim's GPUs in index
order (partition_use.py: one GPU's changes at a time; claims on different GPUs run in parallel).

Before anything is journaled, a claim that needs what another claim holds (a whole GPU or MIG
device allocated twice by racing schedulers, a GPU time-sliced at another interval) is refused
(conflicts.py), under its GPUs' locks.

Each step is journaled before its side effect (state.py): the claim's record (PrepareStarted, the
plan of claim_plan.py) before any MIG instance, MPS daemon or timeslice change (partition_use.py);
PrepareCompleted after the CDI spec is written; UnprepareStarted before anything is undone. A
claim prepared before is checked and made again where what it recorded is gone (prepare_again.py).
At start-up, recovery.py rolls back what a crash left half-prepared, finishes half-done
unprepares, and sweeps what no claim owns.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from driver.claims.allocation import allocation_for_node
from driver.claims.refs import ClaimError, ClaimRef, ErrorReason
from driver.common.testhooks import NO_TEST_HOOKS, Step, TestHooks
from driver.inventory.devices import DeviceTarget
from driver.kube.client import JsonObject, KubeApi
from driver.kube.errors import KubeError, NotFoundError
from driver.node import metrics
from driver.node.cdi import CdiWriter
from driver.node.claim_locks import KeyedLocks, NodeClaimLock
from driver.node.claim_plan import ClaimPlanner
from driver.node.claim_result import ClaimResult
from driver.node.claim_status import ClaimStatusWriter, claim_generation, field_manager
from driver.node.conflicts import HeldDevices
from driver.node.instance_lock import InstanceLock
from driver.node.partition_use import Partitioners, PartitionUse
from driver.node.prepare_again import PrepareAgain
from driver.node.rightsized_events import RightsizedEvents
from driver.node.state import PreparedClaim, PreparedClaims, PreparedDevice

log = logging.getLogger(__name__)


class ClaimPreparer:
    """Prepares and unprepares the claims kubelet names, on this node's devices (`targets`): each
    claim of a batch under its own lock, the batch's claims in parallel."""

    def __init__(
        self,
        *,
        driver_name: str,
        node_name: str,
        targets: list[DeviceTarget],
        api: KubeApi,
        claims: PreparedClaims,
        cdi: CdiWriter,
        partitioners: Partitioners,
        instance: InstanceLock,
        node_lock: NodeClaimLock | None = None,
        proc_root: Path = Path("/proc"),
        driver_missing: Callable[[], str] = lambda: "",
        test_hooks: TestHooks = NO_TEST_HOOKS,
    ) -> None:
        """`node_lock`: each claim operation holds it (the plugin process); None where this is the
        only instance (in-process tests). `driver_missing()`: why the NVIDIA driver does not answer
        ("" while it does; the health monitor's finding). `test_hooks`: where the crash-safety
        tests kill or hold the plugin (driver/common/testhooks.py)."""
        self.driver_name = driver_name
        self.pool = node_name
        # What the preparer works with; start-up recovery (recovery.py) works with the same.
        self.targets = {target.name: target for target in targets}
        self._api = api
        self.claims = claims
        self.cdi = cdi
        self.instance = instance
        self._node_lock = node_lock
        self._driver_missing = driver_missing
        self._hooks = test_hooks
        self.status = ClaimStatusWriter(api, driver_name, node_name)
        self.rightsized = RightsizedEvents(api, field_manager(driver_name, node_name))  # the process starts it
        self.locks = KeyedLocks()  # one claim UID at a time: kubelet retries while a call runs
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="claims")
        self._planner = ClaimPlanner(pool=node_name, targets=self.targets, cdi=cdi, owner=instance.id)
        self.partition_use = PartitionUse(
            targets=self.targets, partitioners=partitioners, claims=claims, test_hooks=test_hooks, proc_root=proc_root
        )
        self.held = HeldDevices(claims)  # prepare-time exclusivity (conflicts.py)
        self.prepare_again = PrepareAgain(
            api=api, claims=claims, cdi=cdi, status=self.status, partition_use=self.partition_use, undo=self._undo
        )

    # --- prepare --------------------------------------------------------------------------------

    def prepare(self, refs: list[ClaimRef]) -> dict[str, ClaimResult]:
        if not refs:  # nothing shared: the liveness self-probe must not wait on the other instance
            return {}
        with self.node_wide():
            return self._each(refs, self._prepare_one, "prepare")

    def _prepare_one(self, ref: ClaimRef) -> ClaimResult:
        ref.validate()
        missing = self._driver_missing()
        if missing:  # nothing can be made or checked; the record and the claim's status stay as they are
            raise ClaimError(
                f"the NVIDIA driver is not loaded on this node ({missing}); kubelet's retry prepares the claim "
                "once it is back",
                reason="driver",
            )
        existing = self.claims.get(ref.uid)
        if existing is not None and existing.state == "PrepareCompleted":
            return self.prepare_again.prepare(ref, existing)
        if existing is not None:
            self._undo(existing)  # a half-done attempt: roll it back and start afresh
        try:
            claim = self._api.get_claim(ref.namespace, ref.name)
        except NotFoundError as err:
            raise ClaimError("the claim does not exist in the API server", reason="not_found") from err
        planned = self._planner.plan(allocation_for_node(claim, ref, self.driver_name, self.pool))
        with self.partition_use.gpu_locks(planned.devices):
            self.held.reserve(planned)  # refused: nothing of it journaled or made, nothing to undo
        try:
            if _needs_journal(planned):
                self.claims.commit(prepared=[planned])
            self._hooks.reached(Step.PREPARE_JOURNALED)
            made = self._make(ref, planned)
        finally:
            self.held.done(ref.uid)  # its record says what it holds now, if anything
        devices = tuple(device for device, _ in made)
        self._hooks.reached(Step.PREPARE_COMPLETED)
        self.status.publish(ref, devices, claim_generation(claim))  # best effort: the reconciler repairs it
        self.rightsized.prepared(ref, claim)  # only queued: the answer does not wait for the Event
        return ClaimResult(devices=devices, summary="; ".join(f"{d.device}: {done}" for d, done in made))

    def _make(self, ref: ClaimRef, planned: PreparedClaim) -> list[tuple[PreparedDevice, str]]:
        """Make the planned claim's devices, write its CDI spec and record it prepared; what a failure
        left is rolled back. Each device as made, with what was done."""
        try:
            with self.partition_use.gpu_locks(planned.devices):
                made = [self.partition_use.make(ref, device) for device in planned.devices]
            devices = tuple(device for device, _ in made)
            self.cdi.write(ref.uid, [d.cdi_device() for d in devices])
            self._hooks.reached(Step.CDI_WRITTEN)
            self.claims.commit(prepared=[replace(planned, devices=devices, state="PrepareCompleted")])
        except BaseException as err:
            try:
                self._undo(self.claims.get(ref.uid) or planned)
            except Exception:  # the claim's error stays the original one; recovery retries the undo
                log.exception("rolling back claim %s after %r failed", ref, err)
            raise
        return made

    def check_prepared(self, gpu_index: int | None = None) -> dict[str, ClaimResult]:
        """What every prepared claim recorded (or each with a device on one GPU) checked, and made
        again where it is gone, as kubelet's prepare would: at start-up and after a GPU reset, so
        that it is there before kubelet asks and whatever cannot be made again is released."""
        with self.node_wide():
            refs = [
                ClaimRef(claim.namespace, claim.name, uid)
                for uid, claim in self.claims.all().items()
                if claim.state == "PrepareCompleted"
                and (gpu_index is None or any(d.gpu_index == gpu_index for d in claim.devices))
            ]
            return self._each(refs, self.prepare_again.check, "prepare")

    def record_answer(self, uids: Iterable[str], answered: bool) -> list[str]:
        """Record whether kubelet got the answer of its prepare call for these claims (not: it
        cancelled the call meanwhile); the prepared ones whose record changed, by name."""
        changed = []
        for uid in uids:
            if (known := self.claims.get(uid)) is None or known.answered == answered:
                continue  # the usual case, read without a lock: nothing to write
            with self.node_wide(), self.locks.held(f"claim/{uid}"):
                claim = self.claims.get(uid)
                if claim is not None and claim.state == "PrepareCompleted" and claim.answered != answered:
                    self.claims.commit(prepared=[replace(claim, answered=answered)])
                    changed.append(f"{claim.namespace}/{claim.name}")
        return changed

    # --- unprepare ------------------------------------------------------------------------------

    def unprepare(self, refs: list[ClaimRef]) -> dict[str, str]:
        """Claim UID -> error ("" on success). Unknown claims succeed and touch nothing."""
        if not refs:
            return {}
        with self.node_wide():
            results = self._each(refs, self._unprepare_one, "unprepare")
        return {uid: result.error for uid, result in results.items()}

    def _unprepare_one(self, ref: ClaimRef) -> ClaimResult:
        if not ref.uid:
            raise ClaimError("malformed request: the claim has no uid")
        existing = self.claims.get(ref.uid)
        if existing is None:
            self.cdi.remove(ref.uid)  # a spec without a record is an orphan all the same
            return ClaimResult(summary="not prepared on this node, nothing destroyed")
        missing = self._driver_missing()
        # An unloaded driver took the claim's MIG instances, MPS daemons and GPU settings with it
        # (nothing of it is there once a driver loads again): only the record and the spec are left.
        if missing:
            self._forget(existing)
            summary = f"the NVIDIA driver is not loaded ({missing}): nothing of it left on the GPU"
        else:
            summary = self._undo(existing)
        self.status.clear(ref)  # best effort: the reconciler retries it
        return ClaimResult(summary=summary)

    def undo_left_over(self, ref: ClaimRef) -> ClaimResult:
        """Start-up recovery's unprepare of a claim a crash left half-prepared or half-unprepared:
        kubelet is not asking, so its error is logged (and retried at the next start), not raised."""
        return self._per_claim(ref, lambda: self._unprepare_one(ref))

    def refresh_status(self, ref: ClaimRef, claim: JsonObject) -> None:
        """The reconciler's repair: write the status entries of a prepared claim that `claim` (just
        read) lacks. Under the claim's lock, so an unprepare cannot clear them in between (and the
        node's: the other instance may be unpreparing it)."""
        with self.node_wide(), self.locks.held(f"claim/{ref.uid}"):
            prepared = self.claims.get(ref.uid)
            if prepared is not None and prepared.state == "PrepareCompleted":
                self.status.ensure(ref, prepared.devices, claim)

    def _undo(self, claim: PreparedClaim) -> str:
        """Release everything the claim may hold, then forget it; returns what was released. Safe
        to repeat at any point."""
        if _needs_journal(claim):
            self.claims.commit(prepared=[replace(claim, state="UnprepareStarted", owner=self.instance.id)])
        self._hooks.reached(Step.UNPREPARE_JOURNALED)
        released = self.partition_use.release(claim)
        self._hooks.reached(Step.DEVICES_RELEASED)
        self.cdi.remove(claim.uid)
        self._hooks.reached(Step.CDI_REMOVED)
        self.claims.commit(removed=[claim.uid])
        return "; ".join(released)

    def _forget(self, claim: PreparedClaim) -> None:
        """The record and the CDI spec of a claim whose devices are gone."""
        self.cdi.remove(claim.uid)
        self.claims.commit(removed=[claim.uid])

    # --- helpers --------------------------------------------------------------------------------

    def _each(
        self, refs: list[ClaimRef], action: Callable[[ClaimRef], ClaimResult], operation: metrics.Operation
    ) -> dict[str, ClaimResult]:
        """Run each claim of a batch under its own lock; claims on different GPUs run in parallel.
        Each claim done is one INFO line (a failure is one WARNING line, from _per_claim, and
        counted by its reason)."""

        def one(ref: ClaimRef) -> ClaimResult:
            with self.locks.held(f"claim/{ref.uid}"):
                started = time.monotonic()
                result = self._per_claim(ref, lambda: action(ref))
            if result.reason is not None:
                metrics.record_claim_error(operation, result.reason)
            else:
                elapsed_ms = (time.monotonic() - started) * 1000
                log.info("%sd claim %s in %.0f ms: %s", operation, ref, elapsed_ms, result.summary)
            return result

        if len(refs) == 1:
            return {refs[0].uid: one(refs[0])}
        return dict(zip((r.uid for r in refs), self._pool.map(one, refs), strict=True))

    def _per_claim(self, ref: ClaimRef, action: Callable[[], ClaimResult]) -> ClaimResult:
        """Run one claim's work; whatever goes wrong becomes that claim's error, never the batch's."""
        reason: ErrorReason
        try:
            return action()
        except ClaimError as err:
            message, reason = f"claim {ref}: {err}", err.reason
        except KubeError as err:
            message, reason = f"claim {ref}: cannot read the claim from the API server: {err}", "api"
        except OSError as err:  # the CDI spec, the checkpoint, a MIG device node
            message, reason = f"claim {ref}: {err}", "io"
        except Exception as err:
            log.exception("unexpected error for claim %s", ref)
            message, reason = f"claim {ref}: internal error: {err!r}", "internal"
        log.warning("%s", message)
        return ClaimResult(error=message, reason=reason)

    def node_wide(self) -> contextlib.AbstractContextManager[None]:
        """The node's claim lock where there is one: no other plugin instance works on claims meanwhile."""
        return self._node_lock.held() if self._node_lock is not None else contextlib.nullcontext()


def _needs_journal(claim: PreparedClaim) -> bool:
    """Whole GPUs change nothing on the node but the CDI spec, which the start-up sweep covers; MIG
    instances, MPS daemons and timeslice settings must be journaled before they are made."""
    return any(device.traits.changes_gpu and device.holds for device in claim.devices)
