"""Kill the plugin (SIGKILL) at every step of prepare and unprepare, restart it, and check that it
completes or rolls back: no MIG instance without a prepared claim, no prepared claim without its
instance, no orphaned CDI spec or MPS directory, an MPS daemon and its shm tmpfs exactly while a
share is prepared, and kubelet's retry succeeds."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import grpc
import pytest

from driver.common.testhooks import CRASH_ENV, PREPARE_STEPS, UNPREPARE_STEPS
from driver.nvml.machine import load_machine
from driver.nvml.mock import MockNvml
from driver.nvml.session import MOCK_STATE_ENV, NvmlSession
from testbed.claims_api import create_allocated_claim
from testbed.node_env import fake_tools_env, stop_fake_daemons
from testbed.plugin_process import PluginUnderTest
from tests.support.node_state import check_consistent

pytestmark = [pytest.mark.cluster, pytest.mark.root]

RESULTS = [
    {"request": "mig", "device": "gpu-1-mig-3g40gb-0"},
    {"request": "mps", "device": "gpu-2-mps", "consumedCapacity": {"memory": "8Gi", "compute": "20"}},
    {"request": "ts", "device": "gpu-3-ts", "consumedCapacity": {"memory": "4Gi"}},
    # An MPS share inside a MIG partition: the partition made, then the partition's own daemon.
    {"request": "part", "device": "gpu-4-mig-3g40gb-4-mps", "consumedCapacity": {"memory": "6Gi", "compute": "30"}},
]


@pytest.fixture
def node(cluster) -> Iterator[tuple[PluginUnderTest, NvmlSession]]:
    plugin = PluginUnderTest(node="node-a", kubeconfig=str(cluster.kubeconfig))
    state = plugin.root / "gpus.json"
    plugin.extra_env = {**fake_tools_env(plugin.root), MOCK_STATE_ENV: str(state)}
    plugin.extra_args = ["--offer=whole,mig,mps,timeslice,mig-mps", "--mig-share-profiles=3g.40gb"]
    gpus = MockNvml(load_machine("dgx-h100"), state)
    session = NvmlSession(gpus)  # the test's own view of the same GPUs
    try:
        yield plugin, session
    finally:
        plugin.stop()
        stop_fake_daemons(plugin.root)  # the MPS daemons outlive the plugin by design
        shutil.rmtree(plugin.root, ignore_errors=True)


def crash_at(plugin: PluginUnderTest, step: str | None) -> None:
    plugin.stop()
    plugin.extra_env = {k: v for k, v in plugin.extra_env.items() if k != CRASH_ENV}
    if step:
        plugin.extra_env[CRASH_ENV] = step
    plugin.start()


@pytest.mark.parametrize("step", PREPARE_STEPS)
def test_crash_during_prepare(node, resource_api, step: str):
    plugin, session = node
    crash_at(plugin, step)
    claim = create_allocated_claim(resource_api, RESULTS)
    with pytest.raises(grpc.RpcError):
        plugin.prepare([claim])
    assert plugin.process.wait(10) == -9
    crash_at(plugin, None)  # restart: start-up recovery runs
    check_consistent(plugin, session)
    result = plugin.prepare([claim])[claim["uid"]]  # kubelet's retry
    assert result.error == ""
    assert set(check_consistent(plugin, session)) == {claim["uid"]}
    assert plugin.unprepare([claim]) == {claim["uid"]: ""}
    assert check_consistent(plugin, session) == {}


@pytest.mark.parametrize("step", UNPREPARE_STEPS)
def test_crash_during_unprepare(node, resource_api, step: str):
    plugin, session = node
    crash_at(plugin, step)
    claim = create_allocated_claim(resource_api, RESULTS)
    assert plugin.prepare([claim])[claim["uid"]].error == ""
    with pytest.raises(grpc.RpcError):
        plugin.unprepare([claim])
    crash_at(plugin, None)
    assert check_consistent(plugin, session) == {}
    assert plugin.unprepare([claim]) == {claim["uid"]: ""}  # kubelet's retry


def test_many_concurrent_mps_prepares_on_one_gpu(node, resource_api):
    from concurrent.futures import ThreadPoolExecutor

    plugin, session = node
    crash_at(plugin, None)
    claims = [
        create_allocated_claim(
            resource_api,
            [
                {
                    "request": "mps",
                    "device": "gpu-0-mps",
                    "consumedCapacity": {"memory": f"{1 + i % 4}Gi", "compute": "5"},
                }
            ],
        )
        for i in range(64)
    ]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda c: plugin.prepare([c])[c["uid"]], claims))
    assert [r.error for r in results] == [""] * 64
    for i, claim in enumerate(claims):
        spec = json.loads((plugin.cdi_dir / f"k8s.gpu.fgpu.dev-claim_{claim['uid']}.json").read_text())
        env = spec["devices"][0]["containerEdits"]["env"]
        assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={(1 + i % 4) * 1024}M" in env
    assert len(check_consistent(plugin, session)) == 64
    with ThreadPoolExecutor(16) as pool:
        assert all(not e for r in pool.map(lambda c: plugin.unprepare([c]), claims) for e in r.values())
    assert check_consistent(plugin, session) == {}
