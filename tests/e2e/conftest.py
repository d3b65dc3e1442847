"""Fixtures of the end-to-end tests: the plugin on the module's real node, what a test created,
two fake nodes with plugins, kubelet stand-ins and a controller."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator

import kubernetes
import pytest

from testbed.cluster.harness import free_port
from testbed.cluster.kubelet_standin import KubeletStandIn
from testbed.cluster.node import RealNode
from testbed.node_plugin import NodePlugin
from testbed.plugin_process import PluginUnderTest
from testbed.workloads import NS, wait_for, wait_until
from tests.support.controller import CONTROLLER, ControlledNodes, running_controller
from tests.support.pools import complete_pool, serving


@pytest.fixture(scope="module")
def node_plugin(real_node: RealNode, cluster) -> Iterator[NodePlugin]:
    resource_api = kubernetes.client.ResourceV1Api(cluster.api_client())
    plugin = NodePlugin.on(real_node)
    # Shares inside 3g partitions too (not offered by default): each is a device per placement.
    plugin.extra_args += ["--offer=whole,mig,mps,timeslice,mig-mps", "--mig-share-profiles=3g.40gb"]
    with serving(plugin, resource_api):
        yield plugin


@pytest.fixture
def workloads(core_api, resource_api, cluster) -> Iterator[list[tuple[str, str]]]:
    """(kind, name) of what a test created; deleted afterwards, pods waited for."""
    created: list[tuple[str, str]] = []
    yield created
    apps = kubernetes.client.AppsV1Api(cluster.api_client())
    for kind, name in reversed(created):
        try:
            if kind == "Pod":
                core_api.delete_namespaced_pod(name, NS, grace_period_seconds=1)
            elif kind == "Deployment":
                apps.delete_namespaced_deployment(name, NS, propagation_policy="Foreground")
            elif kind == "ResourceClaimTemplate":
                resource_api.delete_namespaced_resource_claim_template(name, NS)
        except kubernetes.client.ApiException as err:
            if err.status != 404:
                raise
    wait_until("test pods gone", lambda: not _pods_with_claims(core_api), timeout_s=120)


def _pods_with_claims(core) -> list:
    return [p for p in core.list_namespaced_pod(NS).items if p.spec.resource_claims]


CONTROLLED = ("node-a", "node-b")  # the stand-in nodes of `controlled_nodes`


@pytest.fixture
def controller(cluster, namespace) -> Iterator[subprocess.Popen]:
    """`fgpu controller` for a module's `namespace` fixture (its lease there); modules with a
    controller of their own define this fixture themselves."""
    with running_controller(cluster.kubeconfig, f"--lease-namespace={namespace}") as process:
        yield process


@pytest.fixture(scope="module")
def controlled_nodes(cluster) -> Iterator[ControlledNodes]:
    """Plugins and kubelet stand-ins on node-a and node-b, and one first-fit controller (the
    controller's choices are then upstream's order: node-a first) serving its metrics."""
    resource_api = kubernetes.client.ResourceV1Api(cluster.api_client())
    plugins, kubelets = [], {}
    controller: subprocess.Popen[bytes] | None = None
    try:  # whatever started is stopped, also when a later start fails
        for node in CONTROLLED:
            plugin = PluginUnderTest(node=node, kubeconfig=str(cluster.kubeconfig)).start()
            plugins.append(plugin)
            kubelets[node] = KubeletStandIn(node, str(cluster.kubeconfig), plugin.registrar_dir).start()
        metrics_port = free_port()
        controller = subprocess.Popen(
            [
                *CONTROLLER,
                f"--kubeconfig={cluster.kubeconfig}",
                "--lease-namespace=default",
                "--policy=first-fit",
                f"--metrics-port={metrics_port}",
            ]
        )
        for node in kubelets:
            wait_for(lambda n=node: complete_pool(resource_api, n))
        yield ControlledNodes(kubelets, metrics_port)
    finally:
        if controller is not None:
            controller.terminate()
            controller.wait(timeout=15)
        for kubelet in kubelets.values():
            kubelet.stop()
        for plugin in plugins:
            plugin.stop()
            shutil.rmtree(plugin.root, ignore_errors=True)
        _forget_controlled_nodes(cluster, resource_api)  # once nothing publishes them again


def _forget_controlled_nodes(cluster, resource_api: kubernetes.client.ResourceV1Api) -> None:
    """No pod (it would wait for a kubelet forever) and no slice of the stand-in nodes outlives the
    module: later modules' schedulers and controllers must not place anything there."""
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    for node in CONTROLLED:
        for found in core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}").items:
            with contextlib.suppress(kubernetes.client.ApiException):
                core.delete_namespaced_pod(found.metadata.name, found.metadata.namespace, grace_period_seconds=0)
        for found in resource_api.list_resource_slice(field_selector=f"spec.nodeName={node}").items:
            with contextlib.suppress(kubernetes.client.ApiException):
                resource_api.delete_resource_slice(found.metadata.name)
