"""GPM (issue 42): the mock's GPM calls as NVML answers them (support, samples of a GPU and of a GPU
instance, metrics between two, the errors), and the plugin's reader, which keeps each MIG
instance's previous sample to measure its SM utilisation (driver/nvml/gpm.py)."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any

import pynvml
import pytest

from driver.nvml import gpm
from driver.nvml.gpm import MIN_INTERVAL_S, GpmReader
from driver.nvml.machine import load_machine
from driver.nvml.mock import MockMigDevice, MockNvml, MockProcess
from driver.nvml.session import NvmlSession

H100_SMS, SMS_3G = 132, 60  # dgx-h100: the GPU's SMs, a 3g.40gb instance's
SM_UTIL, GRAPHICS_UTIL = pynvml.NVML_GPM_METRIC_SM_UTIL, pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class Recording:
    """A backend that counts the calls made through it."""

    def __init__(self, nvml: MockNvml) -> None:
        self.nvml, self.calls = nvml, collections.Counter[str]()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        call = getattr(self.nvml, name)

        def record(*args: Any) -> Any:
            self.calls[name] += 1
            return call(*args)

        return record

    def live_samples(self) -> int:
        return self.calls["nvmlGpmSampleAlloc"] - self.calls["nvmlGpmSampleFree"]


def mock(clock: Clock, machine: str = "dgx-h100") -> MockNvml:
    nvml = MockNvml(load_machine(machine), clock=clock)
    nvml.nvmlInit()
    return nvml


def with_3g(nvml: MockNvml, index: int = 0) -> tuple[Any, int, int]:
    """GPU `index` in MIG mode with a 3g.40gb instance spanned by one compute instance: (GPU handle, gi, ci)."""
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    if nvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE) != pynvml.NVML_SUCCESS:
        nvml.reset_gpu(index)  # Ampere switches at a reset
    instance = nvml.nvmlDeviceCreateGpuInstance(handle, 9)
    compute = nvml.nvmlGpuInstanceCreateComputeInstance(instance, 2)  # the 3-slice compute profile
    return handle, instance.gi_id, compute.ci_id


def metrics(nvml: MockNvml, first: Any, second: Any, *ids: int, version: int = 1) -> list[tuple[int, float]]:
    """(nvmlReturn, value) of each metric asked for between two samples."""
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version, request.numMetrics = version, len(ids)
    request.sample1, request.sample2 = first, second
    for i, metric_id in enumerate(ids):
        request.metrics[i].metricId = metric_id
    nvml.nvmlGpmMetricsGet(request)
    return [(request.metrics[i].nvmlReturn, request.metrics[i].value) for i in range(len(ids))]


def error_of(call: Callable[[], object]) -> int:
    with pytest.raises(pynvml.NVMLError) as err:
        call()
    return err.value.value


# --- the mock's GPM calls ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("machine", "supported"), [("dgx-h100", 1), ("dgx-b200", 1), ("dgx-a100-80gb", 0), ("l4x4", 0)]
)
def test_gpm_is_supported_from_hopper_on_and_sampling_fails_before(machine: str, supported: int):
    nvml = mock(Clock(), machine)
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice == supported
    sample = nvml.nvmlGpmSampleAlloc()
    if supported:
        nvml.nvmlGpmSampleGet(handle, sample)
    else:
        assert error_of(lambda: nvml.nvmlGpmSampleGet(handle, sample)) == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_a_mig_sample_measures_its_instance_and_a_gpu_sample_the_whole_gpu():
    clock = Clock()
    nvml = mock(clock)
    handle, gi, ci = with_3g(nvml)
    first_gi, first_gpu, second_gi, second_gpu = (nvml.nvmlGpmSampleAlloc() for _ in range(4))
    nvml.nvmlGpmMigSampleGet(handle, gi, first_gi)
    nvml.nvmlGpmSampleGet(handle, first_gpu)  # the whole GPU, in MIG mode too
    nvml.set_process(0, MockProcess(7, sm_percent=15, gi_id=gi, ci_id=ci))  # 15% of the GPU's SMs
    clock.now += 10
    nvml.nvmlGpmMigSampleGet(handle, gi, second_gi)
    nvml.nvmlGpmSampleGet(handle, second_gpu)

    (sm, graphics, occupancy) = metrics(
        nvml, first_gi, second_gi, SM_UTIL, GRAPHICS_UTIL, pynvml.NVML_GPM_METRIC_SM_OCCUPANCY
    )
    assert sm == (pynvml.NVML_SUCCESS, pytest.approx(15 * H100_SMS / SMS_3G))  # 33% of the instance's SMs
    assert graphics == (pynvml.NVML_SUCCESS, pytest.approx(100.0))  # a process computed all along
    assert occupancy[0] == pynvml.NVML_ERROR_NOT_SUPPORTED and math.isnan(occupancy[1])  # not simulated
    assert metrics(nvml, first_gpu, second_gpu, SM_UTIL) == [(pynvml.NVML_SUCCESS, pytest.approx(15.0))]


def test_a_process_uses_no_more_than_its_compute_instance():
    clock = Clock()
    nvml = mock(clock)
    handle, gi, ci = with_3g(nvml)
    nvml.set_process(0, MockProcess(7, sm_percent=90, gi_id=gi, ci_id=ci))  # more than the 3g's 45%
    first, second = nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()
    nvml.nvmlGpmMigSampleGet(handle, gi, first)
    clock.now += 5
    nvml.nvmlGpmMigSampleGet(handle, gi, second)
    assert metrics(nvml, first, second, SM_UTIL) == [(pynvml.NVML_SUCCESS, pytest.approx(100.0))]


def test_the_counters_accumulate_so_a_metric_spans_every_sample_between():
    clock = Clock()
    nvml = mock(clock)
    handle, gi, ci = with_3g(nvml)
    samples = [nvml.nvmlGpmSampleAlloc() for _ in range(3)]
    nvml.nvmlGpmMigSampleGet(handle, gi, samples[0])
    nvml.set_process(0, MockProcess(7, sm_percent=30, gi_id=gi, ci_id=ci))
    clock.now += 10
    nvml.nvmlGpmMigSampleGet(handle, gi, samples[1])  # 10 s at 66% of the instance
    nvml.end_process(0, 7)
    clock.now += 30
    nvml.nvmlGpmMigSampleGet(handle, gi, samples[2])  # then 30 s idle
    busy = 30 * H100_SMS / SMS_3G
    assert metrics(nvml, samples[0], samples[1], SM_UTIL)[0][1] == pytest.approx(busy)
    assert metrics(nvml, samples[1], samples[2], SM_UTIL)[0][1] == pytest.approx(0.0)
    assert metrics(nvml, samples[0], samples[2], SM_UTIL)[0][1] == pytest.approx(busy / 4)
    assert metrics(nvml, samples[0], samples[2], GRAPHICS_UTIL)[0][1] == pytest.approx(25.0)


def test_gpm_calls_refuse_what_nvml_refuses():
    clock = Clock()
    nvml = mock(clock)
    handle, gi, ci = with_3g(nvml)
    other_handle = nvml.nvmlDeviceGetHandleByIndex(1)
    taken, later, untaken, freed = (nvml.nvmlGpmSampleAlloc() for _ in range(4))
    nvml.nvmlGpmMigSampleGet(handle, gi, taken)
    clock.now += 5
    nvml.nvmlGpmMigSampleGet(handle, gi, later)
    gpu_wide = nvml.nvmlGpmSampleAlloc()
    nvml.nvmlGpmSampleGet(handle, gpu_wide)
    nvml.nvmlGpmSampleFree(freed)

    invalid, not_found = pynvml.NVML_ERROR_INVALID_ARGUMENT, pynvml.NVML_ERROR_NOT_FOUND
    assert error_of(lambda: metrics(nvml, taken, later, SM_UTIL, version=2)) == (
        pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    )
    assert error_of(lambda: metrics(nvml, taken, untaken, SM_UTIL)) == invalid  # never sampled
    assert error_of(lambda: metrics(nvml, later, taken, SM_UTIL)) == invalid  # out of order
    assert error_of(lambda: metrics(nvml, taken, gpu_wide, SM_UTIL)) == invalid  # an instance's and the GPU's
    assert error_of(lambda: nvml.nvmlGpmMigSampleGet(handle, gi, freed)) == invalid
    assert error_of(lambda: nvml.nvmlGpmSampleFree(freed)) == invalid  # freed twice
    assert error_of(lambda: nvml.nvmlGpmSampleGet(handle, object())) == invalid  # not a sample buffer
    assert error_of(lambda: nvml.nvmlGpmSampleGet(MockMigDevice(0, gi, ci), untaken)) == invalid  # GPM takes the GPU's
    assert error_of(lambda: nvml.nvmlGpmMigSampleGet(handle, -1, untaken)) == invalid
    assert error_of(lambda: nvml.nvmlGpmMigSampleGet(handle, gi + 1, untaken)) == not_found  # no such instance
    assert error_of(lambda: nvml.nvmlGpmMigSampleGet(other_handle, 0, untaken)) == pynvml.NVML_ERROR_NOT_SUPPORTED
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version, request.numMetrics = pynvml.NVML_GPM_METRICS_GET_VERSION, pynvml.NVML_GPM_METRIC_MAX + 1
    request.sample1, request.sample2 = taken, later
    assert error_of(lambda: nvml.nvmlGpmMetricsGet(request)) == invalid  # more than the array holds
    nvml.set_gpu_lost(0, True)
    assert error_of(lambda: nvml.nvmlGpmMigSampleGet(handle, gi, untaken)) == pynvml.NVML_ERROR_GPU_IS_LOST
    assert error_of(lambda: MockNvml(load_machine("dgx-h100")).nvmlGpmSampleAlloc()) == (
        pynvml.NVML_ERROR_UNINITIALIZED
    )


# --- the plugin's reader ------------------------------------------------------------------------------------


def test_the_reader_measures_from_each_instances_previous_sample_and_frees_the_one_before():
    clock, reader_clock = Clock(), Clock()
    nvml = mock(clock)
    handle, gi, ci = with_3g(nvml)
    backend = Recording(nvml)
    reader = GpmReader(backend, reader_clock)

    def read() -> float | None:
        return reader.instance_percent(0, handle, gi, "MIG-a")

    assert read() is None  # a first sample: nothing to measure from yet
    nvml.set_process(0, MockProcess(7, sm_percent=30, gi_id=gi, ci_id=ci))
    clock.now += 10
    reader_clock.now += MIN_INTERVAL_S
    assert read() == pytest.approx(30 * H100_SMS / SMS_3G)
    nvml.end_process(0, 7)
    clock.now += 10
    reader_clock.now += MIN_INTERVAL_S / 2
    assert read() == pytest.approx(30 * H100_SMS / SMS_3G)  # too soon for a sample: the last measure
    reader_clock.now += MIN_INTERVAL_S / 2
    assert read() == pytest.approx(0.0)  # from the kept sample: the 10 s idle since
    assert backend.calls["nvmlGpmMigSampleGet"] == 3 and backend.live_samples() == 1
    assert backend.calls["nvmlGpmQueryDeviceSupport"] == 1  # asked once per GPU


def test_a_failed_sample_is_unknown_and_the_next_measures_from_the_kept_one():
    clock, reader_clock = Clock(), Clock()
    nvml = mock(clock)
    handle, gi, ci = with_3g(nvml)
    backend = Recording(nvml)
    reader = GpmReader(backend, reader_clock)
    assert reader.instance_percent(0, handle, gi, "MIG-a") is None
    nvml.set_process(0, MockProcess(7, sm_percent=15, gi_id=gi, ci_id=ci))
    nvml.set_gpu_lost(0, True)
    clock.now, reader_clock.now = clock.now + 5, reader_clock.now + MIN_INTERVAL_S
    assert reader.instance_percent(0, handle, gi, "MIG-a") is None
    assert backend.live_samples() == 1  # the failed one freed
    nvml.set_gpu_lost(0, False)
    clock.now, reader_clock.now = clock.now + 5, reader_clock.now + MIN_INTERVAL_S
    assert reader.instance_percent(0, handle, gi, "MIG-a") == pytest.approx(15 * H100_SMS / SMS_3G)


def test_a_gpu_without_gpm_is_never_sampled():
    nvml = mock(Clock(), "dgx-a100-80gb")
    handle, gi, _ci = with_3g(nvml)
    backend = Recording(nvml)
    reader = GpmReader(backend, Clock())
    assert reader.instance_percent(0, handle, gi, "MIG-a") is None
    assert reader.instance_percent(0, handle, gi, "MIG-a") is None
    assert backend.calls["nvmlGpmQueryDeviceSupport"] == 1 and backend.calls["nvmlGpmSampleAlloc"] == 0


def test_the_session_carries_each_mig_devices_measure_and_frees_the_samples_of_instances_gone(monkeypatch):
    monkeypatch.setattr(gpm, "MIN_INTERVAL_S", 0.0)  # each read samples: the mock's clock spaces them
    clock = Clock()
    nvml = mock(clock)
    backend = Recording(nvml)
    session = NvmlSession(backend)
    assert session.set_mig_mode(0, True)
    record = session.create_mig_instance(0, 9, 4, 4)
    (ci, mig_uuid), gi = record.compute_instances[0], record.gi_id
    assert session.mig_usage(0)[mig_uuid].gpu_percent is None  # a first sample
    nvml.set_process(0, MockProcess(7, sm_percent=15, gi_id=gi, ci_id=ci))
    clock.now += 10
    assert session.mig_usage(0)[mig_uuid].gpu_percent == pytest.approx(15 * H100_SMS / SMS_3G)
    assert backend.live_samples() == 1
    nvml.end_process(0, 7)
    session.destroy_mig_instance(0, gi)
    assert session.mig_usage(0) == {}
    assert backend.live_samples() == 0  # its instance gone, its sample freed
