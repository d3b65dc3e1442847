"""The only place fgpu talks to NVML. The backend is the pynvml module (real NVML) or a MockNvml,
which has the same call signatures; either way one long-lived session with cached handles, because
NVML calls are slow under contention."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pynvml

from driver.common.sysfs import SYSFS_ROOT
from driver.nvml.geometry import (
    COMPUTE_INSTANCE_PROFILE_BY_SLICES,
    COMPUTE_SLICES,
    GEOMETRY_BY_ID,
    MIG_GEOMETRY,
)
from driver.nvml.gpm import GpmReader
from driver.nvml.machine import MigProfileSpec, load_machine
from driver.nvml.mock import NO_INSTANCE, MockNvml

MOCK_PREFIX = "mock:"
MOCK_STATE_ENV = "FGPU_NVML_MOCK_STATE"
MAX_GPU_INSTANCE_ID = 14  # GPU instance ids NVML hands out are below 15


# NVML without a driver: none loaded, or this process's NVML initialised under one since unloaded.
DRIVER_GONE_ERRORS = frozenset({pynvml.NVML_ERROR_DRIVER_NOT_LOADED, pynvml.NVML_ERROR_UNINITIALIZED})


class NvmlUnavailableError(RuntimeError):
    """NVML could not be loaded or initialised; the message says why."""


@dataclass(frozen=True)
class GpuInstanceRecord:
    """A GPU instance as NVML reports it, with its compute instances as (id, MIG UUID)."""

    gi_id: int
    profile_id: int
    start: int
    size: int
    compute_instances: tuple[tuple[int, str], ...]


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


@dataclass(frozen=True)
class DeviceUsage:
    """A GPU's or MIG device's memory and, where NVML measures it, its utilisation: a GPU's busy
    time, a MIG device's SMs busy in its GPU instance (GPM, driver/nvml/gpm.py)."""

    memory_used_bytes: int
    memory_total_bytes: int
    # None on GPUs in MIG mode (NVML does not support it), on MIG devices without a GPM measure
    gpu_percent: float | None


@dataclass(frozen=True)
class NvmlProcess:
    """A compute process on a GPU: on which MIG device (None: the GPU itself), its SM utilisation
    in NVML's latest sample (None where NVML samples no processes: MIG mode), and the GPU memory
    it holds (None where NVML does not say: without permission, or under some vGPU drivers)."""

    pid: int
    mig_uuid: str | None
    sm_percent: int | None
    memory_bytes: int | None = None


def _used_memory(process: Any) -> int | None:
    """A process's usedGpuMemory: pynvml gives None where NVML reports it unavailable."""
    used = getattr(process, "usedGpuMemory", None)
    return int(used) if isinstance(used, int) else None


def _unless_absent(call: Any, *args: Any) -> Any:
    """The call's result, or None where NVML says no such instance (NOT_FOUND, or INVALID_ARGUMENT
    for an id it does not hand out)."""
    try:
        return call(*args)
    except pynvml.NVMLError as err:
        if err.value in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT):
            return None
        raise


def is_mock(spec: str) -> bool:
    return spec.startswith(MOCK_PREFIX)


def open_backend(spec: str) -> Any:
    """`real` for the NVML library, `mock:<machine name or YAML path>` for the mock.

    With the mock, FGPU_NVML_MOCK_STATE names a file that holds the GPUs' state across processes.
    """
    if spec == "real":
        return pynvml
    if is_mock(spec):
        state = os.environ.get(MOCK_STATE_ENV)
        return MockNvml(load_machine(spec[len(MOCK_PREFIX) :]), Path(state) if state else None)
    raise NvmlUnavailableError(f"--nvml must be 'real' or 'mock:<machine|file.yaml>', got {spec!r}")


class NvmlSession:
    def __init__(self, backend: Any) -> None:
        self.nvml = backend
        self._handles: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._gpm = GpmReader(backend)
        self.driver_loads = 0  # how often NVML was initialised anew (driver_missing): each time a new driver
        try:
            backend.nvmlInit()
        except pynvml.NVMLError as err:
            raise NvmlUnavailableError(f"NVML init failed: {err}") from err

    @classmethod
    def open(cls, spec: str) -> NvmlSession:
        return cls(open_backend(spec))

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except pynvml.NVMLError as err:
            if err.value not in DRIVER_GONE_ERRORS:  # the driver went: nothing left to shut down
                raise

    def driver_missing(self) -> str:
        """ "" while the NVIDIA driver answers, else why not. Once it failed, NVML is initialised
        anew at each call: a driver loaded again (an upgrade, a restart of the driver container)
        is a new one, and the handles and init of the earlier one are stale."""
        try:
            self.nvml.nvmlSystemGetDriverVersion()
            return ""
        except pynvml.NVMLError as err:
            if err.value not in DRIVER_GONE_ERRORS:
                raise
        with self._lock:
            self._handles.clear()
            self._gpm.forget()
            with contextlib.suppress(pynvml.NVMLError):  # not initialised any more is fine
                self.nvml.nvmlShutdown()
            try:
                self.nvml.nvmlInit()
            except pynvml.NVMLError as err:
                return f"NVML init failed: {err}"
            self.driver_loads += 1
        return ""

    def handle(self, index: int) -> Any:
        with self._lock:
            if index not in self._handles:
                self._handles[index] = self.nvml.nvmlDeviceGetHandleByIndex(index)
            return self._handles[index]

    @contextlib.contextmanager
    def sysfs_root(self) -> Iterator[Path]:
        """Where this machine's /sys is, while it is read: the host's, or the mock machine's own
        (its GPUs' PCI topology), so that one sysfs reader serves both."""
        if isinstance(self.nvml, MockNvml):
            with self.nvml.sysfs_root() as root:
                yield root
        else:
            yield SYSFS_ROOT

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

    # --- MIG instances and compute mode (called by partitioner/, serialised per GPU there) ---

    def set_mig_mode(self, index: int, enabled: bool) -> bool:
        """Switch MIG mode; False when the change stays pending until a GPU reset (A100)."""
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        status = self.nvml.nvmlDeviceSetMigMode(self.handle(index), mode)
        if status != pynvml.NVML_SUCCESS:
            # Leave nothing pending: the GPU would change mode at its next reset, unasked.
            current = pynvml.NVML_DEVICE_MIG_DISABLE if enabled else pynvml.NVML_DEVICE_MIG_ENABLE
            self.nvml.nvmlDeviceSetMigMode(self.handle(index), current)
            return False
        return True

    def mig_enabled(self, index: int) -> bool:
        return self._mig_mode(self.handle(index))[1]

    def gpu_instances(self, index: int) -> list[GpuInstanceRecord]:
        """The GPU instances that exist on a GPU, with their compute instances and MIG UUIDs."""
        handle = self.handle(index)
        if not self.mig_enabled(index):
            return []
        uuids: dict[tuple[int, int], str] = {}
        for mig in self._mig_handles(handle):
            key = (self.nvml.nvmlDeviceGetGpuInstanceId(mig), self.nvml.nvmlDeviceGetComputeInstanceId(mig))
            uuids[key] = self.nvml.nvmlDeviceGetUUID(mig)
        records = []
        for gi_id in range(MAX_GPU_INSTANCE_ID + 1):
            instance = _unless_absent(self.nvml.nvmlDeviceGetGpuInstanceById, handle, gi_id)
            if instance is None:
                continue
            info = self.nvml.nvmlGpuInstanceGetInfo(instance)
            cis = tuple(sorted((ci, uuid) for (gi, ci), uuid in uuids.items() if gi == gi_id))
            records.append(GpuInstanceRecord(gi_id, info.profileId, info.placement.start, info.placement.size, cis))
        return records

    def _mig_handles(self, handle: Any) -> Iterator[Any]:
        for i in range(self.nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            mig = _unless_absent(self.nvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, i)
            if mig is not None:
                yield mig

    # --- usage (read by the plugin's metrics at scrape time) ---

    def usage(self, index: int) -> DeviceUsage:
        return self._usage(self.handle(index))

    def mig_usage(self, index: int) -> dict[str, DeviceUsage]:
        """Each MIG device's usage by its MIG UUID, with its GPU instance's SM utilisation where GPM
        measures it; empty while MIG mode is off."""
        if not self.mig_enabled(index):
            return {}
        handle, usages = self.handle(index), {}
        for mig in self._mig_handles(handle):
            mig_uuid, gi_id = self.nvml.nvmlDeviceGetUUID(mig), self.nvml.nvmlDeviceGetGpuInstanceId(mig)
            measured = self._gpm.instance_percent(index, handle, gi_id, mig_uuid)
            usages[mig_uuid] = replace(self._usage(mig), gpu_percent=measured)
        self._gpm.keep_only(index, usages)
        return usages

    def processes(self, index: int) -> list[NvmlProcess]:
        """The compute processes on the GPU or, in MIG mode, on each of its MIG devices."""
        handle = self.handle(index)
        if self.mig_enabled(index):
            return [
                NvmlProcess(p.pid, self.nvml.nvmlDeviceGetUUID(mig), None, _used_memory(p))
                for mig in self._mig_handles(handle)
                for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(mig)
            ]
        samples: dict[int, int] | None = {}
        try:
            samples = {s.pid: s.smUtil for s in self.nvml.nvmlDeviceGetProcessUtilization(handle, 0)}
        except pynvml.NVMLError as err:
            if err.value == pynvml.NVML_ERROR_NOT_SUPPORTED:
                samples = None
            elif err.value != pynvml.NVML_ERROR_NOT_FOUND:  # NOT_FOUND: no process ran in its window
                raise
        # A listed process without a sample did not run on the SMs in NVML's window: 0.
        return [
            NvmlProcess(p.pid, None, None if samples is None else samples.get(p.pid, 0), _used_memory(p))
            for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        ]

    def _usage(self, handle: Any) -> DeviceUsage:
        memory = self.nvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            gpu_percent: int | None = self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu
        except pynvml.NVMLError as err:
            if err.value != pynvml.NVML_ERROR_NOT_SUPPORTED:  # MIG devices, and GPUs in MIG mode
                raise
            gpu_percent = None
        return DeviceUsage(memory_used_bytes=memory.used, memory_total_bytes=memory.total, gpu_percent=gpu_percent)

    def create_mig_instance(self, index: int, profile_id: int, start: int, size: int) -> GpuInstanceRecord:
        """Create a GPU instance at the placement and one compute instance spanning it."""
        handle = self.handle(index)
        placement = pynvml.c_nvmlGpuInstancePlacement_t()
        placement.start, placement.size = start, size
        instance = self.nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, profile_id, placement)
        gi_id = self.nvml.nvmlGpuInstanceGetInfo(instance).id
        slices = GEOMETRY_BY_ID[profile_id].compute_slices
        ci_profile = COMPUTE_INSTANCE_PROFILE_BY_SLICES[slices]
        try:
            self.nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                instance, ci_profile, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            )
            self.nvml.nvmlGpuInstanceCreateComputeInstance(instance, ci_profile)
        except pynvml.NVMLError:
            self.nvml.nvmlGpuInstanceDestroy(instance)  # no half-made instance left behind
            raise
        return next(r for r in self.gpu_instances(index) if r.gi_id == gi_id)

    def destroy_mig_instance(self, index: int, gi_id: int) -> None:
        """Destroy the compute instances, then the GPU instance. Gone already is fine."""
        handle = self.handle(index)
        instance = _unless_absent(self.nvml.nvmlDeviceGetGpuInstanceById, handle, gi_id)
        if instance is None:
            return
        for ci_id in range(COMPUTE_SLICES):
            compute = _unless_absent(self.nvml.nvmlGpuInstanceGetComputeInstanceById, instance, ci_id)
            if compute is not None:
                self.nvml.nvmlComputeInstanceDestroy(compute)
        self.nvml.nvmlGpuInstanceDestroy(instance)

    def set_compute_mode(self, index: int, mode: int) -> None:
        self.nvml.nvmlDeviceSetComputeMode(self.handle(index), mode)

    def compute_mode(self, index: int) -> int:
        return self.nvml.nvmlDeviceGetComputeMode(self.handle(index))


# --- health: XID and ECC events, reachability ----------------------------------------------------

HEALTH_EVENTS = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError


@dataclass(frozen=True)
class NvmlEvent:
    """A health event: an XID (with its number) or a double-bit ECC error, on a GPU or one of
    its MIG instances (gi_id/ci_id where NVML attributes it)."""

    gpu_index: int
    kind: str  # "xid" or "ecc"
    xid: int | None = None
    gi_id: int | None = None
    ci_id: int | None = None


class GpuLostError(RuntimeError):
    """NVML says a watched GPU fell off the bus (GPU_IS_LOST)."""


class DriverGoneError(RuntimeError):
    """NVML says the driver went while a watch or probe waited on it (NvmlSession.driver_missing)."""


class EventWatch:
    """An NVML event set with XID and double-bit ECC events of the given GPUs registered."""

    def __init__(self, session: NvmlSession, indices: list[int]) -> None:
        self._session, self._indices = session, indices
        self._nvml = session.nvml
        self._set = self._register()

    def renew(self) -> None:
        """A new event set, for a driver loaded again: the old one belonged to the driver that went."""
        with contextlib.suppress(pynvml.NVMLError):
            self.close()
        self._set = self._register()

    def _register(self) -> Any:
        event_set = self._nvml.nvmlEventSetCreate()
        for index in self._indices:
            handle = self._session.handle(index)
            try:
                wanted = HEALTH_EVENTS & self._nvml.nvmlDeviceGetSupportedEventTypes(handle)
                if wanted:
                    self._nvml.nvmlDeviceRegisterEvents(handle, wanted, event_set)
            except pynvml.NVMLError as err:
                if err.value != pynvml.NVML_ERROR_GPU_IS_LOST:
                    raise  # a lost GPU is found by the reachability probe
        return event_set

    def next(self, timeout_s: float) -> NvmlEvent | None:
        """The next event, or None when none came within the timeout."""
        try:
            data = self._nvml.nvmlEventSetWait_v2(self._set, int(timeout_s * 1000))
        except pynvml.NVMLError as err:
            if err.value == pynvml.NVML_ERROR_TIMEOUT:
                return None
            if err.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise GpuLostError(str(err)) from err
            if err.value in DRIVER_GONE_ERRORS:
                raise DriverGoneError(str(err)) from err
            raise
        index = self._nvml.nvmlDeviceGetIndex(data.device)
        gi = None if data.gpuInstanceId == NO_INSTANCE else data.gpuInstanceId
        ci = None if data.computeInstanceId == NO_INSTANCE else data.computeInstanceId
        if data.eventType == pynvml.nvmlEventTypeXidCriticalError:
            return NvmlEvent(index, "xid", data.eventData, gi, ci)
        return NvmlEvent(index, "ecc", None, gi, ci)

    def close(self) -> None:
        self._nvml.nvmlEventSetFree(self._set)


def gpu_reachable(session: NvmlSession, index: int) -> bool:
    """False when NVML says the GPU is lost. The probe reads the volatile double-bit ECC counter,
    a cheap query every data-centre GPU answers (NOT_SUPPORTED elsewhere, which is fine)."""
    try:
        session.nvml.nvmlDeviceGetTotalEccErrors(
            session.handle(index), pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
        )
    except pynvml.NVMLError as err:
        if err.value == pynvml.NVML_ERROR_GPU_IS_LOST:
            return False
        if err.value in DRIVER_GONE_ERRORS:
            raise DriverGoneError(str(err)) from err
        if err.value != pynvml.NVML_ERROR_NOT_SUPPORTED:
            raise
    return True
