"""The sizes a GPU claim's device can have, and the ladders between them: what a size holds (memory,
compute), what it takes from its GPU, the smallest size of a kind that holds a need, and how many
steps (256Mi, 1% compute, one MIG profile) lie between two sizes.

Compute is in percent of the whole GPU's SMs everywhere here, so that a whole GPU, a MIG partition
and an MPS share compare on one scale; an MPS share inside a MIG partition requests its compute in
percent of the partition, converted at the edges (`_partition_percent`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from driver.inventory.sharing import DeviceKind
from driver.nvml.geometry import GEOMETRY_BY_ID, MEMORY_SLICES
from driver.nvml.machine import bundled_machines, load_machine

MEMORY_STEP_MIB = 256  # shares' memory requests go in 256Mi steps (driver/inventory/devices.py)
COMPUTE_STEP_PERCENT = 1
MIG_KINDS: frozenset[DeviceKind] = frozenset({"mig", "mig-mps", "mig-timeslice"})
DEVICE_CLASSES: dict[DeviceKind, str] = {
    "whole": "gpu.fgpu.dev",
    "mig": "mig.gpu.fgpu.dev",
    "mps": "mps.gpu.fgpu.dev",
    "timeslice": "timeslice.gpu.fgpu.dev",
    "mig-mps": "mig-mps.gpu.fgpu.dev",
    "mig-timeslice": "mig-timeslice.gpu.fgpu.dev",
}
KIND_OF_CLASS = {name: kind for kind, name in DEVICE_CLASSES.items()}


class UnknownGpuError(ValueError):
    """A product or MIG profile that no bundled machine profile knows."""


@dataclass(frozen=True)
class MigOption:
    """One MIG profile a GPU can be partitioned into, with what it holds."""

    name: str
    memory_mib: int
    multiprocessors: int
    memory_slices: int


@dataclass(frozen=True)
class GpuModel:
    """A GPU product as sizing sees it; `mig_ladder` is its MIG profiles from smallest to largest
    (by memory slices, then SMs), without the media-extension variants, which hold no more."""

    product_name: str
    memory_mib: int
    multiprocessors: int
    mig_ladder: tuple[MigOption, ...]

    def mig(self, profile: str) -> MigOption:
        for option in self.mig_ladder:
            if option.name == profile:
                return option
        raise UnknownGpuError(f"{self.product_name} has no MIG profile {profile!r}")


@dataclass(frozen=True)
class Size:
    """A request's device: its kind, and for shares the memory (and for MPS the compute) it
    requests, for MIG kinds the partition's profile. A whole GPU has neither."""

    kind: DeviceKind
    memory_mib: int | None = None
    compute_percent: int | None = None  # MPS: of the GPU; MIG-MPS: of its partition (as requested)
    profile: str | None = None

    def describe(self) -> str:
        parts: list[str] = [self.kind]
        if self.profile:
            parts.append(self.profile)
        if self.memory_mib is not None:
            parts.append(mib_text(self.memory_mib))
        if self.compute_percent is not None:
            parts.append(f"{self.compute_percent}%")
        return " ".join(parts)


@dataclass(frozen=True)
class Need:
    """What a workload needs of a device: memory, and compute in percent of the whole GPU."""

    memory_mib: int
    compute_percent: float


@functools.lru_cache(maxsize=16)
def gpu_model(product_name: str) -> GpuModel:
    """A product's model, from the bundled machine profiles (driver/nvml/machines/)."""
    for name in bundled_machines():
        gpu = load_machine(name).gpu
        if gpu.product_name == product_name:
            ladder = [
                MigOption(spec.name, spec.memory_mib, spec.multiprocessors, GEOMETRY_BY_ID[pid].memory_slices)
                for pid, spec in gpu.mig_profiles.items()
                if not GEOMETRY_BY_ID[pid].media_extensions
            ]
            ladder.sort(key=lambda option: (option.memory_slices, option.multiprocessors))
            return GpuModel(product_name, gpu.memory_mib, gpu.multiprocessors, tuple(ladder))
    raise UnknownGpuError(f"no bundled machine profile has a {product_name!r}")


def memory_limit_mib(size: Size, gpu: GpuModel) -> int:
    """The memory the device's processes can use before they run out: a share's limit under MPS, the
    partition's or GPU's memory otherwise (a time-sliced share's request is accounting only)."""
    if size.kind == "mps" and size.memory_mib is not None:
        return size.memory_mib
    if size.kind == "mig-mps" and size.memory_mib is not None:
        return min(size.memory_mib, _partition(size, gpu).memory_mib)
    if size.kind in MIG_KINDS:
        return _partition(size, gpu).memory_mib
    return gpu.memory_mib


def compute_capacity(size: Size, gpu: GpuModel) -> float:
    """The compute the device can use, in percent of the whole GPU's SMs."""
    partition = 100.0
    if size.kind in MIG_KINDS:
        partition = 100.0 * _partition(size, gpu).multiprocessors / gpu.multiprocessors
    if size.kind in ("mps", "mig-mps") and size.compute_percent is not None:
        return partition * size.compute_percent / 100
    return partition


def gpu_fraction(size: Size, gpu: GpuModel) -> float:
    """What the device takes from its GPU, as fgpu_gpu_seconds_total counts it (driver/node/usage.py:
    whole 1, a partition its memory slices over 8, a share its memory over the GPU's) except that an
    MPS share also counts its compute, since either dimension can fill a GPU."""
    if size.kind == "whole":
        return 1.0
    if size.kind == "mig":
        return _partition(size, gpu).memory_slices / MEMORY_SLICES
    memory = (size.memory_mib or 0) / gpu.memory_mib
    if size.kind in ("mps", "mig-mps"):
        return max(memory, compute_capacity(size, gpu) / 100)
    return memory


def capacity_key(size: Size, gpu: GpuModel) -> tuple[int, float, float]:
    """Orders sizes from smallest to largest: memory first (what runs out), then compute, then what
    the size takes from its GPU."""
    return memory_limit_mib(size, gpu), compute_capacity(size, gpu), gpu_fraction(size, gpu)


def fit(current: Size, need: Need, gpu: GpuModel) -> Size:
    """The smallest size on the current size's ladder that holds the need: a whole GPU moves to a
    MIG profile (keeping hardware isolation) where the GPU has MIG, else to an MPS share; a MIG
    partition to another profile; a share keeps its kind and changes its requests. A need that
    outgrows a share's partition (memory or SMs) or GPU moves up to a partition or the whole GPU."""
    if current.kind in ("whole", "mig"):
        if not gpu.mig_ladder:
            return _fit_share(Size("mps"), need, gpu)
        option = _smallest_mig(need, gpu)
        return Size("mig", profile=option.name) if option else Size("whole")
    if current.kind in ("mig-mps", "mig-timeslice") and not _holds(Size("mig", profile=current.profile), need, gpu):
        return fit(Size("mig"), need, gpu)
    if current.memory_mib is not None and need.memory_mib > gpu.memory_mib:
        return Size("whole")
    return _fit_share(current, need, gpu)


def steps_between(a: Size, b: Size, gpu: GpuModel) -> int | None:
    """How many steps apart two sizes are: MIG profiles by their place on the ladder, shares by
    256Mi of memory and 1% of compute (the larger count); None across kinds (no common ladder)."""
    if a.kind != b.kind:
        return None
    names = [option.name for option in gpu.mig_ladder]
    profile_steps = abs(names.index(a.profile) - names.index(b.profile)) if a.profile and b.profile else 0
    memory_steps = math.ceil(abs((a.memory_mib or 0) - (b.memory_mib or 0)) / MEMORY_STEP_MIB)
    compute_steps = abs((a.compute_percent or 0) - (b.compute_percent or 0)) // COMPUTE_STEP_PERCENT
    return max(profile_steps, memory_steps, compute_steps)


def round_up_memory(mib: float) -> int:
    return max(MEMORY_STEP_MIB, math.ceil(mib / MEMORY_STEP_MIB) * MEMORY_STEP_MIB)


def _fit_share(current: Size, need: Need, gpu: GpuModel) -> Size:
    in_partition = current.kind in MIG_KINDS
    room = _partition(current, gpu).memory_mib if in_partition else gpu.memory_mib
    memory = min(round_up_memory(need.memory_mib), room // MEMORY_STEP_MIB * MEMORY_STEP_MIB)
    if current.kind not in ("mps", "mig-mps"):
        return Size(current.kind, memory_mib=memory, profile=current.profile)
    # MIG-MPS requests compute in percent of its partition; the need is in percent of the GPU.
    scale = gpu.multiprocessors / _partition(current, gpu).multiprocessors if in_partition else 1.0
    compute = min(100, max(COMPUTE_STEP_PERCENT, math.ceil(round(need.compute_percent * scale, 6))))
    return Size(current.kind, memory_mib=memory, compute_percent=compute, profile=current.profile)


def _smallest_mig(need: Need, gpu: GpuModel) -> MigOption | None:
    """The smallest profile holding the need, None when only the whole GPU does (the largest profile
    takes all 8 memory slices: it frees nothing)."""
    for option in gpu.mig_ladder:
        if option.memory_slices == MEMORY_SLICES:
            return None
        if _holds(Size("mig", profile=option.name), need, gpu):
            return option
    return None


def _holds(size: Size, need: Need, gpu: GpuModel) -> bool:
    return memory_limit_mib(size, gpu) >= need.memory_mib and compute_capacity(size, gpu) >= need.compute_percent


def _partition(size: Size, gpu: GpuModel) -> MigOption:
    if size.profile is None:
        raise UnknownGpuError(f"a {size.kind} size needs its MIG profile")
    return gpu.mig(size.profile)


def mib_text(mib: int) -> str:
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"
