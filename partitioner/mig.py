"""MIG partitions: create the GPU and compute instance of an allocated placement, destroy them, and
find the device nodes (nvidia-caps) a container needs for one."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import pynvml

from driver.nvml.session import GpuInstanceRecord, NvmlSession

log = logging.getLogger(__name__)
GPU_INSTANCE_IDS = 15  # per GPU, as the driver lays out its capability minors
COMPUTE_INSTANCE_IDS = 8
FIRST_MIG_MINOR = 3  # minors 1 and 2 are the config and monitor capabilities


class MigError(RuntimeError):
    pass


@dataclass(frozen=True)
class MigInstance:
    gpu_index: int
    gi_id: int
    ci_id: int
    uuid: str
    enabled_mig_mode: bool = False  # MIG mode was switched on to create it
    created: bool = True  # False: it was there already (a retried prepare, a partition's later share)


def caps_minor(gpu_minor: int, gi_id: int, ci_id: int | None, proc_root: Path) -> int:
    """The nvidia-caps minor of a GPU or compute instance's access file, from the driver's
    mig-minors table, or the same layout computed where /proc has none (mock NVML)."""
    key = f"gpu{gpu_minor}/gi{gi_id}/access" if ci_id is None else f"gpu{gpu_minor}/gi{gi_id}/ci{ci_id}/access"
    table = proc_root / "driver" / "nvidia-caps" / "mig-minors"
    if table.exists():
        for line in table.read_text().splitlines():
            name, _, minor = line.partition(" ")
            if name == key:
                return int(minor)
        raise MigError(f"{key} is not in {table}")
    per_gpu = GPU_INSTANCE_IDS * (1 + COMPUTE_INSTANCE_IDS)
    base = FIRST_MIG_MINOR + gpu_minor * per_gpu + gi_id * (1 + COMPUTE_INSTANCE_IDS)
    return base if ci_id is None else base + 1 + ci_id


def mig_device_nodes(gpu_minor: int, instance: MigInstance, proc_root: Path) -> tuple[str, ...]:
    return (
        f"/dev/nvidia{gpu_minor}",
        f"/dev/nvidia-caps/nvidia-cap{caps_minor(gpu_minor, instance.gi_id, None, proc_root)}",
        f"/dev/nvidia-caps/nvidia-cap{caps_minor(gpu_minor, instance.gi_id, instance.ci_id, proc_root)}",
    )


class MigPartitioner:
    def __init__(self, session: NvmlSession) -> None:
        self._session = session

    def ensure_mig_mode(self, gpu_index: int) -> bool:
        """True when MIG mode had to be switched on."""
        if self._session.mig_enabled(gpu_index):
            return False
        if not self._session.set_mig_mode(gpu_index, True):
            raise MigError(
                f"MIG mode is off on GPU {gpu_index} and enabling it needs a GPU reset on this GPU "
                "(Ampere); enable MIG mode on the node (nvidia-smi -mig 1, then reset) first"
            )
        log.debug("enabled MIG mode on GPU %d", gpu_index)
        return True

    def find(self, gpu_index: int, profile_id: int, start: int) -> GpuInstanceRecord | None:
        return next(
            (r for r in self._session.gpu_instances(gpu_index) if r.profile_id == profile_id and r.start == start),
            None,
        )

    def create(self, gpu_index: int, profile_id: int, start: int, size: int) -> MigInstance:
        """Create the instance at the placement; an existing one there (a retried prepare) is reused."""
        enabled = self.ensure_mig_mode(gpu_index)
        record = self.find(gpu_index, profile_id, start)
        created = record is None
        if record is None:
            try:
                record = self._session.create_mig_instance(gpu_index, profile_id, start, size)
            except pynvml.NVMLError as err:
                raise MigError(
                    f"cannot create MIG profile {profile_id} at placement {start} on GPU {gpu_index}: {err}"
                ) from err
        if not record.compute_instances:
            raise MigError(f"GPU instance {record.gi_id} on GPU {gpu_index} has no compute instance")
        ci_id, uuid = record.compute_instances[0]
        return MigInstance(gpu_index, record.gi_id, ci_id, uuid, enabled, created)

    def destroy(self, gpu_index: int, gi_id: int) -> None:
        try:
            self._session.destroy_mig_instance(gpu_index, gi_id)
        except pynvml.NVMLError as err:
            raise MigError(f"cannot destroy GPU instance {gi_id} on GPU {gpu_index}: {err}") from err

    def instances(self, gpu_index: int) -> list[GpuInstanceRecord]:
        return self._session.gpu_instances(gpu_index)

    def release_mig_mode_if_idle(self, gpu_index: int) -> bool:
        """Whole-GPU use needs MIG off; switch it off when no instance is left (Hopper and newer).
        True when it was switched off."""
        if not self._session.mig_enabled(gpu_index) or self._session.gpu_instances(gpu_index):
            return False
        if not self._session.set_mig_mode(gpu_index, False):
            raise MigError(f"GPU {gpu_index} is in MIG mode and leaving it needs a GPU reset")
        log.debug("disabled MIG mode on GPU %d for whole-GPU use", gpu_index)
        return True
