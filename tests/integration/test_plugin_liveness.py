"""The health service of a real `fgpu kubelet-plugin` process, as a DaemonSet's livenessProbe
(grpc, on the TCP health port) and kubelet's socket see it: SERVING only while kubelet can reach
and use the plugin."""

from __future__ import annotations

import signal
import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from driver.node.kubelet.api import dra_v1_pb2, dra_v1_pb2_grpc
from driver.node.kubelet.api import pluginregistration_v1_pb2 as reg_pb
from driver.node.kubelet.api import pluginregistration_v1_pb2_grpc as reg_grpc
from driver.node.kubelet.liveness import CHECK_INTERVAL_S, READY_SERVICE
from testbed.plugin_process import PluginUnderTest
from testbed.workloads import wait_for

pytestmark = pytest.mark.cluster

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def check(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def statuses(plugin: PluginUnderTest, port: int) -> tuple[int, int]:
    """What kubelet's side (the DRA socket) and the livenessProbe (the TCP port) are told."""
    return check(f"unix://{plugin.dra_socket}"), check(f"127.0.0.1:{port}")


def start(start_plugin, grace_s: float) -> tuple[PluginUnderTest, int]:
    """The plugin, once its health port accepts connections (it opens after the sockets)."""
    port = free_port()
    plugin = start_plugin(extra_args=[f"--registration-grace={grace_s}", f"--healthcheck-port={port}"])
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
    return plugin, port


def test_serving_once_registered_and_after_the_grace(start_plugin):
    # A grace long enough that a loaded machine registers the plugin within it (kubelet does in
    # well under a second): the test is about what comes after it.
    plugin, port = start(start_plugin, grace_s=5)
    plugin.register()
    plugin.register()  # kubelet restarted and registered the plugin again
    time.sleep(5 + 2 * CHECK_INTERVAL_S)  # past the grace, evaluated since
    assert statuses(plugin, port) == (SERVING, SERVING)
    assert "NOT_SERVING" not in plugin.logs()


def test_not_serving_once_the_registration_socket_is_deleted(start_plugin):
    plugin, port = start(start_plugin, grace_s=60)
    plugin.register()
    assert statuses(plugin, port) == (SERVING, SERVING)
    plugin.registration_socket.unlink()  # kubelet can no longer find the plugin
    wait_for(lambda: statuses(plugin, port) == (NOT_SERVING, NOT_SERVING), timeout=15)
    assert f"socket {plugin.registration_socket} was deleted" in plugin.logs()
    assert plugin.process is not None and plugin.process.poll() is None  # the probe, not the plugin, decides


def test_not_serving_after_the_grace_until_kubelet_registers(start_plugin):
    plugin, port = start(start_plugin, grace_s=2)
    wait_for(lambda: statuses(plugin, port) == (NOT_SERVING, NOT_SERVING), timeout=15)  # nobody registered it
    assert "kubelet has not registered the plugin for" in plugin.logs()
    plugin.register()
    wait_for(lambda: statuses(plugin, port) == (SERVING, SERVING), timeout=15)

    with grpc.insecure_channel(f"unix://{plugin.registration_socket}") as channel:
        failed = reg_pb.RegistrationStatus(plugin_registered=False, error="endpoint already registered")
        reg_grpc.RegistrationStub(channel).NotifyRegistrationStatus(failed, timeout=5)
    wait_for(lambda: statuses(plugin, port) == (NOT_SERVING, NOT_SERVING), timeout=15)  # a new grace, expired
    assert "(last failure: endpoint already registered)" in plugin.logs()


def test_ready_once_kubelet_registered_it_and_no_longer_on_sigterm(start_plugin):
    """The readinessProbe's service: a rolling update's new pod is Ready, and the old one stopped,
    only once kubelet registered it; alive (liveness) meanwhile."""
    plugin, port = start(start_plugin, grace_s=60)

    def ready() -> int:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            request = health_pb2.HealthCheckRequest(service=READY_SERVICE)
            return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status

    assert (check(f"127.0.0.1:{port}"), ready()) == (SERVING, NOT_SERVING)
    plugin.register()
    assert ready() == SERVING  # at kubelet's NotifyRegistrationStatus, not a second later
    assert plugin.process is not None
    plugin.process.send_signal(signal.SIGTERM)
    wait_for(lambda: ready() == NOT_SERVING, timeout=5)  # while it drains, before it exits


def test_the_health_port_serves_health_only(start_plugin):
    """With hostNetwork the TCP port is open to the node's network: no NodePrepareResources there."""
    _, port = start(start_plugin, grace_s=60)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = dra_v1_pb2_grpc.DRAPluginStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.NodePrepareResources(dra_v1_pb2.NodePrepareResourcesRequest(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert check(f"127.0.0.1:{port}") in (SERVING, NOT_SERVING)
