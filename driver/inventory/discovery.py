"""NVML -> GPU records: what the node has, in the units and formats the rest of fgpu uses."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pynvml

from driver.common.sysfs import pci_topology
from driver.nvml.geometry import MIG_GEOMETRY
from driver.nvml.machine import MIG_MODE_NEEDS_RESET, MigProfileSpec, known_mig_profiles
from driver.nvml.session import NvmlSession, RawGpu

ARCHITECTURE_NAMES = {7: "Ampere", 8: "Ada Lovelace", 9: "Hopper", 10: "Blackwell"}


@dataclass(frozen=True)
class GpuInfo:
    index: int
    minor: int
    uuid: str
    product_name: str
    architecture: str
    cuda_compute_capability: str  # semver, e.g. "9.0.0"
    driver_version: str  # semver, e.g. "580.95.5"
    cuda_driver_version: str  # semver, e.g. "13.0.0"
    pci_bus_id: str  # lower case, e.g. "0000:18:00.0"
    memory_bytes: int
    multiprocessors: int
    mig_capable: bool
    mig_enabled: bool
    mig_profiles: tuple[MigProfileSpec, ...] = ()
    mig_mode_needs_reset: bool = False  # a MIG mode change waits for a GPU reset (Ampere)
    pcie_root: str | None = None  # "pci<domain>:<bus>", as resource.kubernetes.io/pcieRoot has it
    numa_node: int | None = None  # None: no NUMA affinity


def semver(version: str) -> str:
    """NVIDIA versions to semver: three numeric parts without leading zeros ("580.95.05" -> "580.95.5")."""
    parts = [str(int(part)) for part in version.split(".")[:3]]
    return ".".join(parts + ["0"] * (3 - len(parts)))


def cuda_version(encoded: int) -> str:
    """NVML encodes the CUDA driver version as 1000*major + 10*minor (13000 -> "13.0.0")."""
    return f"{encoded // 1000}.{encoded % 1000 // 10}.0"


def pci_bus_id(nvml_bus_id: str) -> str:
    """NVML's "00000000:18:00.0" to the sysfs form Kubernetes uses, "0000:18:00.0"."""
    domain, rest = nvml_bus_id.split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


def _mig_profiles(session: NvmlSession, raw: RawGpu) -> tuple[MigProfileSpec, ...]:
    if not raw.mig_capable:
        return ()
    profiles = session.mig_profiles(raw.index)
    if profiles is None:  # MIG mode off: NVML cannot list them; the product's known table can
        profiles = list(known_mig_profiles(raw.product_name).values())
    order = {g.profile_id: i for i, g in enumerate(MIG_GEOMETRY)}
    return tuple(sorted(profiles, key=lambda p: order.get(p.profile_id, len(order))))


def discover_gpus(session: NvmlSession) -> list[GpuInfo]:
    driver_version, cuda_driver = session.driver_versions()
    raws = [session.describe(index) for index in range(session.gpu_count())]
    with session.sysfs_root() as sysfs_root:
        topologies = [pci_topology(pci_bus_id(raw.pci_bus_id), sysfs_root) for raw in raws]
    gpus = []
    for raw, topology in zip(raws, topologies, strict=True):
        major, minor = raw.cuda_compute_capability
        bus_id = pci_bus_id(raw.pci_bus_id)
        gpus.append(
            GpuInfo(
                index=raw.index,
                minor=raw.minor,
                uuid=raw.uuid,
                product_name=raw.product_name,
                architecture=ARCHITECTURE_NAMES.get(raw.architecture, "Unknown"),
                cuda_compute_capability=f"{major}.{minor}.0",
                driver_version=semver(driver_version),
                cuda_driver_version=cuda_version(cuda_driver),
                pci_bus_id=bus_id,
                memory_bytes=raw.memory_bytes,
                multiprocessors=raw.multiprocessors,
                mig_capable=raw.mig_capable,
                mig_enabled=raw.mig_enabled,
                mig_profiles=_mig_profiles(session, raw),
                mig_mode_needs_reset=raw.mig_capable and raw.architecture in MIG_MODE_NEEDS_RESET,
                pcie_root=topology.pcie_root,
                numa_node=topology.numa_node,
            )
        )
    return gpus


def with_current_mig_mode(session: NvmlSession, gpus: list[GpuInfo]) -> list[GpuInfo]:
    """The GPUs with their MIG mode as NVML reports it now (nothing else changes while a driver is
    loaded). A GPU NVML cannot answer for keeps its last mode: the health monitor reports it."""
    return [_with_current_mig_mode(session, gpu) if gpu.mig_capable else gpu for gpu in gpus]


def _with_current_mig_mode(session: NvmlSession, gpu: GpuInfo) -> GpuInfo:
    try:
        return replace(gpu, mig_enabled=session.mig_enabled(gpu.index))
    except pynvml.NVMLError:
        return gpu
