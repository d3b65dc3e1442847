"""Profiled processes on the NVML mock (driver/nvml/usage_profiles.py): each shape's use over time
as NVML reports it, the same in every process that reads the mock's state file, kept in that file,
refused when it makes no sense, set with `fgpu mock usage`, and seen by the plugin's per-claim
measure (driver/node/claim_usage.py)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pynvml
import pytest

from driver.cli.main import main
from driver.inventory.discovery import GpuInfo
from driver.node.claim_usage import measure
from driver.node.state import PreparedDevice
from driver.node.usage import GpuActivity
from driver.nvml.machine import load_machine
from driver.nvml.mock import SIMULATED_MIG_RESERVED_MIB, MachineState, MockNvml, MockProcess
from driver.nvml.session import MOCK_STATE_ENV, NvmlSession
from driver.nvml.usage_profiles import DAY_S, WANDER, WORKLOAD_PROFILES, UsageProfile

MIB = 2**20
HOUR_S = 3600
START = 1_800_000_000.0
POD = "0f0e0d0c-1111-2222-3333-444455556666"
STEADY = UsageProfile("steady", 10_240, 20.0)
BURSTY = UsageProfile("bursty", 20_480, 25.0, burst_mib=30_720, burst_compute=35.0)
GROWING = UsageProfile("growing", 10_240, 20.0, growth_mib_per_day=1536)


@dataclass
class Clock:
    now: float = START

    def __call__(self) -> float:
        return self.now


def mock(clock: Clock | None = None, state: Path | None = None) -> MockNvml:
    nvml = MockNvml(load_machine("dgx-h100"), state, clock or time.time)
    nvml.nvmlInit()
    return nvml


def reported(nvml: MockNvml, gpu: int = 0) -> tuple[int, int, int]:
    """The first process's memory (MiB) and SM utilisation, and the GPU's memory used (MiB)."""
    handle = nvml.nvmlDeviceGetHandleByIndex(gpu)
    (process,) = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    (sample,) = nvml.nvmlDeviceGetProcessUtilization(handle, 0)
    return process.usedGpuMemory // MIB, sample.smUtil, nvml.nvmlDeviceGetMemoryInfo(handle).used // MIB


def near(value: float, level: float) -> bool:
    """Within the profiles' wander (and NVML's whole percent) of the level."""
    return abs(value - level) <= level * WANDER + 0.5


def test_a_steady_process_wanders_within_2_percent_and_every_reader_sees_the_same(tmp_path: Path):
    clock = Clock()
    plugin, other = mock(clock, tmp_path / "gpus.json"), mock(clock, tmp_path / "gpus.json")
    plugin.set_process(0, MockProcess(7, profile=STEADY))
    memories = set()
    for t in range(0, 7 * DAY_S, 3 * HOUR_S + 17):
        clock.now = START + t
        memory, sm, used = reported(plugin)
        assert near(memory, 10_240) and sm == 20 and used == memory, t
        assert reported(other) == (memory, sm, used)  # another process reads the same use at this time
        memories.add(memory)
    assert len(memories) > 20  # it wanders, not a fixed value


def test_a_bursty_process_spikes_for_10_minutes_every_6_hours():
    clock = Clock()
    nvml = mock(clock)
    nvml.set_process(0, MockProcess(7, profile=BURSTY))
    for t, (memory, compute) in {
        0: (30_720, 35),
        599: (30_720, 35),
        600: (20_480, 25),
        3 * HOUR_S: (20_480, 25),
        6 * HOUR_S - 1: (20_480, 25),
        6 * HOUR_S + 300: (30_720, 35),
        6 * HOUR_S + 600: (20_480, 25),
    }.items():
        clock.now = START + t
        got_memory, got_sm, _ = reported(nvml)
        assert near(got_memory, memory) and near(got_sm, compute), t


def test_a_growing_process_adds_its_growth_each_day():
    clock = Clock()
    nvml = mock(clock)
    nvml.set_process(0, MockProcess(7, profile=GROWING))
    memories = []
    for day in range(8):
        clock.now = START + day * DAY_S
        memory, sm, _ = reported(nvml)
        assert near(memory, 10_240 + 1536 * day) and sm == 20, day
        memories.append(memory)
    assert memories == sorted(memories)


def test_a_time_scale_runs_days_in_seconds():
    clock = Clock()
    nvml = mock(clock)
    nvml.set_process(0, MockProcess(7, profile=GROWING, time_scale=DAY_S))  # a day a second
    clock.now += 3
    assert near(reported(nvml)[0], 10_240 + 3 * 1536)
    # The mock's own clock is the wall clock: a process that started a second ago is a day in.
    nvml = mock()
    nvml.set_process(0, MockProcess(7, profile=GROWING, started=time.time() - 1, time_scale=DAY_S))
    assert (10_240 + 1536) * (1 - WANDER) <= reported(nvml)[0] <= (10_240 + 3 * 1536) * (1 + WANDER)


def test_a_profiled_process_round_trips_through_the_state_file(tmp_path: Path):
    clock = Clock()
    nvml = mock(clock, tmp_path / "gpus.json")
    nvml.set_process(2, MockProcess(7, profile=BURSTY, time_scale=60.0))
    state = MachineState.from_json((tmp_path / "gpus.json").read_text())
    assert state.gpus[2].processes == [MockProcess(7, profile=BURSTY, started=START, time_scale=60.0)]
    assert MachineState.from_json(state.to_json()) == state
    # A state file from before profiles (a running plugin's, over an upgrade) still reads.
    raw = json.loads(state.to_json())
    raw["gpus"][2]["processes"] = [{"pid": 8, "sm_percent": 30, "memory_mib": 512, "gi_id": None, "ci_id": 0}]
    assert MachineState.from_json(json.dumps(raw)).gpus[2].processes == [MockProcess(8, 30, 512)]


@pytest.mark.parametrize(
    "process",
    [
        MockProcess(7, profile=UsageProfile("steady", -1, 5.0)),
        MockProcess(7, profile=UsageProfile("wobbly", 1024, 5.0)),
        MockProcess(7, profile=UsageProfile("bursty", 1024, 5.0, burst_mib=2048, burst_compute=101.0)),
        MockProcess(7, profile=UsageProfile("growing", 1024, 5.0, growth_mib_per_day=-10)),
        MockProcess(7, profile=STEADY, time_scale=0.0),
        MockProcess(7, memory_mib=-1),
    ],
)
def test_a_profile_that_makes_no_sense_is_an_invalid_argument(process: MockProcess):
    nvml = mock(Clock())
    with pytest.raises(pynvml.NVMLError) as refused:
        nvml.set_process(0, process)
    assert refused.value.value == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert nvml.nvmlDeviceGetComputeRunningProcesses(nvml.nvmlDeviceGetHandleByIndex(0)) == []


# --- `fgpu mock usage` ------------------------------------------------------------------------------


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(MOCK_STATE_ENV, str(tmp_path / "gpus.json"))
    return tmp_path / "gpus.json"


def usage(*flags: str) -> int:
    return main(["mock", "usage", "--nvml=mock:dgx-h100", "--gpu=1", *flags])


def test_mock_usage_starts_a_profiled_process(state: Path):
    assert usage("--pid=7", "--workload=Pod/mig-3g", "--time-scale=86400") == 0
    assert usage("--pid=8", "--shape=bursty", "--memory=1024", "--sm=5", "--burst-memory=4096", "--burst-sm=40") == 0
    assert usage("--pid=9", "--shape=growing", "--memory=512", "--growth=100") == 0
    processes = MachineState.from_json(state.read_text()).gpus[1].processes
    assert [(p.pid, p.profile, p.time_scale) for p in processes] == [
        (7, WORKLOAD_PROFILES["Pod/mig-3g"], 86400.0),
        (8, UsageProfile("bursty", 1024, 5, burst_mib=4096, burst_compute=40), 1.0),
        (9, UsageProfile("growing", 512, 0, growth_mib_per_day=100), 1.0),
    ]
    assert all(p.started is not None and abs(p.started - time.time()) < 60 for p in processes)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--shape=wobbly"], "argument --shape: invalid choice: 'wobbly'"),
        (["--shape=steady", "--memory=-5"], "argument --memory: '-5' is not a whole number of MiB"),
        (["--shape=bursty", "--burst-memory=lots"], "argument --burst-memory: 'lots' is not a whole number of MiB"),
        (["--shape=bursty", "--burst-sm=150"], "argument --burst-sm: '150' is not a whole percent"),
        (["--shape=growing", "--growth=-1"], "argument --growth: '-1' is not a whole number of MiB"),
        (["--shape=steady", "--time-scale=0"], "argument --time-scale: '0' is not a number above 0"),
        (["--workload=Pod/nope"], "argument --workload: 'Pod/nope' is not a bundled example workload"),
    ],
)
def test_mock_usage_names_the_bad_flag(state: Path, capsys: pytest.CaptureFixture[str], flags, message):
    with pytest.raises(SystemExit) as stopped:
        usage("--pid=7", *flags)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workload=Job/trainer", "--memory=10"], "--workload has its own use profile: leave out --memory"),
        (["--growth=10"], "--growth needs --shape or --workload"),
        (["--time-scale=60"], "--time-scale needs --shape or --workload"),
    ],
)
def test_mock_usage_refuses_flags_it_would_ignore(state: Path, capsys: pytest.CaptureFixture[str], flags, message):
    assert usage("--pid=7", *flags) == 2
    assert message in capsys.readouterr().err
    assert not state.exists()  # refused before the mock GPUs were touched


# --- what the plugin measures of a claim ----------------------------------------------------------------


def h100(nvml: MockNvml) -> GpuInfo:
    gpu = nvml.machine.gpu
    return GpuInfo(0, 0, "GPU-0", gpu.product_name, "hopper", "9.0.0", "580.95.5", "13.0.0", "0000:18:00.0",
                   gpu.memory_mib * MIB, gpu.multiprocessors, True, False,
                   tuple(gpu.mig_profiles.values()))  # fmt: skip


def activity(session: NvmlSession, index: int) -> GpuActivity:
    """What the plugin's metrics read of a GPU at a sample (driver/node/metrics.py)."""
    processes = tuple(session.processes(index))
    usage = session.usage(index)
    return GpuActivity(usage.gpu_percent, processes, {p.pid: POD for p in processes}, usage, session.mig_usage(index))


def test_the_plugin_measures_a_profiled_process_of_a_share_and_of_a_partition():
    clock = Clock()
    session = NvmlSession(mock(clock))
    nvml: MockNvml = session.nvml
    gpu = h100(nvml)
    # An MPS share of 10Gi and 25% whose pod is the bursty inference-small example.
    share = PreparedDevice(("gpu",), "node-a", "gpu-0-mps", (), kind="mps", gpu_uuid="GPU-0",
                           mps_memory_bytes=10 * 2**30, mps_thread_percentage=25)  # fmt: skip
    nvml.set_process(0, MockProcess(4242, profile=WORKLOAD_PROFILES["Pod/inference-small"]))
    burst = measure(share, (POD,), activity(session, 0), gpu, None)
    clock.now += HOUR_S
    level = measure(share, (POD,), activity(session, 0), gpu, None)
    assert burst is not None and level is not None
    assert near(burst.memory_mib, 6144) and near(burst.compute_percent, 15)
    assert near(level.memory_mib, 3072) and near(level.compute_percent, 6)

    # A 3g.40gb partition whose pod is the growing mig-3g example: full within 21 days.
    assert session.set_mig_mode(1, True)
    mig = session.create_mig_instance(1, 9, 4, 4)
    (ci_id, mig_uuid), total_mib = mig.compute_instances[0], nvml.machine.gpu.mig_profiles[9].memory_mib
    partition = PreparedDevice(("gpu",), "node-a", "gpu-1-mig", (), kind="mig", gpu_index=1, mig_uuid=mig_uuid,
                               mig_profile="3g.40gb")  # fmt: skip
    nvml.set_process(1, MockProcess(4243, gi_id=mig.gi_id, ci_id=ci_id, profile=WORKLOAD_PROFILES["Pod/mig-3g"]))
    for day, memory_mib in ((0, 10_240), (10, 10_240 + 15_360)):
        clock.now = START + HOUR_S + day * DAY_S
        use = measure(partition, (), activity(session, 1), gpu, None)
        assert use is not None and near(use.memory_mib - SIMULATED_MIG_RESERVED_MIB, memory_mib), day
        assert not use.at_memory_limit
    clock.now += 11 * DAY_S
    use = measure(partition, (), activity(session, 1), gpu, None)
    assert use is not None and use.memory_mib == total_mib and use.at_memory_limit  # no more than it has
