"""A stateful NVML mock with pynvml's call signatures, return structures and NVMLError codes.

It stands in for the `pynvml` module: code written against pynvml runs unchanged on it. MIG
instances are really created and destroyed, placements, slice budgets and instance limits hold,
and errors are the codes real NVML returns (INSUFFICIENT_RESOURCES for a taken placement, IN_USE for
a GPU instance that still has compute instances, NOT_SUPPORTED for MIG calls on a non-MIG GPU).

State lives in memory, or in a JSON file (shared, under a file lock) so that several processes -
the plugin, a restarted plugin, fake system tools - see one GPU, as they would on a real node.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import math
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import pynvml
from pynvml import NVMLError

from driver.nvml import mock_sysfs
from driver.nvml.geometry import (
    COMPUTE_INSTANCE_PROFILE_SLICES,
    COMPUTE_SLICES,
    GEOMETRY_BY_ID,
    GEOMETRY_BY_INDEX,
    memory_slots,
)
from driver.nvml.machine import ARCHITECTURES, MachineProfile
from driver.nvml.usage_profiles import UsageProfile, Use

UUID_NAMESPACE = uuid.UUID("6f1c7a8e-2f43-4d1e-9a51-0b7c1d2e3f40")
FULL_GI_ID = 0  # the 7g instance always gets id 0, as on real GPUs
NO_INSTANCE = 0xFFFFFFFF  # an event's GPU/compute instance id when it concerns the whole GPU
MAX_EVENTS_KEPT = 256  # injected events kept in the state for event sets that have not read them
EVENT_POLL_S = 0.02
# Load: nothing runs on a mock GPU, so it simulates a steady load for what NVML can see of fgpu's
# work, deterministically: an MPS server (its shares' clients busy) and the framebuffer a MIG
# instance reserves once created (real GPUs report ~13 MiB used on an idle 1g instance).
SIMULATED_MPS_GPU_PERCENT = 40
SIMULATED_MPS_MEMORY_PERCENT = 15
SIMULATED_MPS_SERVER_MIB = 512
SIMULATED_MIG_RESERVED_MIB = 13
T = TypeVar("T")


@dataclass(frozen=True)
class MockDevice:
    index: int


@dataclass(frozen=True)
class MockGpuInstance:
    gpu: int
    gi_id: int


@dataclass(frozen=True)
class MockComputeInstance:
    gpu: int
    gi_id: int
    ci_id: int


@dataclass(frozen=True)
class MockMigDevice:
    gpu: int
    gi_id: int
    ci_id: int


@dataclass(frozen=True)
class MockEventData:
    """What nvmlEventSetWait_v2 returns: c_nvmlEventData_t's fields, with a mock device handle."""

    device: MockDevice
    eventType: int
    eventData: int
    gpuInstanceId: int
    computeInstanceId: int


@dataclass
class MockEventSet:
    registered: dict[int, int] = field(default_factory=dict)  # GPU index -> event type mask
    seen: int = 0  # the serial of the last event this set returned or skipped


@dataclass
class ComputeInstanceState:
    profile_id: int
    serial: int  # makes the MIG UUID change when an instance is re-created, as on real GPUs


@dataclass
class GpuInstanceState:
    profile_id: int
    start: int
    size: int
    compute_instances: dict[int, ComputeInstanceState] = field(default_factory=dict)


@dataclass
class MockProcess:
    """A compute process a test says runs on the GPU (`set_process`): on the GPU itself, or on the
    MIG device of GPU instance gi_id / compute instance ci_id; its SM utilisation in percent.

    With a usage profile, NVML reports the profile's use at the time since `started` (wall clock,
    set by `set_process` when None) times `time_scale` (86400: a day a second) in place of
    sm_percent and memory_mib."""

    pid: int
    sm_percent: int = 0
    memory_mib: int = 0
    gi_id: int | None = None
    ci_id: int = 0
    profile: UsageProfile | None = None
    started: float | None = None
    time_scale: float = 1.0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> MockProcess:
        profile = raw.get("profile")
        return cls(**{**raw, "profile": UsageProfile(**profile) if profile else None})

    def use(self, now: float) -> Use:
        """What it uses at wall time `now`: its profile's value, else what it was set to."""
        if self.profile is None:
            return Use(self.memory_mib, self.sm_percent)
        started = now if self.started is None else self.started
        return self.profile.at(max(0.0, (now - started) * self.time_scale), self.pid)

    def valid(self) -> bool:
        return (
            0 <= self.sm_percent <= 100
            and self.memory_mib >= 0
            and 0 < self.time_scale < math.inf
            and (self.profile is None or self.profile.valid())
        )


@dataclass
class GpuState:
    mig_current: int = 0
    mig_pending: int = 0
    compute_mode: int = pynvml.NVML_COMPUTEMODE_DEFAULT
    gpu_instances: dict[int, GpuInstanceState] = field(default_factory=dict)
    lost: bool = False  # fallen off the bus: every call on it fails with GPU_IS_LOST
    ecc_uncorrected: int = 0  # volatile double-bit ECC errors since the last reset
    utilization_percent: int | None = None  # set by a test (`set_utilization`); None: the simulated load
    processes: list[MockProcess] = field(default_factory=list)


@dataclass
class MockEvent:
    """An NVML event as injected (see `inject_xid` and friends), numbered in order."""

    serial: int
    gpu: int
    event_type: int
    data: int = 0
    gi_id: int = NO_INSTANCE
    ci_id: int = NO_INSTANCE


@dataclass
class MachineState:
    gpus: list[GpuState]
    serial: int = 0
    events: list[MockEvent] = field(default_factory=list)
    driver_loaded: bool = True
    driver_generation: int = 0  # counts loads: a session opened under an earlier one is stale
    driver_version: str = ""  # after an upgrade (`load_driver`); "": the machine profile's

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> MachineState:
        raw = json.loads(text)
        gpus = []
        for gpu in raw["gpus"]:
            instances = {}
            for gi_id, gi in gpu["gpu_instances"].items():
                cis = {int(k): ComputeInstanceState(**v) for k, v in gi.pop("compute_instances").items()}
                instances[int(gi_id)] = GpuInstanceState(**gi, compute_instances=cis)
            gpu["gpu_instances"] = instances
            gpu["processes"] = [MockProcess.from_dict(process) for process in gpu.get("processes", [])]
            gpus.append(GpuState(**gpu))
        events = [MockEvent(**event) for event in raw.get("events", [])]
        driver = {key: raw[key] for key in ("driver_loaded", "driver_generation", "driver_version") if key in raw}
        return cls(gpus=gpus, serial=raw["serial"], events=events, **driver)


def _fail(code: int) -> NVMLError:
    return NVMLError(code)


def _clear_volatile(gpu: GpuState) -> None:
    gpu.gpu_instances.clear()
    gpu.compute_mode = pynvml.NVML_COMPUTEMODE_DEFAULT
    gpu.mig_current, gpu.lost, gpu.ecc_uncorrected = gpu.mig_pending, False, 0


def _clear_all_volatile(machine: MachineState) -> None:
    for gpu in machine.gpus:
        gpu.processes.clear()
        _clear_volatile(gpu)


def _on_mig(gpu: GpuState, mig: MockMigDevice) -> list[MockProcess]:
    return [p for p in gpu.processes if (p.gi_id, p.ci_id) == (mig.gi_id, mig.ci_id)]


def _mps_serving(gpu: GpuState) -> bool:
    """The MPS partitioner puts a GPU in exclusive-process mode while its daemon serves shares."""
    return gpu.compute_mode == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS


class MockNvml:
    """The subset of the pynvml module fgpu uses, over a mock machine."""

    NVMLError = NVMLError

    def __init__(
        self, machine: MachineProfile, state_file: Path | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.machine = machine
        self._state_file = state_file
        self._clock = clock  # wall time: when profiled processes start, what NVML reports at a call
        self._gpm = _GpmState()
        self._lock = threading.RLock()
        self._initialized = 0
        self._generation = 0  # the driver load this process's NVML was initialised under
        self._state = MachineState(gpus=[GpuState() for _ in range(machine.gpu_count)])
        if state_file is not None and not state_file.exists():
            state_file.parent.mkdir(parents=True, exist_ok=True)
            state_file.write_text(self._state.to_json())

    def __getattr__(self, name: str) -> Any:
        # Constants (NVML_*) and structure types come from pynvml itself.
        if name.startswith(("NVML_", "c_nvml", "nvmlPciInfo")):
            return getattr(pynvml, name)
        raise AttributeError(f"NVML mock does not implement {name}")

    # --- state handling -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _machine(self, write: bool = False) -> Iterator[MachineState]:
        """The machine's state for an NVML call: UNINITIALIZED before nvmlInit and, once the driver
        was unloaded and loaded again, for a process initialised under the earlier load (its NVML
        state and handles belong to a driver that is gone); DRIVER_NOT_LOADED while none is loaded."""
        with self._stored(write) as machine:
            if self._initialized == 0:
                raise _fail(pynvml.NVML_ERROR_UNINITIALIZED)
            if not machine.driver_loaded:
                raise _fail(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
            if machine.driver_generation != self._generation:
                raise _fail(pynvml.NVML_ERROR_UNINITIALIZED)
            yield machine

    @contextlib.contextmanager
    def _stored(self, write: bool = False) -> Iterator[MachineState]:
        with self._lock:
            if self._state_file is None:
                yield self._state
                return
            with open(self._state_file, "r+") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX if write else fcntl.LOCK_SH)
                state = MachineState.from_json(handle.read())
                yield state
                if write:
                    handle.seek(0)
                    handle.truncate()
                    handle.write(state.to_json())
                    handle.flush()
                    os.fsync(handle.fileno())

    def _with_gpu(self, device: object, action: Callable[[GpuState], T], write: bool = False) -> T:
        index = self._gpu_index(device)
        with self._machine(write) as machine:
            if machine.gpus[index].lost:
                raise _fail(pynvml.NVML_ERROR_GPU_IS_LOST)
            return action(machine.gpus[index])

    def _attached_index(self, device: object) -> int:
        """The GPU index of a handle, for properties NVML answers without the GPU's state: still
        only while the driver it was initialised under is loaded."""
        with self._machine():
            return self._gpu_index(device)

    def _gpu_index(self, device: object) -> int:
        if isinstance(device, MockDevice | MockMigDevice):
            index = device.index if isinstance(device, MockDevice) else device.gpu
            if 0 <= index < self.machine.gpu_count:
                return index
        raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _gpu_outside_mig(self, device: object) -> GpuState:
        """The GPU's state, for what NVML measures only on a GPU not in MIG mode: NOT_SUPPORTED on
        a MIG device handle and on a GPU in MIG mode."""
        if isinstance(device, MockMigDevice):
            self._gpu_index(device)
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        gpu = self._with_gpu(device, lambda state: state)
        if gpu.mig_current == pynvml.NVML_DEVICE_MIG_ENABLE:
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _require_mig(self, gpu: GpuState) -> None:
        if not self.machine.gpu.mig_capable or gpu.mig_current != pynvml.NVML_DEVICE_MIG_ENABLE:
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)

    # --- library and system ---------------------------------------------------------------------

    def nvmlInit(self) -> None:
        """DRIVER_NOT_LOADED without a loaded driver; the first init attaches to the loaded one."""
        with self._stored() as machine:
            if not machine.driver_loaded:
                raise _fail(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
            if self._initialized == 0:
                self._generation = machine.driver_generation
            self._initialized += 1

    def nvmlShutdown(self) -> None:
        with self._lock:
            if self._initialized == 0:
                raise _fail(pynvml.NVML_ERROR_UNINITIALIZED)
            self._initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        with self._machine() as machine:
            return machine.driver_version or self.machine.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        with self._machine():
            return self.machine.cuda_driver_version

    def nvmlDeviceGetCount(self) -> int:
        with self._machine():
            return self.machine.gpu_count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> MockDevice:
        with self._machine():
            if not 0 <= index < self.machine.gpu_count:
                raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            return MockDevice(index)

    # --- device properties ----------------------------------------------------------------------

    def gpu_uuid(self, index: int) -> str:
        return f"GPU-{uuid.uuid5(UUID_NAMESPACE, f'{self.machine.name}/{index}')}"

    def nvmlDeviceGetUUID(self, device: object) -> str:
        if isinstance(device, MockMigDevice):
            return self._with_gpu(device, lambda gpu: self._mig_uuid(device, gpu))
        return self.gpu_uuid(self._attached_index(device))

    def _mig_uuid(self, mig: MockMigDevice, gpu: GpuState) -> str:
        instance = gpu.gpu_instances.get(mig.gi_id)
        if instance is None or mig.ci_id not in instance.compute_instances:
            raise _fail(pynvml.NVML_ERROR_NOT_FOUND)
        serial = instance.compute_instances[mig.ci_id].serial
        key = f"{self.gpu_uuid(mig.gpu)}/{mig.gi_id}/{mig.ci_id}/{serial}"
        return f"MIG-{uuid.uuid5(UUID_NAMESPACE, key)}"

    def nvmlDeviceGetName(self, device: object) -> str:
        self._attached_index(device)
        return self.machine.gpu.product_name

    def nvmlDeviceGetIndex(self, device: object) -> int:
        return self._attached_index(device)

    def nvmlDeviceGetMinorNumber(self, device: object) -> int:
        return self._attached_index(device)

    def nvmlDeviceGetPciInfo(self, device: object) -> pynvml.nvmlPciInfo_t:
        index = self._attached_index(device)
        bus = self.machine.pci_bus(index)
        info = pynvml.nvmlPciInfo_t()
        bus_id = f"00000000:{bus:02X}:00.0".encode()
        info.busId = bus_id
        info.busIdLegacy = bus_id
        info.domain, info.bus, info.device = 0, bus, 0
        info.pciDeviceId = (self.machine.gpu.pci_device_id << 16) | 0x10DE
        return info

    def nvmlDeviceGetMemoryInfo(self, device: object, version: int | None = None) -> pynvml.c_nvmlMemory_t:
        """A MIG device handle reports its instance's memory, as NVML does; used memory follows the
        simulated load (see SIMULATED_*) and the processes' use now, up to the total (a process
        cannot hold more than the device has)."""
        index = self._gpu_index(device)
        now = self._clock()
        with self._machine() as machine:
            gpu = machine.gpus[index]
            if isinstance(device, MockMigDevice):
                total_mib = self._mig_spec_of(gpu, device.gi_id).memory_mib
                used_mib = SIMULATED_MIG_RESERVED_MIB + sum(p.use(now).memory_mib for p in _on_mig(gpu, device))
            else:
                total_mib = self.machine.gpu.memory_mib
                used_mib = SIMULATED_MIG_RESERVED_MIB * sum(
                    len(gi.compute_instances) for gi in gpu.gpu_instances.values()
                )
                used_mib += SIMULATED_MPS_SERVER_MIB if _mps_serving(gpu) else 0
                used_mib += sum(p.use(now).memory_mib for p in gpu.processes)
        memory = pynvml.c_nvmlMemory_t()
        memory.total = total_mib * 1024 * 1024
        memory.used = min(used_mib, total_mib) * 1024 * 1024
        memory.free = memory.total - memory.used
        return memory

    def nvmlDeviceGetUtilizationRates(self, device: object) -> pynvml.c_nvmlUtilization_t:
        """NOT_SUPPORTED on a MIG device handle and on a GPU in MIG mode, as NVML documents it."""
        gpu = self._gpu_outside_mig(device)
        utilization = pynvml.c_nvmlUtilization_t()
        serving = _mps_serving(gpu)
        simulated = SIMULATED_MPS_GPU_PERCENT if serving else 0
        utilization.gpu = simulated if gpu.utilization_percent is None else gpu.utilization_percent
        utilization.memory = SIMULATED_MPS_MEMORY_PERCENT if serving else 0
        return utilization

    def nvmlDeviceGetComputeRunningProcesses(self, device: object) -> list[pynvml.nvmlFriendlyObject]:
        """The compute processes on a GPU (all of them, with their instance ids, in MIG mode) or on
        a MIG device (its own), as pynvml returns them."""
        index = self._gpu_index(device)
        now = self._clock()
        with self._machine() as machine:
            gpu = machine.gpus[index]
            if gpu.lost:
                raise _fail(pynvml.NVML_ERROR_GPU_IS_LOST)
            if isinstance(device, MockMigDevice):
                self._mig_spec_of(gpu, device.gi_id)
                processes = _on_mig(gpu, device)
            else:
                processes = list(gpu.processes)
        infos = []
        for process in processes:
            info = pynvml.c_nvmlProcessInfo_v3_t()
            info.pid, info.usedGpuMemory = process.pid, process.use(now).memory_mib * 1024 * 1024
            info.gpuInstanceId = NO_INSTANCE if process.gi_id is None else process.gi_id
            info.computeInstanceId = NO_INSTANCE if process.gi_id is None else process.ci_id
            infos.append(pynvml.nvmlStructToFriendlyObject(info))
        return infos

    def nvmlDeviceGetProcessUtilization(
        self, device: object, timeStamp: int
    ) -> list[pynvml.c_nvmlProcessUtilizationSample_t]:
        """One sample per process on the GPU, now; NOT_FOUND when there is none, NOT_SUPPORTED on
        MIG devices and GPUs in MIG mode (NVML samples no processes there)."""
        gpu = self._gpu_outside_mig(device)
        now = self._clock()
        now_us = int(now * 1_000_000)
        if not gpu.processes or now_us <= timeStamp:
            raise _fail(pynvml.NVML_ERROR_NOT_FOUND)
        samples = []
        for process in gpu.processes:
            sample = pynvml.c_nvmlProcessUtilizationSample_t()
            sm_percent = min(100, round(process.use(now).compute))  # NVML's is a whole percent
            sample.pid, sample.timeStamp, sample.smUtil = process.pid, now_us, sm_percent
            samples.append(sample)
        return samples

    def nvmlDeviceGetCudaComputeCapability(self, device: object) -> tuple[int, int]:
        self._attached_index(device)
        return self.machine.gpu.cuda_compute_capability

    def nvmlDeviceGetArchitecture(self, device: object) -> int:
        self._attached_index(device)
        return ARCHITECTURES[self.machine.gpu.architecture]

    def nvmlDeviceGetAttributes(self, device: object) -> pynvml.c_nvmlDeviceAttributes:
        index = self._attached_index(device)
        attributes = pynvml.c_nvmlDeviceAttributes()
        if isinstance(device, MockMigDevice):
            with self._machine() as machine:
                spec = self._mig_spec_of(machine.gpus[index], device.gi_id)
            attributes.multiprocessorCount = spec.multiprocessors
            attributes.memorySizeMB = spec.memory_mib
            return attributes
        attributes.multiprocessorCount = self.machine.gpu.multiprocessors
        attributes.memorySizeMB = self.machine.gpu.memory_mib
        attributes.gpuInstanceSliceCount = COMPUTE_SLICES if self.machine.gpu.mig_capable else 0
        attributes.computeInstanceSliceCount = attributes.gpuInstanceSliceCount
        return attributes

    def nvmlDeviceGetComputeMode(self, device: object) -> int:
        return self._with_gpu(device, lambda gpu: gpu.compute_mode)

    def nvmlDeviceSetComputeMode(self, device: object, mode: int) -> None:
        if mode not in (pynvml.NVML_COMPUTEMODE_DEFAULT, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS, 2):
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)

        def apply(gpu: GpuState) -> None:
            gpu.compute_mode = mode

        self._with_gpu(device, apply, write=True)

    # --- MIG mode -------------------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, device: object) -> list[int]:
        if not self.machine.gpu.mig_capable:
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self._with_gpu(device, lambda gpu: [gpu.mig_current, gpu.mig_pending])

    def nvmlDeviceSetMigMode(self, device: object, mode: int) -> int:
        """Returns the activation status: SUCCESS, or RESET_REQUIRED where the change stays pending."""
        if not self.machine.gpu.mig_capable:
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if mode not in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE):
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)

        def apply(gpu: GpuState) -> int:
            if gpu.gpu_instances:
                raise _fail(pynvml.NVML_ERROR_IN_USE)
            gpu.mig_pending = mode
            if not self.machine.gpu.mig_toggle_without_reset:
                return pynvml.NVML_ERROR_RESET_REQUIRED
            gpu.mig_current = mode
            return pynvml.NVML_SUCCESS

        return self._with_gpu(device, apply, write=True)

    # --- GPU instances --------------------------------------------------------------------------

    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, device: object, profile: int, version: int = 2
    ) -> pynvml.c_nvmlGpuInstanceProfileInfo_v2_t:
        geometry = GEOMETRY_BY_INDEX.get(profile)
        self._with_gpu(device, self._require_mig)
        if geometry is None or geometry.profile_id not in self.machine.gpu.mig_profiles:
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        spec = self.machine.gpu.mig_profiles[geometry.profile_id]
        info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
        info.id = geometry.profile_id
        info.isP2pSupported = 0
        info.sliceCount = geometry.compute_slices
        info.instanceCount = geometry.max_instances
        info.multiprocessorCount = spec.multiprocessors
        info.copyEngineCount = spec.copy_engines
        info.decoderCount = spec.decoders
        info.encoderCount = spec.encoders
        info.jpegCount = spec.jpeg_engines
        info.ofaCount = spec.ofa_engines
        info.memorySizeMB = spec.memory_mib
        info.name = f"MIG {spec.name}".encode()
        return info

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, device: object, profileId: int, placementsRef: Any, countRef: Any
    ) -> int:
        """Two-call protocol as in NVML: a null placementsRef asks for the count only."""
        self._with_gpu(device, self._require_mig)
        geometry = self._geometry(profileId)
        count = ctypes.cast(countRef, ctypes.POINTER(ctypes.c_uint)).contents
        if placementsRef is None:
            count.value = len(geometry.starts)
            return pynvml.NVML_SUCCESS
        if count.value < len(geometry.starts):
            count.value = len(geometry.starts)
            raise _fail(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        array = ctypes.cast(placementsRef, ctypes.POINTER(pynvml.c_nvmlGpuInstancePlacement_t))
        for i, start in enumerate(geometry.starts):
            array[i].start = start
            array[i].size = geometry.memory_slices
        count.value = len(geometry.starts)
        return pynvml.NVML_SUCCESS

    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, device: object, profileId: int, placement: pynvml.c_nvmlGpuInstancePlacement_t
    ) -> MockGpuInstance:
        index = self._gpu_index(device)
        with self._machine(write=True) as machine:
            gpu = machine.gpus[index]
            self._require_mig(gpu)
            geometry = self._geometry(profileId)
            if placement.start not in geometry.starts or placement.size != geometry.memory_slices:
                raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            gi_id = self._create_gpu_instance(gpu, profileId, placement.start)
        return MockGpuInstance(index, gi_id)

    def nvmlDeviceCreateGpuInstance(self, device: object, profileId: int) -> MockGpuInstance:
        """Lets the driver choose the placement: small profiles fill from the top, as NVIDIA's does,
        which is why creation order matters (19,19,14,9 fails where 9 first succeeds)."""
        index = self._gpu_index(device)
        with self._machine(write=True) as machine:
            gpu = machine.gpus[index]
            self._require_mig(gpu)
            geometry = self._geometry(profileId)
            for start in sorted(geometry.starts, reverse=True):
                if self._placement_free(gpu, start, geometry.memory_slices):
                    return MockGpuInstance(index, self._create_gpu_instance(gpu, profileId, start))
        raise _fail(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)

    def _geometry(self, profile_id: int):
        geometry = GEOMETRY_BY_ID.get(profile_id)
        if geometry is None or profile_id not in self.machine.gpu.mig_profiles:
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return geometry

    @staticmethod
    def _placement_free(gpu: GpuState, start: int, size: int) -> bool:
        wanted = memory_slots(start, size)
        return all(not wanted & memory_slots(gi.start, gi.size) for gi in gpu.gpu_instances.values())

    def _create_gpu_instance(self, gpu: GpuState, profile_id: int, start: int) -> int:
        geometry = GEOMETRY_BY_ID[profile_id]
        same_profile = sum(1 for gi in gpu.gpu_instances.values() if gi.profile_id == profile_id)
        compute_used = sum(GEOMETRY_BY_ID[gi.profile_id].compute_slices for gi in gpu.gpu_instances.values())
        media_taken = geometry.media_extensions and any(
            GEOMETRY_BY_ID[gi.profile_id].media_extensions for gi in gpu.gpu_instances.values()
        )
        if (
            same_profile >= geometry.max_instances
            or compute_used + geometry.compute_slices > COMPUTE_SLICES
            or media_taken
            or not self._placement_free(gpu, start, geometry.memory_slices)
        ):
            raise _fail(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        gi_id = FULL_GI_ID if geometry.compute_slices == COMPUTE_SLICES else self._free_id(gpu.gpu_instances, 1)
        gpu.gpu_instances[gi_id] = GpuInstanceState(profile_id, start, geometry.memory_slices)
        return gi_id

    @staticmethod
    def _free_id(taken: dict[int, Any], first: int) -> int:
        candidate = first
        while candidate in taken:
            candidate += 1
        return candidate

    def _gpu_instance(self, machine: MachineState, handle: object) -> GpuInstanceState:
        if not isinstance(handle, MockGpuInstance | MockComputeInstance):
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        instance = machine.gpus[handle.gpu].gpu_instances.get(handle.gi_id)
        if instance is None:
            raise _fail(pynvml.NVML_ERROR_NOT_FOUND)
        return instance

    def nvmlDeviceGetGpuInstanceById(self, device: object, gpuInstanceId: int) -> MockGpuInstance:
        index = self._gpu_index(device)
        with self._machine() as machine:
            self._require_mig(machine.gpus[index])
            if gpuInstanceId not in machine.gpus[index].gpu_instances:
                raise _fail(pynvml.NVML_ERROR_NOT_FOUND)
        return MockGpuInstance(index, gpuInstanceId)

    def nvmlGpuInstanceGetInfo(self, gpuInstance: object) -> pynvml.c_nvmlGpuInstanceInfo_t:
        with self._machine() as machine:
            instance = self._gpu_instance(machine, gpuInstance)
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.id = gpuInstance.gi_id  # type: ignore[attr-defined]
        info.profileId = instance.profile_id
        info.placement.start = instance.start
        info.placement.size = instance.size
        return info

    def nvmlGpuInstanceDestroy(self, gpuInstance: object) -> int:
        with self._machine(write=True) as machine:
            instance = self._gpu_instance(machine, gpuInstance)
            if instance.compute_instances:
                raise _fail(pynvml.NVML_ERROR_IN_USE)
            del machine.gpus[gpuInstance.gpu].gpu_instances[gpuInstance.gi_id]  # type: ignore[attr-defined]
        return pynvml.NVML_SUCCESS

    # --- compute instances ----------------------------------------------------------------------

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device: object, profile: int, engProfile: int, version: int = 2
    ) -> pynvml.c_nvmlComputeInstanceProfileInfo_v2_t:
        with self._machine() as machine:
            instance = self._gpu_instance(machine, device)
        slices = COMPUTE_INSTANCE_PROFILE_SLICES.get(profile)
        gi_slices = GEOMETRY_BY_ID[instance.profile_id].compute_slices
        if slices is None or slices > gi_slices or engProfile != 0:
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        spec = self.machine.gpu.mig_profiles[instance.profile_id]
        info = pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
        info.id = profile
        info.sliceCount = slices
        info.instanceCount = gi_slices // slices
        info.multiprocessorCount = spec.multiprocessors * slices // gi_slices
        info.sharedCopyEngineCount = spec.copy_engines
        info.sharedDecoderCount = spec.decoders
        info.sharedEncoderCount = spec.encoders
        info.sharedJpegCount = spec.jpeg_engines
        info.sharedOfaCount = spec.ofa_engines
        info.name = f"{slices}c.{spec.name}".encode()
        return info

    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: object, profileId: int) -> MockComputeInstance:
        slices = COMPUTE_INSTANCE_PROFILE_SLICES.get(profileId)
        with self._machine(write=True) as machine:
            instance = self._gpu_instance(machine, gpuInstance)
            gi_slices = GEOMETRY_BY_ID[instance.profile_id].compute_slices
            if slices is None or slices > gi_slices:
                raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
            used = sum(COMPUTE_INSTANCE_PROFILE_SLICES[ci.profile_id] for ci in instance.compute_instances.values())
            if used + slices > gi_slices:
                raise _fail(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            ci_id = self._free_id(instance.compute_instances, 0)
            machine.serial += 1
            instance.compute_instances[ci_id] = ComputeInstanceState(profileId, machine.serial)
        return MockComputeInstance(gpuInstance.gpu, gpuInstance.gi_id, ci_id)  # type: ignore[attr-defined]

    def nvmlGpuInstanceGetComputeInstanceById(self, gpuInstance: object, computeInstanceId: int) -> MockComputeInstance:
        with self._machine() as machine:
            instance = self._gpu_instance(machine, gpuInstance)
            if computeInstanceId not in instance.compute_instances:
                raise _fail(pynvml.NVML_ERROR_NOT_FOUND)
        return MockComputeInstance(gpuInstance.gpu, gpuInstance.gi_id, computeInstanceId)  # type: ignore[attr-defined]

    def nvmlComputeInstanceDestroy(self, computeInstance: object) -> int:
        if not isinstance(computeInstance, MockComputeInstance):
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._machine(write=True) as machine:
            instance = self._gpu_instance(machine, computeInstance)
            if instance.compute_instances.pop(computeInstance.ci_id, None) is None:
                raise _fail(pynvml.NVML_ERROR_NOT_FOUND)
        return pynvml.NVML_SUCCESS

    # --- MIG devices ----------------------------------------------------------------------------

    def nvmlDeviceGetMaxMigDeviceCount(self, device: object) -> int:
        self._attached_index(device)
        return COMPUTE_SLICES if self.machine.gpu.mig_capable else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: object, index: int) -> MockMigDevice:
        gpu_index = self._gpu_index(device)
        with self._machine() as machine:
            gpu = machine.gpus[gpu_index]
            self._require_mig(gpu)
            devices = [
                MockMigDevice(gpu_index, gi_id, ci_id)
                for gi_id, gi in sorted(gpu.gpu_instances.items())
                for ci_id in sorted(gi.compute_instances)
            ]
        if not 0 <= index < len(devices):
            raise _fail(pynvml.NVML_ERROR_NOT_FOUND)
        return devices[index]

    def nvmlDeviceIsMigDeviceHandle(self, device: object) -> bool:
        return isinstance(device, MockMigDevice)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: object) -> MockDevice:
        if not isinstance(migDevice, MockMigDevice):
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return MockDevice(migDevice.gpu)

    def nvmlDeviceGetGpuInstanceId(self, device: object) -> int:
        if not isinstance(device, MockMigDevice):
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return device.gi_id

    def nvmlDeviceGetComputeInstanceId(self, device: object) -> int:
        if not isinstance(device, MockMigDevice):
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return device.ci_id

    def _mig_spec_of(self, gpu: GpuState, gi_id: int):
        instance = gpu.gpu_instances.get(gi_id)
        if instance is None:
            raise _fail(pynvml.NVML_ERROR_NOT_FOUND)
        return self.machine.gpu.mig_profiles[instance.profile_id]

    # --- events and health (XIDs, ECC, a GPU off the bus) -----------------------------------------

    SUPPORTED_EVENTS = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError

    def nvmlDeviceGetTotalEccErrors(self, device: object, errorType: int, counterType: int) -> int:
        if errorType != pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED or counterType != pynvml.NVML_VOLATILE_ECC:
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)  # the mock counts volatile double-bit errors only
        return self._with_gpu(device, lambda gpu: gpu.ecc_uncorrected)

    def nvmlDeviceGetSupportedEventTypes(self, device: object) -> int:
        return self._with_gpu(device, lambda gpu: self.SUPPORTED_EVENTS)

    def nvmlEventSetCreate(self) -> MockEventSet:
        with self._machine() as machine:
            return MockEventSet(seen=machine.events[-1].serial if machine.events else 0)

    def nvmlDeviceRegisterEvents(self, device: object, eventTypes: int, eventSet: object) -> None:
        if not isinstance(eventSet, MockEventSet):
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if eventTypes & ~self.SUPPORTED_EVENTS:
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        index = self._gpu_index(device)
        self._with_gpu(device, lambda gpu: None)  # a lost GPU cannot register
        eventSet.registered[index] = eventSet.registered.get(index, 0) | eventTypes

    def nvmlEventSetWait_v2(self, eventSet: object, timeoutms: int) -> MockEventData:
        """The next event for a registered GPU and type; TIMEOUT when none comes in time;
        GPU_IS_LOST while a registered GPU is lost and nothing else is pending."""
        if not isinstance(eventSet, MockEventSet):
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        deadline = time.monotonic() + timeoutms / 1000
        while True:
            with self._machine() as machine:
                for event in machine.events:
                    if event.serial <= eventSet.seen:
                        continue
                    eventSet.seen = event.serial
                    if eventSet.registered.get(event.gpu, 0) & event.event_type:
                        return MockEventData(
                            MockDevice(event.gpu), event.event_type, event.data, event.gi_id, event.ci_id
                        )
                if any(machine.gpus[index].lost for index in eventSet.registered):
                    raise _fail(pynvml.NVML_ERROR_GPU_IS_LOST)
            if time.monotonic() >= deadline:
                raise _fail(pynvml.NVML_ERROR_TIMEOUT)
            time.sleep(EVENT_POLL_S)

    def nvmlEventSetFree(self, eventSet: object) -> None:
        if not isinstance(eventSet, MockEventSet):
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        eventSet.registered.clear()

    # Not NVML: the machine around the GPUs, and how a test or a person changes it: fail a GPU
    # (`fgpu mock fault`, docs/health.md), reset one.

    def inject_xid(self, gpu: int, xid: int, gi_id: int = NO_INSTANCE, ci_id: int = NO_INSTANCE) -> None:
        self._inject(gpu, pynvml.nvmlEventTypeXidCriticalError, xid, gi_id, ci_id)

    def inject_double_bit_ecc(self, gpu: int) -> None:
        def count(state: GpuState) -> None:
            state.ecc_uncorrected += 1

        self._with_gpu(MockDevice(gpu), count, write=True)
        self._inject(gpu, pynvml.nvmlEventTypeDoubleBitEccError, 0, NO_INSTANCE, NO_INSTANCE)

    @contextlib.contextmanager
    def sysfs_root(self) -> Iterator[Path]:
        """The machine's /sys, as far as its GPUs' PCI topology goes (mock_sysfs), laid out in a
        temporary directory while it is read: a process killed later leaves nothing behind."""
        with tempfile.TemporaryDirectory(prefix="fgpu-mock-sysfs-") as root:
            mock_sysfs.lay_out(Path(root), self.machine)
            yield Path(root)

    def reset_gpu(self, gpu: int) -> None:
        """What `nvidia-smi -r` (or the driver's recovery after an XID 79) does to a GPU no process
        uses: its volatile state is gone. MIG GPU and compute instances are destroyed (NVIDIA's MIG
        user guide: they do not persist across a GPU reset or reboot; a re-created one gets a new
        MIG UUID), the compute mode is DEFAULT again, a pending MIG mode takes effect (the mode
        itself persists), volatile ECC counters start over, a GPU that fell off the bus is back."""
        index = self._gpu_index(MockDevice(gpu))
        with self._machine(write=True) as machine:
            if machine.gpus[index].processes:  # nvidia-smi -r refuses a GPU that processes use
                raise _fail(pynvml.NVML_ERROR_IN_USE)
            _clear_volatile(machine.gpus[index])

    def reboot(self) -> None:
        """What a reboot leaves of every GPU: what a reset leaves of each, with the driver loaded."""
        with self._stored(write=True) as machine:
            machine.driver_loaded = True
            _clear_all_volatile(machine)

    def unload_driver(self) -> None:
        """`rmmod nvidia` (a driver container's upgrade or restart): IN_USE while a compute process
        runs on a GPU (the module is in use). Every GPU's volatile state goes with the driver (a
        reload starts them as a reboot does); NVML calls fail with DRIVER_NOT_LOADED meanwhile."""
        with self._stored(write=True) as machine:
            if not machine.driver_loaded:
                return
            if any(gpu.processes for gpu in machine.gpus):
                raise _fail(pynvml.NVML_ERROR_IN_USE)
            machine.driver_loaded = False
            _clear_all_volatile(machine)

    def load_driver(self, version: str = "") -> None:
        """The driver loaded again (`version`: an upgrade's, else the one before): processes that
        had NVML initialised must initialise it again (their calls fail with UNINITIALIZED)."""
        with self._stored(write=True) as machine:
            if machine.driver_loaded:
                return
            machine.driver_loaded = True
            machine.driver_generation += 1
            machine.driver_version = version or machine.driver_version

    def set_utilization(self, gpu: int, percent: int | None) -> None:
        """The GPU's utilisation as NVML will report it (None: the simulated load again)."""
        if percent is not None and not 0 <= percent <= 100:
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._with_gpu(MockDevice(gpu), lambda state: setattr(state, "utilization_percent", percent), write=True)

    def set_process(self, gpu: int, process: MockProcess) -> None:
        """A compute process runs on the GPU, or on one of its MIG devices (replacing one of the same
        pid): NOT_FOUND for a MIG device that does not exist; a profiled one starts now unless it
        says when."""
        if not process.valid():
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if process.profile is not None and process.started is None:
            process = replace(process, started=self._clock())

        def run(state: GpuState) -> None:
            if process.gi_id is not None:
                instance = state.gpu_instances.get(process.gi_id)
                if instance is None or process.ci_id not in instance.compute_instances:
                    raise _fail(pynvml.NVML_ERROR_NOT_FOUND)
            state.processes = [p for p in state.processes if p.pid != process.pid] + [process]

        self._with_gpu(MockDevice(gpu), run, write=True)

    def end_process(self, gpu: int, pid: int) -> None:
        def end(state: GpuState) -> None:
            state.processes = [p for p in state.processes if p.pid != pid]

        self._with_gpu(MockDevice(gpu), end, write=True)

    def set_gpu_lost(self, gpu: int, lost: bool) -> None:
        """Off the bus (every call on it fails), or back, as after a successful reset."""
        index = self._gpu_index(MockDevice(gpu))
        with self._machine(write=True) as machine:
            machine.gpus[index].lost = lost
            if not lost:
                machine.gpus[index].ecc_uncorrected = 0  # volatile counters start over with a reset

    def _inject(self, gpu: int, event_type: int, data: int, gi_id: int, ci_id: int) -> None:
        index = self._gpu_index(MockDevice(gpu))
        with self._machine(write=True) as machine:
            serial = (machine.events[-1].serial if machine.events else 0) + 1
            machine.events.append(MockEvent(serial, index, event_type, data, gi_id, ci_id))
            del machine.events[:-MAX_EVENTS_KEPT]

    # --- GPM: GPU Performance Monitoring (Hopper and newer) ----------------------------------------
    # A sample holds counters that only grow, of the whole GPU or of one GPU instance: the SM-seconds
    # busy and the seconds with a process computing; a metric is their change between two samples
    # over the time between them. The mock advances a GPU's counters at each of its samples by the
    # load of its processes then (a process's compute is percent of the whole GPU's SMs, up to its
    # compute instance's), held since the GPU's sample before: exact for steady processes, and a
    # change between two samples counts from the earlier one.

    GPM_FIRST_ARCHITECTURE = ARCHITECTURES["hopper"]

    def nvmlGpmQueryDeviceSupport(self, device: object) -> pynvml.c_nvmlGpmSupport_t:
        """isSupportedDevice 1 on Hopper and newer, 0 before: NVML answers rather than fails."""
        index = self._gpm_gpu(device)
        self._with_gpu(MockDevice(index), lambda gpu: None)  # a lost GPU answers GPU_IS_LOST
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = int(self._gpm_supported())
        return support

    def nvmlGpmSampleAlloc(self) -> Any:
        """A sample buffer: pynvml's c_nvmlGpmSample_t (a pointer), so that it fits the fields of
        c_nvmlGpmMetricsGet_t as a real one does."""
        with self._machine():
            target = pynvml.struct_c_nvmlGpmSample_t()
            self._gpm.buffers[ctypes.addressof(target)] = _GpmBuffer(target)
        return ctypes.pointer(target)

    def nvmlGpmSampleFree(self, gpmSample: object) -> None:
        with self._lock:
            del self._gpm.buffers[self._gpm_address(gpmSample)]

    def nvmlGpmSampleGet(self, device: object, gpmSample: object) -> Any:
        """A sample of the whole GPU, in MIG mode too: NOT_SUPPORTED before Hopper."""
        self._gpm_take(device, None, gpmSample)
        return gpmSample

    def nvmlGpmMigSampleGet(self, device: object, gpuInstanceId: int, gpmSample: object) -> Any:
        """A sample of one GPU instance of the GPU: NOT_SUPPORTED before Hopper and outside MIG
        mode, NOT_FOUND for an instance that does not exist."""
        if not isinstance(gpuInstanceId, int) or gpuInstanceId < 0:
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._gpm_take(device, gpuInstanceId, gpmSample)
        return gpmSample

    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        """The first numMetrics metrics asked for, between sample1 and sample2: ARGUMENT_VERSION_MISMATCH
        for a version other than NVML_GPM_METRICS_GET_VERSION; INVALID_ARGUMENT for more metrics
        than the array holds, or samples not taken, of different GPUs or instances, or out of
        order. A metric the mock does not simulate (all but SM_UTIL and GRAPHICS_UTIL) answers
        NOT_SUPPORTED in its own nvmlReturn, as a metric a sample's scope lacks does."""
        if not isinstance(metricsGet, pynvml.c_nvmlGpmMetricsGet_t):
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if metricsGet.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            raise _fail(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        if metricsGet.numMetrics > pynvml.NVML_GPM_METRIC_MAX:
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._machine():
            first, second = self._gpm_reading(metricsGet.sample1), self._gpm_reading(metricsGet.sample2)
        if (first.gpu, first.gi_id) != (second.gpu, second.gi_id) or second.at <= first.at:
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        values = first.metrics_until(second)
        for i in range(metricsGet.numMetrics):
            metric = metricsGet.metrics[i]
            value = values.get(metric.metricId)
            metric.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED if value is None else pynvml.NVML_SUCCESS
            metric.value = math.nan if value is None else value
        return metricsGet

    def _gpm_supported(self) -> bool:
        return ARCHITECTURES[self.machine.gpu.architecture] >= self.GPM_FIRST_ARCHITECTURE

    def _gpm_gpu(self, device: object) -> int:
        """The GPU index of a GPU handle: GPM takes the GPU's (a GPU instance by its id), not a MIG
        device's."""
        if not isinstance(device, MockDevice):
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._gpu_index(device)

    def _gpm_address(self, sample: object) -> int:
        """The address of a sample buffer this mock allocated and has not freed, else INVALID_ARGUMENT."""
        address = ctypes.cast(sample, ctypes.c_void_p).value if isinstance(sample, pynvml.c_nvmlGpmSample_t) else None
        if address is None or address not in self._gpm.buffers:
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return address

    def _gpm_reading(self, sample: object) -> _GpmReading:
        reading = self._gpm.buffers[self._gpm_address(sample)].reading
        if reading is None:  # allocated, never taken
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return reading

    def _gpm_take(self, device: object, gi_id: int | None, sample: object) -> None:
        index = self._gpm_gpu(device)
        now = self._clock()
        with self._machine() as machine:
            buffer = self._gpm.buffers[self._gpm_address(sample)]
            gpu = machine.gpus[index]
            if gpu.lost:
                raise _fail(pynvml.NVML_ERROR_GPU_IS_LOST)
            if not self._gpm_supported():
                raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
            multiprocessors = self.machine.gpu.multiprocessors
            if gi_id is not None:
                self._require_mig(gpu)
                multiprocessors = self._mig_spec_of(gpu, gi_id).multiprocessors  # NOT_FOUND: no such instance
            counters = self._gpm.counters.setdefault(index, _GpmCounters(now))
            counters.advance(now, self._gpm_load(index, gpu, now))
            buffer.reading = _GpmReading(
                index,
                gi_id,
                now,
                multiprocessors,
                counters.sm_busy_s.get(gi_id, 0.0),
                counters.active_s.get(gi_id, 0.0),
            )

    def _gpm_load(self, index: int, gpu: GpuState, now: float) -> dict[int | None, tuple[float, bool]]:
        """By scope (None: the whole GPU; else a GPU instance id): its SMs busy now, and whether a
        process computes on it."""
        gpu_sms = self.machine.gpu.multiprocessors

        def busy(processes: list[MockProcess], sms: float) -> tuple[float, bool]:
            computes = [p.use(now).compute for p in processes]
            return min(sms, sum(computes) / 100 * gpu_sms), any(c > 0 for c in computes)

        load: dict[int | None, tuple[float, bool]] = {}
        for gi_id, instance in gpu.gpu_instances.items():
            spec = self.machine.gpu.mig_profiles[instance.profile_id]
            slices = GEOMETRY_BY_ID[instance.profile_id].compute_slices
            per_ci = [
                busy(
                    _on_mig(gpu, MockMigDevice(index, gi_id, ci_id)),
                    spec.multiprocessors * COMPUTE_INSTANCE_PROFILE_SLICES[ci.profile_id] / slices,
                )
                for ci_id, ci in instance.compute_instances.items()
            ]
            load[gi_id] = (sum(sms for sms, _ in per_ci), any(active for _, active in per_ci))
        outside_sms, outside_active = busy([p for p in gpu.processes if p.gi_id is None], gpu_sms)
        load[None] = (
            outside_sms + sum(sms for sms, _ in load.values()),
            outside_active or any(active for _, active in load.values()),
        )
        return load


@dataclass(frozen=True)
class _GpmReading:
    """What a taken GPM sample holds: the GPU and GPU instance (None: the whole GPU), when (wall
    seconds), the scope's SMs, and its counters then."""

    gpu: int
    gi_id: int | None
    at: float
    multiprocessors: int
    sm_busy_s: float  # SM-seconds busy
    active_s: float  # seconds with a process computing

    def metrics_until(self, later: _GpmReading) -> dict[int, float]:
        """The metrics the mock simulates, in percent, between this sample and a later one."""
        elapsed = later.at - self.at
        sm_util = 100 * (later.sm_busy_s - self.sm_busy_s) / (self.multiprocessors * elapsed)
        graphics_util = 100 * (later.active_s - self.active_s) / elapsed
        return {  # capped: float sums may pass 100 by a rounding error
            pynvml.NVML_GPM_METRIC_SM_UTIL: min(100.0, sm_util),
            pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: min(100.0, graphics_util),
        }


@dataclass
class _GpmBuffer:
    """A sample buffer from nvmlGpmSampleAlloc: the ctypes object its pointer points to (kept alive
    while allocated: its address names it) and, once taken, its reading."""

    target: Any
    reading: _GpmReading | None = None


@dataclass
class _GpmCounters:
    """One GPU's GPM counters by scope (None: the whole GPU; else a GPU instance id), advanced to `at`."""

    at: float
    sm_busy_s: dict[int | None, float] = field(default_factory=dict)
    active_s: dict[int | None, float] = field(default_factory=dict)

    def advance(self, now: float, load: dict[int | None, tuple[float, bool]]) -> None:
        elapsed = max(0.0, now - self.at)  # a wall clock stepped back counts nothing
        for scope, (busy_sms, active) in load.items():
            self.sm_busy_s[scope] = self.sm_busy_s.get(scope, 0.0) + busy_sms * elapsed
            self.active_s[scope] = self.active_s.get(scope, 0.0) + (elapsed if active else 0.0)
        self.at = now


@dataclass
class _GpmState:
    """The mock's GPM state in this process (samples are process memory, as NVML's are): the
    allocated sample buffers by address, each GPU's counters by index."""

    buffers: dict[int, _GpmBuffer] = field(default_factory=dict)
    counters: dict[int, _GpmCounters] = field(default_factory=dict)
