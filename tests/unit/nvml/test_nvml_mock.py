import ctypes
from pathlib import Path

import pynvml
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from driver.nvml.geometry import COMPUTE_SLICES, GEOMETRY_BY_ID, MIG_GEOMETRY, memory_slots
from driver.nvml.machine import MachineProfileError, bundled_machines, load_machine
from driver.nvml.mock import (
    SIMULATED_MIG_RESERVED_MIB,
    SIMULATED_MPS_GPU_PERCENT,
    SIMULATED_MPS_MEMORY_PERCENT,
    SIMULATED_MPS_SERVER_MIB,
    MockDevice,
    MockNvml,
)
from driver.nvml.session import DeviceUsage, NvmlSession


def mock(name: str = "dgx-h100", state: Path | None = None) -> MockNvml:
    nvml = MockNvml(load_machine(name), state)
    nvml.nvmlInit()
    return nvml


def placement(start: int, size: int) -> pynvml.c_nvmlGpuInstancePlacement_t:
    p = pynvml.c_nvmlGpuInstancePlacement_t()
    p.start, p.size = start, size
    return p


def enable_mig(nvml: MockNvml, index: int = 0):
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    assert nvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_SUCCESS
    return handle


def error_code(excinfo: pytest.ExceptionInfo) -> int:
    return excinfo.value.value


def test_bundled_machines_are_the_documented_set():
    assert set(bundled_machines()) == {"dgx-a100-40gb", "dgx-a100-80gb", "dgx-h100", "hgx-h200", "dgx-b200", "l4x4"}
    for name in bundled_machines():
        machine = load_machine(name)
        assert machine.gpu_count in (4, 8)


def test_calls_before_init_fail_like_nvml():
    nvml = MockNvml(load_machine("dgx-h100"))
    with pytest.raises(pynvml.NVMLError) as err:
        nvml.nvmlDeviceGetCount()
    assert error_code(err) == pynvml.NVML_ERROR_UNINITIALIZED
    assert isinstance(err.value, pynvml.NVMLError_Uninitialized)


def test_profile_info_matches_gpu_facts_for_h100():
    nvml = mock()
    handle = enable_mig(nvml)
    info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2)
    assert isinstance(info, pynvml.c_nvmlGpuInstanceProfileInfo_v2_t)
    assert (info.id, info.multiprocessorCount, info.instanceCount) == (15, 26, 4)
    assert info.name == "MIG 1g.20gb"  # pynvml decodes char arrays of its structures
    seven = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE)
    assert (seven.id, seven.multiprocessorCount, seven.sliceCount) == (0, 132, 7)


def test_possible_placements_two_call_protocol():
    nvml = mock()
    handle = enable_mig(nvml)
    count = ctypes.c_uint(0)
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, 14, None, ctypes.byref(count))
    assert count.value == 3
    array = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, 14, array, ctypes.byref(count))
    assert [(p.start, p.size) for p in array] == [(0, 2), (2, 2), (4, 2)]


def test_mig_calls_on_a_non_mig_gpu_are_not_supported():
    nvml = mock("l4x4")
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    for call in (
        lambda: nvml.nvmlDeviceGetMigMode(handle),
        lambda: nvml.nvmlDeviceSetMigMode(handle, 1),
        lambda: nvml.nvmlDeviceCreateGpuInstance(handle, 19),
    ):
        with pytest.raises(pynvml.NVMLError) as err:
            call()
        assert error_code(err) == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_mig_off_rejects_instances_and_a100_needs_a_reset():
    nvml = mock("dgx-a100-40gb")
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError) as err:
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, 19, placement(0, 1))
    assert error_code(err) == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert nvml.nvmlDeviceSetMigMode(handle, 1) == pynvml.NVML_ERROR_RESET_REQUIRED
    assert nvml.nvmlDeviceGetMigMode(handle) == [0, 1]


def test_create_destroy_lifecycle_and_mig_uuid():
    nvml = mock()
    handle = enable_mig(nvml)
    gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, 9, placement(4, 4))
    info = nvml.nvmlGpuInstanceGetInfo(gi)
    assert (info.profileId, info.placement.start, info.placement.size) == (9, 4, 4)
    ci = nvml.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
    uuid = nvml.nvmlDeviceGetUUID(mig)
    assert uuid.startswith("MIG-")
    assert nvml.nvmlDeviceGetGpuInstanceId(mig) == info.id
    with pytest.raises(pynvml.NVMLError) as err:
        nvml.nvmlGpuInstanceDestroy(gi)
    assert error_code(err) == pynvml.NVML_ERROR_IN_USE
    nvml.nvmlComputeInstanceDestroy(ci)
    nvml.nvmlGpuInstanceDestroy(gi)
    with pytest.raises(pynvml.NVMLError) as err:
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
    assert error_code(err) == pynvml.NVML_ERROR_NOT_FOUND
    # A re-created instance gets a new MIG UUID, as on real GPUs.
    gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, 9, placement(4, 4))
    nvml.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
    assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)) != uuid


def test_taken_placement_and_exhausted_profile_are_insufficient_resources():
    nvml = mock()
    handle = enable_mig(nvml)
    nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, 14, placement(2, 2))
    with pytest.raises(pynvml.NVMLError) as err:
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, 19, placement(3, 1))
    assert error_code(err) == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, 20, placement(0, 1))
    with pytest.raises(pynvml.NVMLError) as err:  # only one +me instance a GPU
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, 20, placement(1, 1))
    assert error_code(err) == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    with pytest.raises(pynvml.NVMLError) as err:
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, 19, placement(7, 1))  # not a 1g placement
    assert error_code(err) == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_creation_order_quirk_of_automatic_placement():
    nvml = mock()
    handle = enable_mig(nvml)
    for profile in (19, 19, 14):
        nvml.nvmlDeviceCreateGpuInstance(handle, profile)
    with pytest.raises(pynvml.NVMLError) as err:
        nvml.nvmlDeviceCreateGpuInstance(handle, 9)
    assert error_code(err) == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES

    other = enable_mig(nvml, 1)
    for profile in (9, 19, 19, 14):
        nvml.nvmlDeviceCreateGpuInstance(other, profile)


def test_state_file_is_shared_between_processes(tmp_path: Path):
    state = tmp_path / "gpus.json"
    first = mock(state=state)
    handle = enable_mig(first)
    first.nvmlDeviceCreateGpuInstanceWithPlacement(handle, 0, placement(0, 8))
    second = mock(state=state)  # e.g. the plugin after a restart
    gi = second.nvmlDeviceGetGpuInstanceById(second.nvmlDeviceGetHandleByIndex(0), 0)
    assert second.nvmlGpuInstanceGetInfo(gi).profileId == 0
    assert second.nvmlDeviceGetMigMode(second.nvmlDeviceGetHandleByIndex(0)) == [1, 1]


def test_user_supplied_profile_and_bad_profile(tmp_path: Path):
    good = tmp_path / "two-l4.yaml"
    good.write_text(
        "name: two-l4\ngpuCount: 2\ndriverVersion: '570.1.2'\ncudaDriverVersion: 12080\n"
        "gpu: {productName: NVIDIA L4, architecture: ada, cudaComputeCapability: '8.9', pciDeviceId: 0x27B8,"
        " memoryMiB: 23034, multiprocessors: 58, migCapable: false}\n"
    )
    nvml = mock(str(good))
    assert nvml.nvmlDeviceGetCount() == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ngpuCount: 1\n")
    with pytest.raises(MachineProfileError, match="invalid machine profile"):
        load_machine(str(bad))
    with pytest.raises(MachineProfileError, match="unknown mock machine"):
        load_machine("dgx-z900")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.sampled_from(MIG_GEOMETRY), st.integers(0, 6)), max_size=25))
def test_random_create_destroy_never_oversubscribes(operations):
    nvml = mock()
    handle = enable_mig(nvml)
    live = []
    for create, geometry, start_index in operations:
        if create:
            start = geometry.starts[start_index % len(geometry.starts)]
            try:
                live.append(
                    nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
                        handle, geometry.profile_id, placement(start, geometry.memory_slices)
                    )
                )
            except pynvml.NVMLError as err:
                assert err.value == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
        elif live:
            nvml.nvmlGpuInstanceDestroy(live.pop(start_index % len(live)))
        infos = [nvml.nvmlGpuInstanceGetInfo(gi) for gi in live]
        slots = [memory_slots(i.placement.start, i.placement.size) for i in infos]
        assert sum(len(s) for s in slots) == len(frozenset().union(*slots))
        assert sum(GEOMETRY_BY_ID[i.profileId].compute_slices for i in infos) <= COMPUTE_SLICES


def test_utilization_rates_like_nvml():
    nvml = mock()
    handle = nvml.nvmlDeviceGetHandleByIndex(1)
    idle = nvml.nvmlDeviceGetUtilizationRates(handle)
    assert isinstance(idle, pynvml.c_nvmlUtilization_t) and (idle.gpu, idle.memory) == (0, 0)
    nvml.nvmlDeviceSetComputeMode(handle, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)  # an MPS daemon serves
    busy = nvml.nvmlDeviceGetUtilizationRates(handle)
    assert (busy.gpu, busy.memory) == (SIMULATED_MPS_GPU_PERCENT, SIMULATED_MPS_MEMORY_PERCENT)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    assert memory.used == SIMULATED_MPS_SERVER_MIB * 2**20 and memory.used + memory.free == memory.total
    with pytest.raises(pynvml.NVMLError) as excinfo:
        nvml.nvmlDeviceGetUtilizationRates(MockDevice(8))
    assert error_code(excinfo) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    nvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError) as excinfo:
        nvml.nvmlDeviceGetUtilizationRates(handle)
    assert error_code(excinfo) == pynvml.NVML_ERROR_UNINITIALIZED


def test_mig_devices_report_their_memory_and_no_utilization():
    nvml = mock()
    handle = enable_mig(nvml)
    instance = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, 19, placement(0, 1))
    nvml.nvmlGpuInstanceCreateComputeInstance(instance, 0)
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
    assert nvml.nvmlDeviceGetMemoryInfo(mig).total == 9984 * 2**20  # the 1g.10gb's, not the GPU's
    assert nvml.nvmlDeviceGetMemoryInfo(mig).used == SIMULATED_MIG_RESERVED_MIB * 2**20
    assert nvml.nvmlDeviceGetMemoryInfo(handle).used == SIMULATED_MIG_RESERVED_MIB * 2**20
    for device in (mig, handle):  # "On MIG-enabled GPUs, querying device utilization rates is not supported"
        with pytest.raises(pynvml.NVMLError) as excinfo:
            nvml.nvmlDeviceGetUtilizationRates(device)
        assert error_code(excinfo) == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_session_usage_of_gpus_and_mig_devices():
    session = NvmlSession(mock())
    assert session.usage(0) == DeviceUsage(memory_used_bytes=0, memory_total_bytes=81559 * 2**20, gpu_percent=0)
    assert session.mig_usage(0) == {}
    assert session.set_mig_mode(0, True)
    record = session.create_mig_instance(0, 9, 4, 4)
    ((_, mig_uuid),) = record.compute_instances
    assert session.usage(0).gpu_percent is None
    assert session.mig_usage(0) == {
        mig_uuid: DeviceUsage(SIMULATED_MIG_RESERVED_MIB * 2**20, 40448 * 2**20, gpu_percent=None)
    }
