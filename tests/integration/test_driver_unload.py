"""The NVIDIA driver unloaded under the running plugin process and loaded again, an upgrade (with
`fgpu mock-driver`, as a person would): the plugin keeps serving, taints every device in the
slices the real apiserver holds, refuses prepares with a clear error, and once the driver is back
makes the prepared MIG claim's instance again, untaints and publishes the new driver version."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from driver.nvml.machine import load_machine
from driver.nvml.mock import MockNvml
from driver.nvml.session import MOCK_STATE_ENV, NvmlSession
from testbed.claims_api import create_claim
from testbed.cluster.host_state import short_temp_dir
from testbed.plugin_process import PluginUnderTest
from testbed.workloads import wait_for
from tests.support.cli import fgpu
from tests.support.pools import node_slices

pytestmark = pytest.mark.cluster
NODE = "node-driver"
DEVICES = 8 * 26  # the whole GPU and 25 MIG placements of each of 8 H100s
NEW_VERSION = "580.105.08"


@pytest.fixture
def plugin(cluster, core_api, start_plugin) -> Iterator[tuple[PluginUnderTest, dict[str, str]]]:
    if not core_api.list_node(field_selector=f"metadata.name={NODE}").items:
        cluster.add_node(NODE)
    root = short_temp_dir("driver")
    mock_env = {MOCK_STATE_ENV: str(Path(root) / "gpus.json"), "NVML": "mock:dgx-h100"}
    instance = start_plugin(node=NODE, root=root, extra_env=mock_env, extra_args=["--offer=whole,mig"])
    instance.register()
    yield instance, mock_env


def devices(resource_api) -> dict:
    return {d.name: d for s in node_slices(resource_api, NODE) for d in s.spec.devices or []}


DRIVER_TAINT = ("gpu.fgpu.dev/unreachable", "driver-not-loaded", "NoExecute")


def driver_tainted(resource_api) -> set[str]:
    return {
        name
        for name, device in devices(resource_api).items()
        if DRIVER_TAINT in {(t.key, t.value, t.effect) for t in device.taints or []}
    }


def driver_versions(resource_api) -> set[str]:
    return {d.attributes["driverVersion"].version for d in devices(resource_api).values()}


def mig_uuids(state_file: str, gpu: int) -> dict[int, str]:
    """Each GPU instance's MIG UUID by its start slice, as NVML reports it now."""
    session = NvmlSession(MockNvml(load_machine("dgx-h100"), Path(state_file)))
    try:
        return {r.start: r.compute_instances[0][1] for r in session.gpu_instances(gpu)}
    finally:
        session.close()


def recorded(instance: PluginUnderTest, resource_api, claim: dict[str, str]) -> str:
    """The plugin's record of the claim and the claim's status.devices, as text."""
    status = resource_api.read_namespaced_resource_claim(claim["name"], claim["namespace"]).status
    return (instance.state_dir / "checkpoint.json").read_text() + str(status.devices)


def test_the_driver_unloaded_and_upgraded_under_the_running_plugin(plugin, resource_api):
    instance, mock_env = plugin
    state_file = mock_env[MOCK_STATE_ENV]
    wait_for(lambda: len(devices(resource_api)) == DEVICES)
    old_versions = driver_versions(resource_api)
    mig = create_claim(resource_api, devices=[("gpu", "gpu-2-mig-1g10gb-3")], pool=NODE)
    assert instance.prepare([mig])[mig["uid"]].error == ""
    before = mig_uuids(state_file, 2)[3]
    assert recorded(instance, resource_api, mig).count(before) == 2

    fgpu("mock-driver", "unload", "--state-dir", str(instance.state_dir), env=mock_env)
    wait_for(lambda: len(driver_tainted(resource_api)) == DEVICES)
    whole = create_claim(resource_api, devices=[("gpu", "gpu-4")], pool=NODE)
    refused = instance.prepare([whole, mig])
    for claim in (whole, mig):
        error = refused[claim["uid"]].error
        assert f"claim default/{claim['name']} (uid {claim['uid']})" in error
        assert "the NVIDIA driver is not loaded on this node" in error and "Driver Not Loaded" in error
    assert instance.process.poll() is None and instance.health() == health_pb2.HealthCheckResponse.SERVING
    assert recorded(instance, resource_api, mig).count(before) == 2  # nothing released while it cannot be checked

    fgpu("mock-driver", "load", "--version", NEW_VERSION, env=mock_env)
    wait_for(lambda: not driver_tainted(resource_api))
    made_again = mig_uuids(state_file, 2)
    assert set(made_again) == {3} and made_again[3] != before  # made again at its placement before the untaint
    now = recorded(instance, resource_api, mig)
    assert now.count(made_again[3]) == 2 and before not in now
    wait_for(lambda: driver_versions(resource_api) == {"580.105.8"} != old_versions)

    prepared = instance.prepare([whole, mig])
    assert {uid: result.error for uid, result in prepared.items()} == {whole["uid"]: "", mig["uid"]: ""}
    logs = instance.logs()
    assert "already prepared, checked" in logs and "the NVIDIA driver answers again" in logs
    assert "Traceback" not in logs  # an outage it expects, handled as one
