"""The NVIDIA driver unloaded under the running plugin process and loaded again, an upgrade (with
`fgpu mock driver`, as a person would): the plugin keeps serving, taints every device in the
slices the real apiserver holds, refuses prepares with a clear error, and once the driver is back
makes the prepared MIG claim's instance again, untaints and publishes the new driver version."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import kubernetes
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from driver.node.kubelet.liveness import READY_SERVICE
from driver.nvml.machine import load_machine
from driver.nvml.mock import MockNvml
from driver.nvml.session import MOCK_STATE_ENV, NvmlSession
from testbed.claims_api import create_claim
from testbed.cluster.harness import free_port
from testbed.cluster.host_state import short_temp_dir
from testbed.plugin_process import PluginUnderTest
from testbed.workloads import pod_events, unique, wait_for
from tests.support.cli import fgpu
from tests.support.pools import node_slices

pytestmark = pytest.mark.cluster
NODE = "node-driver"
DEVICES = 8 * 26  # the whole GPU and 25 MIG placements of each of 8 H100s
NEW_VERSION = "580.105.08"
NS = "default"
RETRY = "gpu.fgpu.dev/prepare-retry"


@pytest.fixture(scope="module", autouse=True)
def node_forgotten(cluster) -> Iterator[None]:
    """The fake node and its slices go with the module: no later module's scheduler or controller
    may place anything there (nothing publishes them again: the plugins of each test are stopped)."""
    yield
    core, resource = (
        kubernetes.client.CoreV1Api(cluster.api_client()),
        kubernetes.client.ResourceV1Api(cluster.api_client()),
    )
    with contextlib.suppress(kubernetes.client.ApiException):
        core.delete_node(NODE)
    for found in node_slices(resource, NODE):
        with contextlib.suppress(kubernetes.client.ApiException):
            resource.delete_resource_slice(found.metadata.name)


@pytest.fixture
def plugin(cluster, core_api, start_plugin) -> Iterator[tuple[PluginUnderTest, dict[str, str]]]:
    yield registered_plugin(cluster, core_api, start_plugin, short_temp_dir("driver"))


def registered_plugin(
    cluster, core_api, start_plugin, root: str, *flags: str
) -> tuple[PluginUnderTest, dict[str, str]]:
    """The plugin on NODE with its state under `root`, registered as kubelet does."""
    if not core_api.list_node(field_selector=f"metadata.name={NODE}").items:
        cluster.add_node(NODE)
    mock_env = {MOCK_STATE_ENV: str(Path(root) / "gpus.json"), "NVML": "mock:dgx-h100"}
    instance = start_plugin(node=NODE, root=root, extra_env=mock_env, extra_args=["--offer=whole,mig", *flags])
    instance.register()
    return instance, mock_env


@pytest.fixture
def pod_using(core_api, resource_api) -> Iterator[Callable[[dict[str, str]], str]]:
    """Makes a pod bound to the node (no kubelet runs it: it stays Pending) that the claim is
    reserved for, as kube-scheduler leaves it; deleted afterwards."""
    made = []

    def make(claim: dict[str, str]) -> str:
        name = unique("waiting")
        container = {"name": "main", "image": "registry.invalid/cuda:12", "resources": {"claims": [{"name": "gpu"}]}}
        spec = {
            "nodeName": NODE,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim["name"]}],
            "containers": [container],
        }
        created = core_api.create_namespaced_pod(NS, {"metadata": {"name": name}, "spec": spec})
        made.append(name)
        reserved = {"status": {"reservedFor": [{"resource": "pods", "name": name, "uid": created.metadata.uid}]}}
        resource_api.patch_namespaced_resource_claim_status(claim["name"], claim["namespace"], reserved)
        return name

    yield make
    for name in made:
        core_api.delete_namespaced_pod(name, NS, grace_period_seconds=0)


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


def test_the_driver_unloaded_and_upgraded_under_the_running_plugin(plugin, core_api, resource_api, pod_using):
    instance, mock_env = plugin
    state_file = mock_env[MOCK_STATE_ENV]
    wait_for(lambda: len(devices(resource_api)) == DEVICES)
    old_versions = driver_versions(resource_api)
    mig = create_claim(resource_api, devices=[("gpu", "gpu-2-mig-1g10gb-3")], pool=NODE)
    assert instance.prepare([mig])[mig["uid"]].error == ""
    before = mig_uuids(state_file, 2)[3]
    assert recorded(instance, resource_api, mig).count(before) == 2

    fgpu("mock", "driver", "unload", "--state-dir", str(instance.state_dir), env=mock_env)
    wait_for(lambda: len(driver_tainted(resource_api)) == DEVICES)
    whole = create_claim(resource_api, devices=[("gpu", "gpu-4")], pool=NODE)
    refused = instance.prepare([whole, mig])
    for claim in (whole, mig):
        error = refused[claim["uid"]].error
        assert f"claim default/{claim['name']} (uid {claim['uid']})" in error
        assert "the NVIDIA driver is not loaded on this node" in error and "Driver Not Loaded" in error
    waiting = pod_using(whole)  # kubelet would retry it only at its next pod sync
    assert instance.process.poll() is None and instance.health() == health_pb2.HealthCheckResponse.SERVING
    assert recorded(instance, resource_api, mig).count(before) == 2  # nothing released while it cannot be checked

    fgpu("mock", "driver", "load", "--version", NEW_VERSION, env=mock_env)
    wait_for(lambda: not driver_tainted(resource_api))
    made_again = mig_uuids(state_file, 2)
    assert set(made_again) == {3} and made_again[3] != before  # made again at its placement before the untaint
    now = recorded(instance, resource_api, mig)
    assert now.count(made_again[3]) == 2 and before not in now
    wait_for(lambda: driver_versions(resource_api) == {"580.105.8"} != old_versions)
    # The pod waiting for the unprepared claim is annotated, so that kubelet syncs it now.
    wait_for(lambda: RETRY in (core_api.read_namespaced_pod(waiting, NS).metadata.annotations or {}))
    events = " ".join(pod_events(core_api, waiting))
    assert f"PrepareRetried: the NVIDIA driver on node {NODE} is loaded again: asked kubelet" in events

    prepared = instance.prepare([whole, mig])
    assert {uid: result.error for uid, result in prepared.items()} == {whole["uid"]: "", mig["uid"]: ""}
    logs = instance.logs()
    assert "already prepared, checked" in logs and "the NVIDIA driver answers again" in logs
    assert "Traceback" not in logs  # an outage it expects, handled as one


def test_a_pod_that_met_no_plugin_is_retried_once_kubelet_registers_it_unless_turned_off(
    cluster, core_api, resource_api, start_plugin, pod_using
):
    if not core_api.list_node(field_selector=f"metadata.name={NODE}").items:
        cluster.add_node(NODE)
    claim = create_claim(resource_api, devices=[("gpu", "gpu-5")], pool=NODE)
    waiting = pod_using(claim)  # kubelet met no plugin for it
    root = short_temp_dir("retry")
    off, _ = registered_plugin(cluster, core_api, start_plugin, root, "--no-retry-waiting-pods")
    time.sleep(2)  # with retries on, the annotation comes within a few hundred ms of the registration
    assert RETRY not in (core_api.read_namespaced_pod(waiting, NS).metadata.annotations or {})
    off.stop()

    registered_plugin(cluster, core_api, start_plugin, root)
    wait_for(lambda: RETRY in (core_api.read_namespaced_pod(waiting, NS).metadata.annotations or {}))
    why = "PrepareRetried: the gpu.fgpu.dev plugin is registered with kubelet"
    said = f"{why}: asked kubelet to prepare claim(s) {claim['name']} now"
    wait_for(lambda: said in " ".join(pod_events(core_api, waiting)))  # the Event follows the annotation


def health_on(port: int, service: str = "") -> int:
    """What the chart's probes see on the health port (liveness: "", readiness: registered)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


def test_a_plugin_started_before_the_driver_waits_for_it_alive_and_not_ready(
    cluster, core_api, resource_api, start_plugin
):
    """A DaemonSet pod starting before the GPU operator's driver container has loaded the driver
    does not exit (its container would be restarted with a back-off of up to 5 minutes): it waits,
    alive for the liveness probe and not Ready, then starts once NVML answers."""
    if not core_api.list_node(field_selector=f"metadata.name={NODE}").items:
        cluster.add_node(NODE)
    root = short_temp_dir("nodriver")
    mock_env = {MOCK_STATE_ENV: str(Path(root) / "gpus.json"), "NVML": "mock:dgx-h100"}
    fgpu("mock", "driver", "unload", "--state-dir", str(Path(root) / "plugin"), env=mock_env)
    port = free_port()
    instance = start_plugin(node=NODE, root=root, extra_env=mock_env, extra_args=[f"--healthcheck-port={port}"],
                            wait=False)  # fmt: skip
    wait_for(lambda: "the NVIDIA driver is not loaded" in instance.logs())
    wait_for(lambda: health_on(port) == health_pb2.HealthCheckResponse.SERVING)
    assert health_on(port, READY_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
    time.sleep(2)  # a poll or two later, still waiting
    assert instance.process.poll() is None and not instance.registration_socket.exists()

    fgpu("mock", "driver", "load", env=mock_env)
    instance.wait_for_sockets()
    instance.register()
    wait_for(lambda: health_on(port, READY_SERVICE) == health_pb2.HealthCheckResponse.SERVING)
    wait_for(lambda: len(devices(resource_api)) > 0)
    assert "the NVIDIA driver answers: starting" in instance.logs()


def test_a_plugin_waiting_for_the_driver_stops_on_sigterm(cluster, start_plugin):
    root = short_temp_dir("nodriver")
    mock_env = {MOCK_STATE_ENV: str(Path(root) / "gpus.json"), "NVML": "mock:dgx-h100"}
    fgpu("mock", "driver", "unload", "--state-dir", str(Path(root) / "plugin"), env=mock_env)
    instance = start_plugin(node=NODE, root=root, extra_env=mock_env, wait=False)
    wait_for(lambda: "the NVIDIA driver is not loaded" in instance.logs())
    assert instance.stop(signal.SIGTERM) == 0
