"""Device health on the real node: an XID 79 injected into a mock GPU (as a person would, with
`fgpu mock fault`) taints that GPU's devices in the slices, kube-scheduler places a new claim on
another GPU, a claim that tolerates the taint still gets it, kubelet (ResourceHealthStatus) shows
the running pod's device unhealthy; `fgpu health clear` clears it all."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import kubernetes
import pytest

from testbed.cluster.node import RealNode
from testbed.node_plugin import NodePlugin
from testbed.workloads import NS, claim_template, pod, unique, wait_running, wait_until
from tests.support.pools import node_slices

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]
XID_TAINT = {"key": "gpu.fgpu.dev/xid", "operator": "Exists", "effect": "NoSchedule"}


def fgpu(plugin: NodePlugin, *args: str) -> None:
    env = {**os.environ, **plugin.extra_env, "NVML": plugin.nvml, "STATE_DIR": str(plugin.state_dir)}
    subprocess.run([sys.executable, "-m", "driver.cli", *args], env=env, check=True, timeout=60)


def start_pod(cluster, node: RealNode, created: list[tuple[str, str]], **template_args) -> str:
    """A pod with an MPS share: shares of one GPU go to several pods, so a second one can ask for
    the GPU the first one holds."""
    client = cluster.api_client()
    name = unique("health")
    template = claim_template(name, "mps.gpu.fgpu.dev", capacity={"memory": "2Gi"}, **template_args)
    kubernetes.utils.create_from_dict(client, template, namespace=NS)
    created.append(("ResourceClaimTemplate", name))
    kubernetes.utils.create_from_dict(client, pod(name, node.name, name), namespace=NS)
    created.append(("Pod", name))
    wait_running(kubernetes.client.CoreV1Api(client), name)
    return name


def gpu_of(resource_api, pod_name: str) -> str:
    claims = resource_api.list_namespaced_resource_claim(NS).items
    (claim,) = [c for c in claims if c.metadata.name.startswith(f"{pod_name}-gpu-")]
    return claim.status.allocation.devices.results[0].device


def tainted_devices(resource_api, node: str) -> set[str]:
    return {d.name for s in node_slices(resource_api, node) for d in s.spec.devices or [] if d.taints}


def device_health(core_api, pod_name: str) -> dict[str, str]:
    statuses = core_api.read_namespaced_pod_status(pod_name, NS).status.container_statuses or []
    return {
        str(resource.resource_id): resource.health
        for status in statuses
        for allocated in status.allocated_resources_status or []
        for resource in allocated.resources or []
    }


@pytest.fixture
def clean_health(node_plugin: NodePlugin) -> Iterator[None]:
    yield
    fgpu(node_plugin, "health", "clear")


def test_an_xid_fences_the_gpu_and_clearing_it_lifts_the_fence(
    cluster,
    real_node,
    node_plugin,
    workloads,
    core_api,
    resource_api,
    clean_health,
):
    running = start_pod(cluster, real_node, workloads)
    share = gpu_of(resource_api, running)
    index = int(share.split("-")[1])
    bad_gpu = f"gpu-{index}"

    injected = time.monotonic()
    fgpu(node_plugin, "mock", "fault", "--gpu", str(index), "xid", "--xid", "79")
    wait_until("the GPU's devices tainted", lambda: share in tainted_devices(resource_api, real_node.name))
    print(f"XID 79 to taint in the apiserver: {time.monotonic() - injected:.2f}s")
    assert {d for d in tainted_devices(resource_api, real_node.name)} == {
        d.name for s in node_slices(resource_api, real_node.name) for d in s.spec.devices or []
        if d.name == bad_gpu or d.name.startswith(f"{bad_gpu}-")
    }  # fmt: skip
    health = wait_until(
        "kubelet reports the device unhealthy",
        lambda: (h := device_health(core_api, running)) and "Unhealthy" in h.values() and h,
    )
    assert any(share in resource_id for resource_id in health), health

    elsewhere = start_pod(cluster, real_node, workloads)
    assert gpu_of(resource_api, elsewhere) != share  # kube-scheduler keeps off the tainted GPU
    tolerant = start_pod(
        cluster, real_node, workloads,
        selector=f'device.attributes["gpu.fgpu.dev"].index == {index}', tolerations=[XID_TAINT],
    )  # fmt: skip
    assert gpu_of(resource_api, tolerant) == share  # the pod that tolerates the fault gets the GPU

    fgpu(node_plugin, "health", "clear")
    wait_until("the taints gone", lambda: not tainted_devices(resource_api, real_node.name))
    wait_until(
        "kubelet reports the device healthy", lambda: set(device_health(core_api, running).values()) == {"Healthy"}
    )
