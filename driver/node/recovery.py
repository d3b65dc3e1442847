"""Start-up recovery: what a crash, a kill or a reboot left on the node, put right before the plugin
serves kubelet.

Prepared claims are checked first (ClaimPreparer.check_prepared): what a reboot or a GPU reset
destroyed meanwhile (MIG instances, MPS daemons, compute modes, time-slice settings, CDI specs)
is made again, or the claim released with its error logged, before kubelet prepares them again.

A claim whose record says it was being prepared or unprepared (PrepareStarted, UnprepareStarted)
by an instance that no longer runs is undone: rolled back if half-prepared, finished if
half-unprepared (prepare.py journals each step before its side effect, so the record says what
may exist). Then the sweeps remove what no prepared claim owns: MPS daemons (first: a partition's
daemon goes before its MIG instance), MIG instances and CDI specs. All under the node's claim
lock: the sweeps act on what the checkpoint did not list, and no other instance may add to it
meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from driver.claims.refs import ClaimRef
from driver.inventory.device_kinds import KIND_TRAITS, KindTraits
from driver.node.prepare import ClaimPreparer
from driver.node.state import PreparedClaim

log = logging.getLogger(__name__)


def recover(preparer: ClaimPreparer) -> None:
    """Roll back half-prepared claims, finish half-unprepared ones (of instances that no longer
    run), check prepared ones, and sweep MIG instances, MPS daemons and CDI specs no prepared claim owns."""
    with preparer.node_wide():
        for claim in preparer.claims.all().values():
            if claim.state != "PrepareCompleted" and not preparer.instance.owner_alive(claim.owner):
                log.warning("claim %s/%s was left %s by a crash; undoing it", claim.namespace, claim.name, claim.state)
                preparer.undo_left_over(ClaimRef(claim.namespace, claim.name, claim.uid))
        # Before the sweeps: a reboot or GPU reset since the claims were prepared destroyed their MIG
        # instances, and those made again have new UUIDs, by which their MPS daemons go.
        preparer.check_prepared()
        prepared = preparer.claims.all()
        # MPS first: a partition's orphaned daemon goes before its MIG instance.
        for sweep in (_sweep_mps, _sweep_mig, _sweep_cdi):
            try:
                sweep(preparer, prepared)
            except Exception:  # serving kubelet matters more; the next start sweeps again
                log.exception("start-up sweep %s failed", sweep.__name__)


def _sweep_mig(preparer: ClaimPreparer, prepared: dict[str, PreparedClaim]) -> None:
    owned = {
        (d.gpu_index, d.mig_profile_id, d.mig_start)
        for c in prepared.values()
        for d in c.devices
        if d.traits.in_partition and d.holds
    }
    mig = preparer.partition_use.partitioners.mig
    for index in _gpus_offering(preparer, lambda kind: kind.in_partition):
        with preparer.partition_use.gpu_lock(index):
            for record in mig.instances(index):
                if (index, record.profile_id, record.start) not in owned:
                    log.warning("destroying orphaned MIG instance %d on GPU %d", record.gi_id, index)
                    mig.destroy(index, record.gi_id)


def _sweep_mps(preparer: ClaimPreparer, prepared: dict[str, PreparedClaim]) -> None:
    """Daemons of GPUs (whole-GPU shares) and of MIG partitions (keyed by the MIG device's UUID)."""
    shares = {
        # (GPU, the daemon's device: the GPU's UUID or the partition's MIG UUID, whether it has the GPU to itself)
        (d.gpu_index, d.mig_uuid if d.traits.in_partition and d.mig_uuid else d.gpu_uuid, not d.traits.in_partition)
        for c in prepared.values()
        for d in c.devices
        if d.traits.mps and d.holds and (not d.traits.in_partition or d.mig_uuid)
    }
    mps = preparer.partition_use.partitioners.mps
    for index, uuid, exclusive in sorted(shares):
        with preparer.partition_use.gpu_lock(index):
            # The daemon outlives the plugin: adopted when it runs, started again after a reboot.
            started = mps.start(index, uuid, exclusive_gpu=exclusive)
        log.info("MPS daemon of %s %s", uuid, "started" if started else "adopted")
    wanted = {uuid for _, uuid, _ in shares}
    gpus = {t.gpu.uuid: t.gpu.index for t in preparer.targets.values()}
    partitions = {
        uuid: index
        for index in _gpus_offering(preparer, lambda kind: kind.in_partition and kind.mps)
        for record in preparer.partition_use.partitioners.mig.instances(index)
        for _, uuid in record.compute_instances
    }
    for uuid in sorted(mps.gpus_with_state() - wanted):
        # A partition's daemon is known by its MIG UUID, also once its instance is gone (no GPU lock then).
        if uuid in gpus or uuid.startswith("MIG-"):
            index = gpus.get(uuid, partitions.get(uuid, -1))
            log.warning("stopping the MPS daemon of %s and unmounting its tmpfs: no MPS share there", uuid)
            with preparer.partition_use.gpu_lock(index):
                mps.stop(index, uuid, exclusive_gpu=uuid in gpus)


def _sweep_cdi(preparer: ClaimPreparer, prepared: dict[str, PreparedClaim]) -> None:
    on_disk = preparer.cdi.claim_uids_on_disk()  # listed before the records are read again
    known = set(preparer.claims.all()) | set(prepared)
    for uid in sorted(on_disk - known):
        preparer.cdi.remove(uid)
        log.info("removed orphaned CDI spec of claim %s (not prepared)", uid)


def _gpus_offering(preparer: ClaimPreparer, trait: Callable[[KindTraits], bool]) -> list[int]:
    """The indexes of the GPUs that offer a device of a kind with that trait, in order."""
    return sorted({t.gpu.index for t in preparer.targets.values() if trait(KIND_TRAITS[t.kind])})
