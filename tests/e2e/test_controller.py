"""End to end: `fgpu controller` (two replicas, one leads) allocates opt-in claims and gangs on
the real control plane; kube-scheduler binds the gated pods once it lifts the gate, and the
plugin prepares them.

The kubelet stand-in prepares here, not a real kubelet: gangs need several nodes, and a machine
holds one real node (kubelet's cgroups and hard-coded paths are the host's)."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest

from testbed.cluster.kubelet_standin import KubeletStandIn
from testbed.workloads import wait_for
from tests.support.controller import CONTROLLER, gang_claim, gated_pod
from tests.support.pools import complete_pool

pytestmark = pytest.mark.cluster


@pytest.fixture
def two_nodes(start_plugin, cluster, resource_api) -> Iterator[dict[str, KubeletStandIn]]:
    kubelets = {}
    for node in ("node-a", "node-b"):
        plugin = start_plugin(node=node)
        kubelets[node] = KubeletStandIn(node, str(cluster.kubeconfig), plugin.registrar_dir).start()
    try:
        for node in kubelets:
            wait_for(lambda n=node: complete_pool(resource_api, n))
        yield kubelets
    finally:
        for kubelet in kubelets.values():
            kubelet.stop()


@pytest.fixture
def controllers(cluster) -> Iterator[list[subprocess.Popen]]:
    replicas = [
        subprocess.Popen(
            [*CONTROLLER, f"--kubeconfig={cluster.kubeconfig}", "--lease-namespace=default", f"--identity=replica-{i}"],
        )
        for i in range(2)
    ]
    yield replicas
    for replica in replicas:
        replica.terminate()
        replica.wait(timeout=15)


def test_gang_is_placed_whole_across_nodes_and_pods_run(two_nodes, controllers, resource_api, core_api, cluster):
    suffix = uuid.uuid4().hex[:6]
    names = [f"worker-{suffix}-{i}" for i in range(4)]
    for name in names:
        resource_api.create_namespaced_resource_claim("default", gang_claim(name, f"train-{suffix}", 4, gpus=3))
        core_api.create_namespaced_pod("default", gated_pod(name, name))

    def allocations() -> dict[str, Any] | None:
        claims = {n: resource_api.read_namespaced_resource_claim(n, "default") for n in names}
        if any(c.status is None or c.status.allocation is None for c in claims.values()):
            return None
        return claims

    claims = wait_for(allocations, timeout=60)
    nodes = {n: c.status.allocation.devices.results[0].pool for n, c in claims.items()}
    assert sorted(nodes.values()) == ["node-a", "node-a", "node-b", "node-b"]  # 3 + 3 GPUs fit a node, 9 do not
    devices = [(r.pool, r.device) for c in claims.values() for r in c.status.allocation.devices.results]
    assert len(devices) == len(set(devices)) == 12

    for name in names:  # gates lifted; kube-scheduler binds each pod where its claim was allocated
        pod = wait_for(
            lambda n=name: (p := core_api.read_namespaced_pod(n, "default")).spec.node_name and p, timeout=30
        )
        assert not pod.spec.scheduling_gates
        assert pod.spec.node_name == nodes[name]
        wait_for(lambda p=pod: p.metadata.uid in two_nodes[p.spec.node_name].prepared, timeout=30)

    lease = kubernetes.client.CoordinationV1Api(cluster.api_client()).read_namespaced_lease(
        "fgpu-controller", "default"
    )
    assert lease.spec.holder_identity in ("replica-0", "replica-1")

    for name in names:
        core_api.delete_namespaced_pod(name, "default")
        resource_api.delete_namespaced_resource_claim(name, "default")


def test_gang_that_cannot_fit_allocates_nothing_and_says_why(two_nodes, controllers, resource_api, core_api):
    suffix = uuid.uuid4().hex[:6]
    names = [f"huge-{suffix}-{i}" for i in range(3)]
    for name in names:
        resource_api.create_namespaced_resource_claim("default", gang_claim(name, f"huge-{suffix}", 3, gpus=8))

    def failure_events() -> list[Any]:
        events = core_api.list_namespaced_event("default", field_selector=f"involvedObject.name={names[0]}").items
        return [e for e in events if e.reason == "FailedAllocation"]

    (event, *_) = wait_for(failure_events, timeout=60)
    assert "gang cannot be placed whole" in event.message
    assert "no device of class gpu.fgpu.dev free on any one node" in event.message
    for name in names:
        assert resource_api.read_namespaced_resource_claim(name, "default").status.allocation is None
        resource_api.delete_namespaced_resource_claim(name, "default")
