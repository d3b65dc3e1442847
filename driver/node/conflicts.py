"""Prepare-time conflicts: what a claim's devices cannot share with the claims this node holds.

The allocator's counters keep apart what the hardware cannot share, but two schedulers (fgpu's
controller and kube-scheduler, docs/allocator.md) can each allocate one device before either sees
the other's result. Prepare is the last place that can tell: a claim is refused there, with one
line that kubelet shows in the pod's Events, where a device it needs is held by another claim.

Two held devices conflict when they use the same hardware (the same GPU, or overlapping placements
of two MIG partitions on it), unless both are shares of one device (MPS or time-sliced, published
with allowMultipleAllocations): a whole GPU or a MIG device is one claim's at a time, exactly as the
counters say. Time-sliced shares of a GPU must also agree on its interval, a setting of the whole
GPU (set from the device class's config: driver/claims/config.py).

Who holds what: the checkpoint's records of prepared and preparing claims (prepare journals a claim
before it makes anything: state.py), and the claims this plugin is preparing right now (a claim of
whole GPUs only is recorded once prepared, keeping its prepare at one checkpoint write). A claim
being unprepared holds nothing any more, as partition_use.release counts it. Other plugin instances
(a rolling update) are kept out by the node's claim lock (claim_locks.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from driver.claims.refs import ClaimError
from driver.node import tenancy
from driver.node.state import ClaimState, PreparedClaim, PreparedClaims, PreparedDevice

log = logging.getLogger(__name__)

HOLDING: tuple[ClaimState, ...] = ("PrepareStarted", "PrepareCompleted")


def overlaps(a: PreparedDevice, b: PreparedDevice) -> bool:
    """Whether two devices use the same hardware: the same GPU, and where both are in MIG
    partitions, overlapping placements (memory slices)."""
    if a.gpu_uuid != b.gpu_uuid:
        return False
    if not (a.traits.in_partition and b.traits.in_partition):
        return True  # one uses the whole GPU
    assert a.mig_start is not None and a.mig_size is not None and b.mig_start is not None and b.mig_size is not None
    return a.mig_start < b.mig_start + b.mig_size and b.mig_start < a.mig_start + a.mig_size


@dataclass(frozen=True)
class Conflict:
    """A device of the claim (`device`) that another claim's device (`held`, of `holder`) rules out."""

    device: PreparedDevice
    held: PreparedDevice
    holder: PreparedClaim

    def message(self) -> str:
        """One line for the claim's owner. It does not name the holder: that may be another namespace's claim."""
        retry = "kubelet retries, and prepares it once that claim is unprepared"
        if self.device.device == self.held.device and self.device.traits.shared:
            return (
                f"device {self.device.device} is time-sliced at {self.held.timeslice_interval} by the claims that "
                f"hold it, and this claim's device class asks for {self.device.timeslice_interval} (the interval is "
                f"a setting of the whole GPU); {retry}"
            )
        what = "is held" if self.device.device == self.held.device else f"overlaps {self.held.device}, which is held"
        return (
            f"device {self.device.device} {what} by another claim on this node (a whole GPU or MIG device is one "
            f"claim's at a time: two schedulers allocated it at once); {retry}"
        )


def _conflicting(mine: PreparedDevice, theirs: PreparedDevice) -> bool:
    if not (mine.holds and theirs.holds and overlaps(mine, theirs)):
        return False
    if mine.device != theirs.device or not mine.traits.shared:
        return True
    # Shares of one device: time-sliced shares of a whole GPU share its interval.
    whole_gpu_slices = mine.traits.time_sliced and not mine.traits.in_partition
    return whole_gpu_slices and mine.timeslice_interval != theirs.timeslice_interval


def first_conflict(claim: PreparedClaim, others: Iterable[PreparedClaim]) -> Conflict | None:
    """The first device of `claim` that a device of another holding claim rules out, if any."""
    holders = [c for c in others if c.uid != claim.uid and c.state in HOLDING]
    for device in claim.devices:
        for holder in holders:
            for held in holder.devices:
                if _conflicting(device, held):
                    return Conflict(device, held, holder)
    return None


class HeldDevices:
    """Refuses claims that need what another claim holds, and counts the claims being prepared."""

    def __init__(self, claims: PreparedClaims) -> None:
        self._claims = claims
        self._guard = threading.Lock()
        self._preparing: dict[str, PreparedClaim] = {}  # claim UID -> its plan, until recorded or given up

    def reserve(self, claim: PreparedClaim) -> None:
        """Refuse the claim (ClaimError) where another claim holds what it needs; else count it as
        preparing until done(). Call it under the locks of the claim's GPUs: a conflict is always
        on one GPU, so no other claim can reserve a conflicting device meanwhile."""
        with self._guard:
            preparing = list(self._preparing.values())
        others = [*self._claims.all().values(), *preparing]
        conflict = first_conflict(claim, others)
        if conflict is not None:
            holder = conflict.holder
            log.warning(
                "claim %s/%s: device %s is held by claim %s/%s (uid %s)",
                *(claim.namespace, claim.name, conflict.held.device, holder.namespace, holder.name, holder.uid),
            )
            raise ClaimError(conflict.message(), reason="not_allocated")
        refused = tenancy.refusal(claim, [c for c in others if c.uid != claim.uid and c.state in HOLDING])
        if refused:  # shares of a device another tenant's claims have (tenancy.py)
            log.warning("claim %s/%s: %s", claim.namespace, claim.name, refused)
            raise ClaimError(refused, reason="not_allocated")
        with self._guard:
            self._preparing[claim.uid] = claim

    def done(self, uid: str) -> None:
        """The claim is recorded as prepared, or was given up: its record (if any) says what it holds."""
        with self._guard:
            self._preparing.pop(uid, None)
