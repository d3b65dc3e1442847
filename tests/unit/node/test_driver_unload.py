"""The NVIDIA driver unloaded under a running plugin: the mock fails NVML calls as NVML does, the
health monitor taints every device while it is gone and, once a driver answers again, has the
prepared claims made again before the taints go."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from driver.claims.refs import ClaimRef
from driver.inventory.devices import DeviceTaint
from driver.node.health.monitor import HealthBoard, HealthMonitor
from driver.node.health.record import HealthRecord
from driver.node.health.taints import UNREACHABLE, HealthPolicy
from driver.nvml.machine import load_machine
from driver.nvml.mock import MockNvml, MockProcess
from driver.nvml.session import DriverGoneError, EventWatch, NvmlSession, gpu_reachable
from testbed.fakes import allocated_claim, result

NEW_VERSION = "580.105.08"


def nvml_error(call, *args) -> int:
    with pytest.raises(pynvml.NVMLError) as failed:
        call(*args)
    return failed.value.value


def test_calls_fail_while_unloaded_and_a_session_of_the_old_driver_must_init_again(tmp_path: Path):
    state = tmp_path / "gpus.json"
    session = NvmlSession(MockNvml(load_machine("dgx-h100"), state))
    old_version = session.driver_versions()[0]
    assert session.set_mig_mode(0, True)  # persists across a reload (H100: no reset needed)
    session.create_mig_instance(0, 19, 0, 1)
    stale = MockNvml(load_machine("dgx-h100"), state)
    stale.nvmlInit()  # another process, initialised under the driver about to go
    watch = EventWatch(session, [0])
    session.nvml.unload_driver()
    with pytest.raises(DriverGoneError):
        watch.next(0)
    with pytest.raises(DriverGoneError):
        gpu_reachable(session, 0)

    assert nvml_error(session.gpu_count) == pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    assert nvml_error(session.nvml.nvmlDeviceGetUUID, session.handle(0)) == pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    another_process = MockNvml(load_machine("dgx-h100"), state)
    assert nvml_error(another_process.nvmlInit) == pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    assert "Driver Not Loaded" in session.driver_missing()

    another_process.load_driver(NEW_VERSION)
    assert nvml_error(stale.nvmlSystemGetDriverVersion) == pynvml.NVML_ERROR_UNINITIALIZED
    assert session.driver_missing() == "" and session.driver_loads == 1  # the failed reopening is not counted
    assert session.driver_versions()[0] == NEW_VERSION != old_version
    assert session.mig_enabled(0) and session.gpu_instances(0) == []  # gone with the driver, as after a reboot


def test_the_driver_does_not_unload_while_a_process_uses_a_gpu():
    session = NvmlSession.open("mock:dgx-h100")
    session.nvml.set_process(2, MockProcess(pid=4242))
    assert nvml_error(session.nvml.unload_driver) == pynvml.NVML_ERROR_IN_USE
    assert session.driver_missing() == ""


@pytest.fixture
def watched(node, tmp_path: Path):
    api, env = node
    api.claims[("default", "mig")] = allocated_claim("default", "mig", "uid-mig", [result("gpu-2-mig-1g10gb-3")])
    ref = ClaimRef("default", "mig", "uid-mig")
    assert env.preparer.prepare([ref])[ref.uid].error == ""
    published: list[dict[str, tuple[DeviceTaint, ...]]] = []
    targets = list(env.preparer.targets.values())

    def driver_back() -> None:
        env.preparer.check_prepared()
        published.append({"driver back": ()})  # where the claims were checked, among the publishes

    monitor = HealthMonitor(
        env.session, env.gpus, targets, HealthRecord(tmp_path / "health"), HealthPolicy(), published.append,
        HealthBoard(), lambda gpu, gi: None, on_driver_back=driver_back,
    )  # fmt: skip
    watch = EventWatch(env.session, [g.index for g in env.gpus])
    yield env, monitor, watch, published, targets
    watch.close()


def mig_uuid(env) -> str:
    return env.claims.get("uid-mig").devices[0].mig_uuid


def test_without_a_driver_every_device_is_tainted_until_the_claims_were_made_again(watched):
    env, monitor, watch, published, targets = watched
    before = mig_uuid(env)
    monitor.round(watch)
    assert published == [] and monitor.driver_missing() == ""

    env.session.nvml.unload_driver()
    monitor.round(watch)
    assert "Driver Not Loaded" in monitor.driver_missing()
    taints = published[-1]
    assert set(taints) == {t.name for t in targets}
    assert {(t.key, t.value, t.effect) for device in taints.values() for t in device} == {
        (UNREACHABLE, "driver-not-loaded", "NoExecute")
    }
    monitor.round(watch)
    assert len(published) == 1  # the same taints are not published again

    env.session.nvml.load_driver(NEW_VERSION)
    monitor.round(watch)
    assert published[-2:] == [{"driver back": ()}, {}]  # the claims checked first, then untainted
    assert monitor.driver_missing() == ""
    [instance] = env.session.gpu_instances(2)
    assert (instance.profile_id, instance.start) == (19, 3)
    assert mig_uuid(env) == instance.compute_instances[0][1] != before

    env.session.nvml.inject_xid(5, 79)  # the event set of the new driver is watched
    monitor.round(watch)
    assert {t.value for t in published[-1]["gpu-5"]} == {"79"}


def test_a_reload_between_two_rounds_is_seen_by_the_stale_session(watched):
    env, monitor, watch, published, _ = watched
    before = mig_uuid(env)
    env.session.nvml.unload_driver()
    env.session.nvml.load_driver()
    monitor.round(watch)
    assert published == [{"driver back": ()}]  # never tainted, but the claims were checked
    assert mig_uuid(env) != before and env.session.gpu_instances(2)[0].compute_instances[0][1] == mig_uuid(env)


def test_an_unprepare_while_the_driver_is_gone_forgets_the_claim_and_the_reload_makes_nothing_for_it(node):
    """Kubelet unprepares the claims of pods evicted off the tainted devices while no driver is
    loaded: what they held went with the driver, so the records and specs go, and the next driver
    gets nothing made again for them."""
    api, env = node
    refs = []
    for name, device in (("mig", "gpu-2-mig-1g10gb-3"), ("whole", "gpu-4")):
        api.claims[("default", name)] = allocated_claim("default", name, f"uid-{name}", [result(device)])
        refs.append(ClaimRef("default", name, f"uid-{name}"))
    assert {r.error for r in env.preparer.prepare(refs).values()} == {""}
    env.session.nvml.unload_driver()

    assert env.preparer.unprepare(refs) == {"uid-mig": "", "uid-whole": ""}
    assert env.claims.all() == {} and not list(env.cdi.cdi_dir.glob("*.json"))
    env.session.nvml.load_driver(NEW_VERSION)
    assert env.session.driver_missing() == ""  # the health monitor's check: NVML initialised anew
    env.preparer.check_prepared()
    assert env.session.gpu_instances(2) == []
