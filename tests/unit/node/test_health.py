"""Device health: NVML events from the mock, faults -> taints (pure), the monitor publishing taints
and retrying, and the fault record an operator clears."""

from __future__ import annotations

from pathlib import Path

import pytest

from driver.inventory.devices import node_targets
from driver.inventory.discovery import discover_gpus
from driver.inventory.offers import node_inventory
from driver.inventory.sharing import SharingConfig
from driver.node.health.monitor import HealthBoard, HealthMonitor
from driver.node.health.record import GpuFault, HealthRecord, MigSlices
from driver.node.health.taints import HealthPolicy, device_health, device_taints
from driver.node.metrics import REGISTRY
from driver.node.publisher import SlicePublisher
from driver.nvml.session import EventWatch, GpuLostError, NvmlEvent, NvmlSession, gpu_reachable
from testbed.fakes import InMemoryKubeApi, node_object

NOW = 1_800_000_000.0


@pytest.fixture
def session() -> NvmlSession:
    return NvmlSession.open("mock:dgx-h100")


def test_the_mock_reports_injected_events_once_to_each_event_set(session: NvmlSession):
    first, second = EventWatch(session, [0, 1]), EventWatch(session, [1])
    assert first.next(0.05) is None  # TIMEOUT: nothing happened
    session.nvml.inject_xid(1, 79)
    session.nvml.inject_xid(0, 94, gi_id=3, ci_id=0)
    session.nvml.inject_double_bit_ecc(1)
    assert first.next(1) == NvmlEvent(1, "xid", 79)
    assert first.next(1) == NvmlEvent(0, "xid", 94, gi_id=3, ci_id=0)
    assert first.next(1) == NvmlEvent(1, "ecc")
    assert first.next(0.05) is None
    assert [second.next(1), second.next(1), second.next(0.05)] == [NvmlEvent(1, "xid", 79), NvmlEvent(1, "ecc"), None]
    later = EventWatch(session, [1])
    assert later.next(0.05) is None  # a new set sees only what happens after it exists


def test_a_lost_gpu_fails_calls_and_the_event_wait(session: NvmlSession):
    watch = EventWatch(session, [2])
    session.nvml.set_gpu_lost(2, True)
    assert not gpu_reachable(session, 2) and gpu_reachable(session, 1)
    with pytest.raises(GpuLostError):
        watch.next(0.05)
    session.nvml.set_gpu_lost(2, False)
    assert gpu_reachable(session, 2) and watch.next(0.05) is None


def targets():
    gpus = discover_gpus(NvmlSession.open("mock:dgx-h100"))
    return gpus, node_targets(gpus, SharingConfig())


def test_a_whole_gpu_fault_taints_every_device_of_that_gpu_only():
    gpus, all_targets = targets()
    fault = GpuFault(gpus[1].uuid, "xid", 79, first_seen=NOW, last_seen=NOW)
    taints = device_taints(all_targets, [fault], NOW + 1, HealthPolicy())
    assert set(taints) == {t.name for t in all_targets if t.gpu.index == 1}
    (taint,) = taints["gpu-1"]
    assert (taint.key, taint.value, taint.effect) == ("gpu.fgpu.dev/xid", "79", "NoSchedule")
    assert taint.time_added == "2027-01-15T08:00:00Z"
    health = device_health(all_targets, [fault], NOW + 1, HealthPolicy())
    assert not health["gpu-1-mps"].healthy and health["gpu-1-mps"].message == "XID 79"
    assert health["gpu-0"].healthy


def test_a_mig_instance_fault_taints_what_overlaps_its_memory():
    gpus, all_targets = targets()
    fault = GpuFault(gpus[0].uuid, "ecc", mig=MigSlices(start=4, size=2), first_seen=NOW, last_seen=NOW)
    tainted = set(device_taints(all_targets, [fault], NOW, HealthPolicy()))
    assert {
        "gpu-0",
        "gpu-0-mps",
        "gpu-0-ts",
        "gpu-0-mig-2g20gb-4",
        "gpu-0-mig-1g10gb-5",
        "gpu-0-mig-7g80gb-0",
    } <= tainted
    assert "gpu-0-mig-1g10gb-0" not in tainted and "gpu-0-mig-3g40gb-0" not in tainted
    assert not {n for n in tainted if not n.startswith("gpu-0")}


def test_application_xids_do_not_taint_and_faults_clear_after_the_recovery_period():
    gpus, all_targets = targets()
    policy = HealthPolicy(recovery_s=60)
    app_error = GpuFault(gpus[0].uuid, "xid", 13, first_seen=NOW, last_seen=NOW)
    assert device_taints(all_targets, [app_error], NOW, policy) == {}
    lost = GpuFault(gpus[0].uuid, "lost", first_seen=NOW, last_seen=NOW + 100)
    assert device_taints(all_targets, [lost], NOW + 159, policy)["gpu-0"][0].effect == "NoExecute"
    assert device_taints(all_targets, [lost], NOW + 160, policy) == {}
    silent = HealthPolicy(lost_effect="None")
    assert device_taints(all_targets, [lost], NOW + 101, silent) == {}
    assert not device_health(all_targets, [lost], NOW + 101, silent)["gpu-0"].healthy  # kubelet still hears it


def test_the_record_keeps_first_sightings_and_an_operator_clears_it(tmp_path: Path):
    record = HealthRecord(tmp_path)
    record.record(GpuFault("GPU-a", "lost", first_seen=1, last_seen=1))
    record.record(GpuFault("GPU-a", "lost", first_seen=5, last_seen=5))
    record.record(GpuFault("GPU-b", "xid", 79, MigSlices(0, 1), first_seen=2, last_seen=2))
    assert HealthRecord(tmp_path).read() == [
        GpuFault("GPU-a", "lost", first_seen=1, last_seen=5),
        GpuFault("GPU-b", "xid", 79, MigSlices(0, 1), first_seen=2, last_seen=2),
    ]
    assert [f.gpu_uuid for f in record.clear({"GPU-a"})] == ["GPU-b"]
    assert record.clear() == [] and record.read() == []
    record.path.write_text("{not json")
    assert record.read() == []  # unreadable: logged, no faults, the plugin goes on


def test_the_monitor_taints_published_slices_retries_and_clears(tmp_path: Path, session: NvmlSession):
    gpus = discover_gpus(session)
    api = InMemoryKubeApi()
    api.nodes["n1"] = node_object("n1")
    sharing = SharingConfig(default=frozenset({"whole", "mps"}))
    publisher = SlicePublisher(api, "gpu.fgpu.dev", "n1", node_inventory(gpus, sharing))
    publisher.reconcile()
    record, board = HealthRecord(tmp_path), HealthBoard()
    monitor = HealthMonitor(
        session, gpus, node_targets(gpus, sharing), record, HealthPolicy(), publisher.set_taints, board,
        lambda gpu, gi: None,
    )  # fmt: skip
    watch = EventWatch(session, [g.index for g in gpus])

    def published_taints() -> dict[str, list[str]]:
        devices = [d for s in api.slices.values() for d in s["spec"].get("devices", [])]
        return {d["name"]: [t["key"] for t in d["taints"]] for d in devices if d.get("taints")}

    def events(**labels: str) -> float:
        return REGISTRY.get_sample_value("fgpu_health_events_total", labels) or 0.0

    gpu3, gpu5 = gpus[3].uuid, gpus[5].uuid
    xids_before, lost_before = events(gpu=gpu3, kind="xid", xid="79"), events(gpu=gpu5, kind="gpu_lost", xid="")
    session.nvml.inject_xid(3, 79)
    api.unavailable = True
    monitor.round(watch)
    assert published_taints() == {} and not board.wait_newer(0, 0).devices["gpu-3"].healthy
    api.unavailable = False
    monitor.round(watch)  # a round waits a second for events: the 1 s backoff is over
    assert published_taints() == {"gpu-3": ["gpu.fgpu.dev/xid"], "gpu-3-mps": ["gpu.fgpu.dev/xid"]}

    assert events(gpu=gpu3, kind="xid", xid="79") == xids_before + 1
    assert REGISTRY.get_sample_value("fgpu_device_taints", {"effect": "NoSchedule"}) == 2

    session.nvml.set_gpu_lost(5, True)
    monitor.round(watch)
    monitor.round(watch)
    assert published_taints()["gpu-5"] == ["gpu.fgpu.dev/unreachable"]
    assert events(gpu=gpu5, kind="gpu_lost", xid="") == lost_before + 1  # once, not at every probe
    assert REGISTRY.get_sample_value("fgpu_device_taints", {"effect": "NoExecute"}) == 2
    session.nvml.set_gpu_lost(5, False)
    record.clear()  # the operator: fgpu health clear
    monitor.round(watch)
    assert published_taints() == {}
    assert REGISTRY.get_sample_value("fgpu_device_taints", {"effect": "NoExecute"}) == 0
    assert all(report.healthy for report in board.wait_newer(0, 0).devices.values())
    watch.close()
