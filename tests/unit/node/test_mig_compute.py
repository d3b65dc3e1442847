"""A MIG device's compute (issue 42): where GPM measures its GPU instance's SM utilisation, a claim's
measure is that share of its partition and an idle instance is not use; where not, the partition
with a process counts whole (driver/node/claim_usage.py, driver/node/usage.py)."""

from __future__ import annotations

import pytest

from driver.inventory.discovery import GpuInfo
from driver.node.claim_usage import measure
from driver.node.state import PreparedDevice
from driver.node.usage import GpuActivity, is_busy
from driver.nvml import gpm
from driver.nvml.machine import MigProfileSpec, load_machine
from driver.nvml.mock import MockNvml, MockProcess
from driver.nvml.session import DeviceUsage, NvmlProcess, NvmlSession

GIB = 2**30
POD = "0f0e0d0c-1111-2222-3333-444455556666"
PROFILE_3G = MigProfileSpec(9, "3g.40gb", 60, 40448)
H100 = GpuInfo(0, 0, "GPU-0", "NVIDIA H100 80GB HBM3", "hopper", "9.0.0", "580.95.5", "13.0.0", "0000:18:00.0",
               80 * GIB, 132, True, True, (PROFILE_3G,))  # fmt: skip
PARTITION = 100 * 60 / 132  # a 3g.40gb's SMs in percent of the H100's: 45.5


def device(kind: str, **fields: object) -> PreparedDevice:
    return PreparedDevice(("gpu",), "node-a", f"gpu-0-{kind}", (), kind=kind, gpu_uuid="GPU-0", mig_uuid="MIG-1",
                          mig_profile="3g.40gb", **fields)  # fmt: skip


def on_mig(measured: float | None, processes: int = 1) -> GpuActivity:
    """A GPU in MIG mode whose MIG-1 runs `processes` of the pod's processes, its instance measured
    at `measured` percent by GPM (None: not measured)."""
    running = tuple(NvmlProcess(10 + i, "MIG-1", None, GIB) for i in range(processes))
    usage = DeviceUsage(2 * GIB, 40 * GIB, measured)
    return GpuActivity(None, running, {p.pid: POD for p in running}, None, {"MIG-1": usage})


def compute(kind: str, activity: GpuActivity, **fields: object) -> float:
    use = measure(device(kind, **fields), (POD,), activity, H100, 10 * GIB)
    assert use is not None
    return use.compute_percent


def test_a_partition_counts_its_measured_share_of_its_sms_else_all_of_them():
    assert compute("mig", on_mig(50.0)) == round(PARTITION / 2, 1)  # 22.7, not the whole 45.5
    assert compute("mig", on_mig(None)) == round(PARTITION, 1)  # not measured: never shrunk from a guess
    assert compute("mig", on_mig(80.0, processes=0)) == 0.0  # no process: nothing of its own computes


def test_a_share_in_a_partition_counts_its_limit_or_the_instances_measure_where_lower():
    assert compute("mig-mps", on_mig(30.0), mps_thread_percentage=50) == round(PARTITION * 0.3, 1)
    assert compute("mig-mps", on_mig(80.0), mps_thread_percentage=50) == round(PARTITION * 0.5, 1)  # its limit
    assert compute("mig-mps", on_mig(None), mps_thread_percentage=50) == round(PARTITION * 0.5, 1)
    assert compute("mig-timeslice", on_mig(30.0)) == round(PARTITION * 0.3, 1)
    assert compute("mig-timeslice", on_mig(None)) == round(PARTITION, 1)


@pytest.mark.parametrize(
    ("kind", "measured", "processes", "busy"),
    [
        ("mig", None, 1, True),  # not measured: a process is use
        ("mig", 60.0, 1, True),
        ("mig", 2.0, 1, False),  # a process holding the partition, computing nothing
        ("mig", 60.0, 0, False),  # no process: what GPM still averages in has ended
        ("mig-mps", 2.0, 1, False),  # the instance idle: all its shares are
        ("mig-mps", 60.0, 1, True),
        ("mig-timeslice", None, 1, True),
    ],
)
def test_a_mig_device_is_busy_when_its_instance_computes(kind: str, measured: float | None, processes: int, busy: bool):
    assert is_busy(device(kind), (POD,), on_mig(measured, processes)) is busy


def test_the_plugin_measures_a_partitions_compute_through_gpm(monkeypatch):
    """From the mock's process to the claim's measure: 15% of the GPU's SMs on a 3g.40gb is 33% of
    its instance, measured 15% of the GPU again, where the partition counts 45.5% without GPM."""
    monkeypatch.setattr(gpm, "MIN_INTERVAL_S", 0.0)  # each read samples: the mock's clock spaces them
    now = [1_000.0]
    nvml = MockNvml(load_machine("dgx-h100"), clock=lambda: now[0])
    session = NvmlSession(nvml)
    assert session.set_mig_mode(0, True)
    record = session.create_mig_instance(0, 9, 4, 4)
    (ci, mig_uuid), gi = record.compute_instances[0], record.gi_id
    partition = PreparedDevice(("gpu",), "node-a", "gpu-0-mig", (), kind="mig", gpu_uuid="GPU-0", mig_uuid=mig_uuid,
                               mig_profile="3g.40gb")  # fmt: skip
    nvml.set_process(0, MockProcess(7, sm_percent=15, gi_id=gi, ci_id=ci))

    def sample() -> float:
        activity = GpuActivity(None, tuple(session.processes(0)), {}, None, session.mig_usage(0))
        use = measure(partition, (), activity, H100, None)
        assert use is not None
        return use.compute_percent

    assert sample() == round(PARTITION, 1)  # GPM's first sample: nothing measured yet
    now[0] += 5
    assert sample() == 15.0
