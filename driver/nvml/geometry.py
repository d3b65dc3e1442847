"""MIG geometry shared by A100, H100, H200 and B200: profiles, placements and instance limits.

The table is the same on every MIG-capable SKU (NVIDIA MIG user guide, `nvidia-smi mig -lgipp`);
only the names, SM counts and memory sizes differ, and those come from the machine profile.
"""

from __future__ import annotations

from dataclasses import dataclass

MEMORY_SLICES = 8
COMPUTE_SLICES = 7
# NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE constants -> compute slices
COMPUTE_INSTANCE_PROFILE_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7}
COMPUTE_INSTANCE_PROFILE_BY_SLICES = {v: k for k, v in COMPUTE_INSTANCE_PROFILE_SLICES.items()}


@dataclass(frozen=True)
class MigProfileGeometry:
    profile_id: int  # the GPU instance profile id NVML reports (info.id)
    profile_index: int  # the NVML_GPU_INSTANCE_PROFILE_* constant passed to GetGpuInstanceProfileInfo
    compute_slices: int
    memory_slices: int  # placement size
    starts: tuple[int, ...]
    max_instances: int
    media_extensions: bool = False


MIG_GEOMETRY: tuple[MigProfileGeometry, ...] = (
    MigProfileGeometry(19, 0, 1, 1, (0, 1, 2, 3, 4, 5, 6), 7),
    MigProfileGeometry(20, 7, 1, 1, (0, 1, 2, 3, 4, 5, 6), 1, media_extensions=True),
    MigProfileGeometry(15, 9, 1, 2, (0, 2, 4, 6), 4),
    MigProfileGeometry(14, 1, 2, 2, (0, 2, 4), 3),
    MigProfileGeometry(9, 2, 3, 4, (0, 4), 2),
    MigProfileGeometry(5, 3, 4, 4, (0,), 1),
    MigProfileGeometry(0, 4, 7, 8, (0,), 1),
)

GEOMETRY_BY_ID = {g.profile_id: g for g in MIG_GEOMETRY}
GEOMETRY_BY_INDEX = {g.profile_index: g for g in MIG_GEOMETRY}


def memory_slots(start: int, size: int) -> frozenset[int]:
    """The memory slice indices a placement occupies."""
    return frozenset(range(start, start + size))
