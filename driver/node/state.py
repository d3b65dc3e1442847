"""Prepared claims: the domain objects, and their journal on top of the checkpoint file.

A claim's record is written before each side effect of prepare or unprepare (state
PrepareStarted / UnprepareStarted) and marked PrepareCompleted at the end, so a plugin that dies
at any step finds on restart what to roll back or finish. Each record names the plugin instance
that owns it; an instance that still runs (rolling update) keeps its in-flight records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from driver.claims.config import DEFAULT_TENANCY, Tenancy
from driver.inventory.device_kinds import KIND_TRAITS, KindTraits
from driver.inventory.sharing import DeviceKind
from driver.node.cdi import CdiDevice
from driver.node.checkpoint import Checkpoint, CheckpointData

ClaimState = Literal["PrepareStarted", "PrepareCompleted", "UnprepareStarted"]


@dataclass(frozen=True)
class PreparedDevice:
    request_names: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]
    share_id: str | None = None
    kind: DeviceKind = "whole"
    gpu_index: int = 0
    gpu_uuid: str = ""
    mig_profile_id: int | None = None
    mig_start: int | None = None
    mig_size: int | None = None
    mig_uuid: str | None = None
    # Reported in the claim's status (claim_status.py); records written before they existed lack them.
    mig_profile: str | None = None
    mig_gi_id: int | None = None
    mig_ci_id: int | None = None
    mps_memory_bytes: int | None = None
    mps_thread_percentage: int | None = None
    timeslice_interval: str | None = None
    # What the CDI spec needs to be rewritten without the API server (after a reboot, or when the
    # file went missing).
    device_nodes: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    mounts: tuple[tuple[str, str, str], ...] = ()  # (host path, container path, "ro" or "rw")
    # Admin access (KEP-5018, a monitoring claim): access to the GPU without making, changing or
    # holding anything, so it keeps no MIG instance, MPS daemon or timeslice setting alive.
    admin_access: bool = False
    # Whose shares may meet this one's on its device (tenancy.py; from the device class's config).
    # Records written before it existed were in one namespace's hands as far as anyone can tell.
    tenancy: Tenancy = DEFAULT_TENANCY

    @property
    def traits(self) -> KindTraits:
        """What the device's kind is on the GPU (a MIG partition, an MPS or time-sliced share...)."""
        return KIND_TRAITS[self.kind]

    @property
    def holds(self) -> bool:
        """Whether the device holds what it made on the GPU (an admin-access one holds nothing)."""
        return not self.admin_access

    def cdi_device(self) -> CdiDevice:
        return CdiDevice(name=self.device, device_nodes=self.device_nodes, env=self.env, mounts=self.mounts)


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]
    state: ClaimState = "PrepareCompleted"
    owner: str = ""
    # False: kubelet cancelled its NodePrepareResources call before the answer (a rolling update's
    # old instance deregistered mid-call, kubelet's timeout), so it does not know the claim is
    # prepared and waits for its next pod sync; the retry pass (prepare_retries.py) counts it as waiting.
    answered: bool = True

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        if self.answered:  # the usual case written as before: an older plugin (a rollback) reads it
            del record["answered"]
        return record

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> PreparedClaim:
        devices = tuple(PreparedDevice(**_tuples(PreparedDevice, d)) for d in raw["devices"])
        return cls(**{**_tuples(cls, raw), "devices": devices})


def _tuples(kind: type, raw: dict[str, Any]) -> dict[str, Any]:
    """JSON lists back to the tuples the dataclass holds (mounts are triples)."""
    known = {f.name for f in dataclasses.fields(kind)}
    out = {k: v for k, v in raw.items() if k in known}
    for key in ("request_names", "cdi_ids", "device_nodes", "env"):
        if key in out:
            out[key] = tuple(out[key])
    if "mounts" in out:
        # Records written before mounts had an access were pairs, all read-write.
        out["mounts"] = tuple((*m, "rw") if len(m) == 2 else tuple(m) for m in out["mounts"])
    return out


class PreparedClaims:
    """The claims this node has prepared or is preparing, as the checkpoint records them."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self._checkpoint = checkpoint

    def all(self) -> dict[str, PreparedClaim]:
        return {uid: PreparedClaim.from_json(raw) for uid, raw in self._checkpoint.read().claims.items()}

    def answered(self) -> set[str]:
        """The UIDs of the claims kubelet knows are prepared here (it got the answer)."""
        return {uid for uid, claim in self.all().items() if claim.answered}

    def get(self, uid: str) -> PreparedClaim | None:
        raw = self._checkpoint.read().claims.get(uid)
        return PreparedClaim.from_json(raw) if raw else None

    def commit(self, prepared: Iterable[PreparedClaim] = (), removed: Iterable[str] = ()) -> None:
        """Record claims (new or changed) and forget others in one durable write."""
        records = {claim.uid: claim.to_json() for claim in prepared}
        gone = list(removed)

        def change(data: CheckpointData) -> None:
            data.claims.update(records)
            for uid in gone:
                data.claims.pop(uid, None)

        self._checkpoint.apply(change)
