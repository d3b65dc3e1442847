"""Device health end to end on the plugin process: a fault injected into the mock GPUs (with the
`fgpu mock fault` command, as a person would) reaches kubelet's health stream and the published
slices as taints that the real apiserver accepts; `fgpu health clear` takes them away."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from driver.node.kubelet.api import (
    dra_health_v1_pb2,
    dra_health_v1_pb2_grpc,
    dra_health_v1alpha1_pb2,
    dra_health_v1alpha1_pb2_grpc,
)
from driver.nvml.session import MOCK_STATE_ENV
from testbed.cluster.host_state import short_temp_dir
from testbed.plugin_process import PluginUnderTest
from testbed.workloads import wait_for
from tests.support.cli import fgpu
from tests.support.pools import node_slices

pytestmark = pytest.mark.cluster
NODE = "node-health"
PER_GPU = 26  # the whole GPU and 25 MIG placements of an H100


@pytest.fixture
def plugin(cluster, core_api, start_plugin) -> Iterator[tuple[PluginUnderTest, dict[str, str]]]:
    if not core_api.list_node(field_selector=f"metadata.name={NODE}").items:
        cluster.add_node(NODE)
    root = short_temp_dir("health")
    mock_env = {MOCK_STATE_ENV: str(Path(root) / "gpus.json"), "NVML": "mock:dgx-h100"}
    yield start_plugin(node=NODE, root=root, extra_env=mock_env, extra_args=["--offer=whole,mig"]), mock_env


def tainted(resource_api) -> dict[str, list[tuple[str, str, str]]]:
    devices = [d for s in node_slices(resource_api, NODE) for d in s.spec.devices or []]
    return {d.name: [(t.key, t.value, t.effect) for t in d.taints] for d in devices if d.taints}


def test_an_injected_xid_reaches_kubelet_and_the_slices_until_cleared(plugin, resource_api):
    instance, mock_env = plugin
    channel = grpc.insecure_channel(f"unix://{instance.dra_socket}")
    stream = dra_health_v1_pb2_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
        dra_health_v1_pb2.NodeWatchResourcesRequest(), timeout=60
    )
    unhealthy = dra_health_v1_pb2.HealthStatus.Value("UNHEALTHY")
    try:
        first = next(stream)
        assert len(first.devices) == 8 * PER_GPU
        assert {d.health for d in first.devices} == {dra_health_v1_pb2.HealthStatus.Value("HEALTHY")}
        assert {d.device.pool_name for d in first.devices} == {NODE} and first.devices[0].health_check_timeout_seconds

        fgpu("mock", "fault", "--gpu", "4", "xid", "--xid", "79", env=mock_env)
        fgpu("mock", "fault", "--gpu", "6", "xid", "--xid", "13", env=mock_env)  # an application's error
        report = next(r for r in stream if any(d.health == unhealthy for d in r.devices))
        bad = {d.device.device_name: d.message for d in report.devices if d.health == unhealthy}
        assert len(bad) == PER_GPU and all(n == "gpu-4" or n.startswith("gpu-4-mig-") for n in bad)
        assert bad["gpu-4"] == "XID 79"  # and nothing of GPU 6: XID 13 is the application's
        # A GPU's devices span slices, which are written one at a time: wait for all of them.
        taints = wait_for(lambda: (found := tainted(resource_api)) and set(found) == set(bad) and found)
        assert taints["gpu-4"] == [("gpu.fgpu.dev/xid", "79", "NoSchedule")]

        fgpu("health", "clear", "--state-dir", str(instance.state_dir), env={})
        healed = next(r for r in stream if not any(d.health == unhealthy for d in r.devices))
        assert len(healed.devices) == 8 * PER_GPU
        wait_for(lambda: not tainted(resource_api))
    finally:
        stream.cancel()
        channel.close()


def test_kubelet_of_the_v1alpha1_era_gets_the_same_stream(plugin):
    instance, _ = plugin
    with grpc.insecure_channel(f"unix://{instance.dra_socket}") as channel:
        stream = dra_health_v1alpha1_pb2_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
            dra_health_v1alpha1_pb2.NodeWatchResourcesRequest(), timeout=30
        )
        first = next(stream)
        stream.cancel()
    assert len(first.devices) == 8 * PER_GPU and first.devices[0].device.device_name == "gpu-0"


def test_without_the_monitor_kubelet_is_offered_no_health_stream(start_plugin, resource_api):
    instance = start_plugin(extra_args=["--no-health-monitor"])
    assert list(instance.register().supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    with grpc.insecure_channel(f"unix://{instance.dra_socket}") as channel:
        stream = dra_health_v1_pb2_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
            dra_health_v1_pb2.NodeWatchResourcesRequest(), timeout=10
        )
        with pytest.raises(grpc.RpcError) as refused:
            next(stream)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
