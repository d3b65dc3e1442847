"""Machine profiles: bundled YAML files (machines/) or a user-supplied one, for the NVML mock,
which simulates the machine a profile describes. Real discovery reads them too: MigProfileSpec is
its MIG profile record, MIG_MODE_NEEDS_RESET says which architectures switch MIG mode only at a
GPU reset, and known_mig_profiles gives a product's MIG profiles from the bundled profiles while
MIG mode is off (NVML lists none then)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from driver.common.yamlfile import YamlFileError, load_yaml
from driver.nvml.geometry import GEOMETRY_BY_ID

MACHINES_DIR = Path(__file__).resolve().parent / "machines"
ARCHITECTURES = {"ampere": 7, "ada": 8, "hopper": 9, "blackwell": 10}  # NVML_DEVICE_ARCH_*
# MIG mode changes on Ampere take effect at the next GPU reset; Hopper and newer switch at once.
MIG_MODE_NEEDS_RESET = frozenset({ARCHITECTURES["ampere"]})


class MachineProfileError(ValueError):
    """A machine profile that cannot be loaded, with the reason."""


@dataclass(frozen=True)
class MigProfileSpec:
    profile_id: int
    name: str
    multiprocessors: int
    memory_mib: int
    copy_engines: int = 0
    decoders: int = 0
    encoders: int = 0
    jpeg_engines: int = 0
    ofa_engines: int = 0


@dataclass(frozen=True)
class GpuSpec:
    product_name: str
    architecture: str
    cuda_compute_capability: tuple[int, int]
    pci_device_id: int
    memory_mib: int
    multiprocessors: int
    mig_capable: bool
    mig_profiles: dict[int, MigProfileSpec] = field(default_factory=dict)

    @property
    def mig_toggle_without_reset(self) -> bool:
        return ARCHITECTURES[self.architecture] not in MIG_MODE_NEEDS_RESET


@dataclass(frozen=True)
class Topology:
    """Where the GPUs sit: spread evenly over the NUMA nodes in index order, and `gpus_per_pcie_root`
    consecutive GPUs behind one PCIe switch under one root complex (as on DGX and HGX boards)."""

    numa_nodes: int = 1
    gpus_per_pcie_root: int = 1


@dataclass(frozen=True)
class MachineProfile:
    name: str
    gpu_count: int
    driver_version: str
    cuda_driver_version: int
    gpu: GpuSpec
    topology: Topology = Topology()

    def pci_bus(self, index: int) -> int:
        """The PCI bus number of a GPU (device 0, function 0 on it, domain 0)."""
        return 0x18 + 0x10 * index

    def numa_node(self, index: int) -> int:
        return index * self.topology.numa_nodes // self.gpu_count

    def pcie_root_bus(self, index: int) -> int:
        """The bus of the root complex above a GPU: below the first bus of its group's switch."""
        first = index - index % self.topology.gpus_per_pcie_root
        return self.pci_bus(first) - 3


@functools.lru_cache(maxsize=1)
def bundled_machines() -> tuple[str, ...]:
    """The bundled profiles' names: package data, read once (the fleet asks at every node event)."""
    return tuple(sorted(p.stem for p in MACHINES_DIR.glob("*.yaml")))


@functools.lru_cache(maxsize=64)
def load_machine(name_or_path: str) -> MachineProfile:
    """Load a bundled profile by name, or a YAML file by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = MACHINES_DIR / f"{name_or_path}.yaml"
        if not path.exists():
            raise MachineProfileError(
                f"unknown mock machine {name_or_path!r}; bundled: {', '.join(bundled_machines())}"
            )
    try:
        raw = load_yaml(path)
    except YamlFileError as err:
        raise MachineProfileError(f"machine profile: {err}") from err
    if not isinstance(raw, dict):
        raise MachineProfileError(f"invalid machine profile {path}: expected a mapping, found {type(raw).__name__}")
    try:
        return _parse_machine(raw)
    except (KeyError, TypeError, ValueError) as err:
        raise MachineProfileError(f"invalid machine profile {path}: {err!r}") from err


def _parse_machine(raw: dict[str, Any]) -> MachineProfile:
    gpu = raw["gpu"]
    if gpu["architecture"] not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {sorted(ARCHITECTURES)}")
    major, minor = (int(part) for part in str(gpu["cudaComputeCapability"]).split("."))
    profiles = {int(pid): _parse_mig_profile(int(pid), spec) for pid, spec in (gpu.get("migProfiles") or {}).items()}
    unknown = set(profiles) - set(GEOMETRY_BY_ID)
    if unknown:
        raise ValueError(f"unknown MIG profile ids {sorted(unknown)}; known: {sorted(GEOMETRY_BY_ID)}")
    mig_capable = bool(gpu["migCapable"])
    if mig_capable and not profiles:
        raise ValueError("a MIG-capable GPU needs migProfiles")
    topology = raw.get("topology") or {}
    numa_nodes, per_root = int(topology.get("numaNodes", 1)), int(topology.get("gpusPerPcieRoot", 1))
    if numa_nodes < 1 or per_root < 1:
        raise ValueError("topology.numaNodes and topology.gpusPerPcieRoot must be at least 1")
    return MachineProfile(
        name=str(raw["name"]),
        gpu_count=int(raw["gpuCount"]),
        driver_version=str(raw["driverVersion"]),
        cuda_driver_version=int(raw["cudaDriverVersion"]),
        gpu=GpuSpec(
            product_name=str(gpu["productName"]),
            architecture=str(gpu["architecture"]),
            cuda_compute_capability=(major, minor),
            pci_device_id=int(gpu["pciDeviceId"]),
            memory_mib=int(gpu["memoryMiB"]),
            multiprocessors=int(gpu["multiprocessors"]),
            mig_capable=mig_capable,
            mig_profiles=profiles,
        ),
        topology=Topology(numa_nodes, per_root),
    )


def _parse_mig_profile(profile_id: int, spec: dict[str, Any]) -> MigProfileSpec:
    return MigProfileSpec(
        profile_id=profile_id,
        name=str(spec["name"]),
        multiprocessors=int(spec["multiprocessors"]),
        memory_mib=int(spec["memoryMiB"]),
        copy_engines=int(spec.get("copyEngines", 0)),
        decoders=int(spec.get("decoders", 0)),
        encoders=int(spec.get("encoders", 0)),
        jpeg_engines=int(spec.get("jpegEngines", 0)),
        ofa_engines=int(spec.get("ofaEngines", 0)),
    )


def known_mig_profiles(product_name: str) -> dict[int, MigProfileSpec]:
    """The MIG profiles of a product, from the bundled machine profiles (used while MIG mode is
    off and NVML cannot list them)."""
    for name in bundled_machines():
        machine = load_machine(name)
        if machine.gpu.product_name == product_name:
            return machine.gpu.mig_profiles
    return {}
