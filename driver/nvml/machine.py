"""Machine profiles for the NVML mock: bundled YAML files (machines/) or a user-supplied one."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from driver.nvml.geometry import GEOMETRY_BY_ID
from driver.yamlfile import YamlFileError, load_yaml

MACHINES_DIR = Path(__file__).resolve().parent / "machines"
ARCHITECTURES = {"ampere": 7, "ada": 8, "hopper": 9, "blackwell": 10}  # NVML_DEVICE_ARCH_*


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
    mig_toggle_without_reset: bool = True
    mig_profiles: dict[int, MigProfileSpec] = field(default_factory=dict)


@dataclass(frozen=True)
class MachineProfile:
    name: str
    gpu_count: int
    driver_version: str
    cuda_driver_version: int
    gpu: GpuSpec


def bundled_machines() -> list[str]:
    return sorted(p.stem for p in MACHINES_DIR.glob("*.yaml"))


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
            mig_toggle_without_reset=bool(gpu.get("migToggleWithoutReset", True)),
            mig_profiles=profiles,
        ),
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
