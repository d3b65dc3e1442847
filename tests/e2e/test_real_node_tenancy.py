"""End to end on the real node: two namespaces' MPS pods (issue 38, findings 1-4). Each namespace's
shares get a daemon of their own; a tenant's container has no control tool and a read-only pipe
directory, so its worst (a `quit` through the socket it can reach) ends its own daemon only, and
the other namespace's MPS work goes on; a claim of another namespace on a tenant's GPU is refused
at prepare, whichever scheduler allocated it.

The mock daemon listens on a filesystem socket `control` in the pipe directory, as the real one
does. The test image (busybox) has no MPS client, so the tenant's `quit` is sent from the host
through the socket its container mounts (its GPU's pipe directory, the only one it sees)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import kubernetes
import pytest
from kubernetes.stream import stream

from driver.node.settings import MOCK_DRIVER_ROOT
from testbed.node_plugin import NodePlugin
from testbed.workloads import (
    claim_template,
    delete_namespaces,
    pod,
    pod_events,
    report,
    unique,
    wait_running,
    wait_until,
)

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]

ON_GPU = 'device.attributes["gpu.fgpu.dev"].index == {}'


@pytest.fixture
def tenants(core_api) -> Iterator[tuple[str, str]]:
    names = (unique("tenant-a"), unique("tenant-b"))
    for name in names:
        core_api.create_namespace({"metadata": {"name": name}})
    try:
        yield names
    finally:
        delete_namespaces(core_api, list(names))


def mps_pod(cluster, namespace: str, node: str, gpu: int) -> str:
    template = claim_template(unique("tpl"), "mps.gpu.fgpu.dev", selector=ON_GPU.format(gpu),
                              capacity={"memory": "2Gi", "compute": "10"})  # fmt: skip
    name = unique("pod")
    client = cluster.api_client()
    kubernetes.utils.create_from_dict(client, template, namespace=namespace)
    kubernetes.utils.create_from_dict(client, pod(name, node, template["metadata"]["name"]), namespace=namespace)
    return name


def run_in(core_api, name: str, namespace: str, command: str) -> str:
    return stream(core_api.connect_get_namespaced_pod_exec, name, namespace, command=["sh", "-c", command],
                  stderr=True, stdin=False, stdout=True, tty=False)  # fmt: skip


def control(plugin: NodePlugin, gpu: int, command: str) -> subprocess.CompletedProcess[str]:
    """`echo <command> | nvidia-cuda-mps-control` at the GPU's pipe directory."""
    uuid = plugin.gpus().describe(gpu).uuid
    tool = plugin.state_dir / MOCK_DRIVER_ROOT / "usr" / "bin" / "nvidia-cuda-mps-control"
    environment = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(plugin.state_dir / "mps" / uuid / "pipe")}
    return subprocess.run([str(tool)], input=command + "\n", capture_output=True, text=True, env=environment,
                          timeout=30, check=False)  # fmt: skip


def test_one_namespaces_quit_leaves_the_other_namespaces_mps_work_running(
    cluster, core_api, real_node, node_plugin, tenants
):
    team_a, team_b = tenants
    a = mps_pod(cluster, team_a, real_node.name, gpu=0)
    b = mps_pod(cluster, team_b, real_node.name, gpu=1)
    wait_running(core_api, a, team_a)
    wait_running(core_api, b, team_b)
    uuid_b = node_plugin.gpus().describe(1).uuid
    assert f"cuda.shm.fgpu-mps-{uuid_b}" in report(core_api, b, team_b).shm  # its daemon's segment

    # The tenant's container: no control tool, and nothing in the pipe directory it can replace.
    assert "/usr/bin/nvidia-cuda-mps-control" not in report(core_api, a, team_a).mounts
    tried = run_in(core_api, a, team_a, "touch /tmp/nvidia-mps/x; rm -f /tmp/nvidia-mps/control; "
                   "mkfifo /tmp/nvidia-mps/nvidia-cuda-mps-control.pid; ls /tmp/nvidia-mps")  # fmt: skip
    assert tried.count("Read-only file system") >= 2 and "control" in tried.split(), tried

    # Its worst: quit the daemon its socket reaches, its own GPU's.
    assert control(node_plugin, 0, "quit").returncode == 0

    # The other namespace's MPS work goes on: its daemon answers, its segment is where it was.
    assert control(node_plugin, 1, "get_default_active_thread_percentage").stdout.strip() == "100"
    assert f"cuda.shm.fgpu-mps-{uuid_b}" in run_in(core_api, b, team_b, "ls /dev/shm").split()
    assert core_api.read_namespaced_pod(b, team_b).status.phase == "Running"

    # kube-scheduler allocates team-b a share of team-a's GPU; prepare refuses it, and says why.
    intruder = mps_pod(cluster, team_b, real_node.name, gpu=0)
    wait_until(
        "the intruder's prepare refused",
        lambda: any("shared by another tenant's claims" in e for e in pod_events(core_api, intruder, team_b)),
    )
    assert core_api.read_namespaced_pod(intruder, team_b).status.phase == "Pending"
