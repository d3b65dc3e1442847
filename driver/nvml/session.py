"""The only place fgpu talks to NVML. The backend is the pynvml module (real NVML) or a MockNvml,
which has the same call signatures; either way one long-lived session with cached handles, because
NVML calls are slow under contention."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

from driver.nvml.geometry import MIG_GEOMETRY
from driver.nvml.machine import MigProfileSpec, load_machine
from driver.nvml.mock import MockNvml

MOCK_PREFIX = "mock:"
MOCK_STATE_ENV = "FGPU_NVML_MOCK_STATE"


class NvmlUnavailableError(RuntimeError):
    """NVML could not be loaded or initialised; the message says why."""


@dataclass(frozen=True)
class RawGpu:
    """What NVML says about one physical GPU, unconverted."""

    index: int
    minor: int
    uuid: str
    product_name: str
    architecture: int
    cuda_compute_capability: tuple[int, int]
    pci_bus_id: str
    memory_bytes: int
    multiprocessors: int
    mig_capable: bool
    mig_enabled: bool


def open_backend(spec: str) -> Any:
    """`real` for the NVML library, `mock:<machine name or YAML path>` for the mock.

    With the mock, FGPU_NVML_MOCK_STATE names a file that holds the GPUs' state across processes.
    """
    if spec == "real":
        return pynvml
    if spec.startswith(MOCK_PREFIX):
        state = os.environ.get(MOCK_STATE_ENV)
        return MockNvml(load_machine(spec[len(MOCK_PREFIX) :]), Path(state) if state else None)
    raise NvmlUnavailableError(f"--nvml must be 'real' or 'mock:<machine|file.yaml>', got {spec!r}")


class NvmlSession:
    def __init__(self, backend: Any) -> None:
        self.nvml = backend
        self._handles: dict[int, Any] = {}
        self._lock = threading.Lock()
        try:
            backend.nvmlInit()
        except pynvml.NVMLError as err:
            raise NvmlUnavailableError(f"NVML init failed: {err}") from err

    @classmethod
    def open(cls, spec: str) -> NvmlSession:
        return cls(open_backend(spec))

    def close(self) -> None:
        self.nvml.nvmlShutdown()

    def handle(self, index: int) -> Any:
        with self._lock:
            if index not in self._handles:
                self._handles[index] = self.nvml.nvmlDeviceGetHandleByIndex(index)
            return self._handles[index]

    def driver_versions(self) -> tuple[str, int]:
        """(driver version, CUDA driver version as NVML's integer, e.g. 13000)."""
        return self.nvml.nvmlSystemGetDriverVersion(), self.nvml.nvmlSystemGetCudaDriverVersion()

    def gpu_count(self) -> int:
        return self.nvml.nvmlDeviceGetCount()

    def describe(self, index: int) -> RawGpu:
        nvml, handle = self.nvml, self.handle(index)
        bus_id = nvml.nvmlDeviceGetPciInfo(handle).busId
        mig_capable, mig_enabled = self._mig_mode(handle)
        return RawGpu(
            index=index,
            minor=nvml.nvmlDeviceGetMinorNumber(handle),
            uuid=nvml.nvmlDeviceGetUUID(handle),
            product_name=nvml.nvmlDeviceGetName(handle),
            architecture=nvml.nvmlDeviceGetArchitecture(handle),
            cuda_compute_capability=tuple(nvml.nvmlDeviceGetCudaComputeCapability(handle)),
            pci_bus_id=bus_id.decode() if isinstance(bus_id, bytes) else bus_id,
            memory_bytes=nvml.nvmlDeviceGetMemoryInfo(handle).total,
            multiprocessors=nvml.nvmlDeviceGetAttributes(handle).multiprocessorCount,
            mig_capable=mig_capable,
            mig_enabled=mig_enabled,
        )

    def mig_profiles(self, index: int) -> list[MigProfileSpec] | None:
        """The GPU instance profiles NVML reports, or None while MIG mode is off (NVML answers
        profile queries only with MIG enabled)."""
        handle = self.handle(index)
        if not self._mig_mode(handle)[1]:
            return None
        profiles = []
        for geometry in MIG_GEOMETRY:
            try:
                info = self.nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, geometry.profile_index)
            except pynvml.NVMLError as err:
                if err.value == pynvml.NVML_ERROR_NOT_SUPPORTED:
                    continue  # this profile does not exist on this GPU
                raise
            name = info.name.decode() if isinstance(info.name, bytes) else info.name
            profiles.append(
                MigProfileSpec(
                    profile_id=info.id,
                    name=name.removeprefix("MIG "),
                    multiprocessors=info.multiprocessorCount,
                    memory_mib=info.memorySizeMB,
                    copy_engines=info.copyEngineCount,
                    decoders=info.decoderCount,
                    encoders=info.encoderCount,
                    jpeg_engines=info.jpegCount,
                    ofa_engines=info.ofaCount,
                )
            )
        return profiles

    def _mig_mode(self, handle: Any) -> tuple[bool, bool]:
        try:
            current, _pending = self.nvml.nvmlDeviceGetMigMode(handle)
        except pynvml.NVMLError as err:
            if err.value == pynvml.NVML_ERROR_NOT_SUPPORTED:
                return False, False
            raise
        return True, current == pynvml.NVML_DEVICE_MIG_ENABLE
