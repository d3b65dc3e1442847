"""Pods without claims placed by fgpu (`fgpu controller --place-pods`, docs/allocator.md "Pods without
claims on GPU nodes"), on the real control plane: `fgpu webhook` behind kube-apiserver with the
chart's own rule (its namespaceSelector and matchConditions; only the address is the test's) gates
a claimless pod of a namespace labelled gpu.fgpu.dev/place-pods=fgpu; the controller (first-fit:
node-a before node-b) pins it to node-a and lifts the gate in one patch, although kube-scheduler's
LeastAllocated would have taken node-b (node-a half full); kube-scheduler binds it there and the
kubelet stand-in runs it. A pod of a namespace without the label, and a pod bound already, are not
gated."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import kubernetes
import pytest
from kubernetes.client import AdmissionregistrationV1Api, ApiException

from testbed.cluster.harness import Cluster, free_port
from testbed.cluster.kubelet_standin import KubeletStandIn
from testbed.plugin_process import PluginUnderTest
from testbed.workloads import wait_for
from tests.support.chart import find, render
from tests.support.controller import running_controller
from tests.support.pools import complete_pool
from tests.support.webhook import pointed_at_host, serve_webhook

pytestmark = pytest.mark.cluster
NODES = ("node-a", "node-b")
GATE = "gpu.fgpu.dev/allocation"


@dataclass(frozen=True)
class Placing:
    opted_in: str  # a namespace labelled gpu.fgpu.dev/place-pods=fgpu
    plain: str  # one without the label
    kubelets: dict[str, KubeletStandIn]


def configuration(cluster: Cluster, port: int, name: str) -> dict[str, Any]:
    """The chart's rule for pods without claims alone, at this host's webhook, failurePolicy Fail (a
    pod created in the labelled namespace was answered, or never sent)."""
    assert cluster.pki is not None
    values = {"controller.placePods.enabled": True, "webhook.gatePods.enabled": False,
              "webhook.gatePods.failurePolicy": "Fail"}  # fmt: skip
    return pointed_at_host(find(render(values), "MutatingWebhookConfiguration"), cluster, port, "/place-pods", name)


@pytest.fixture(scope="module")
def placing(cluster: Cluster) -> Iterator[Placing]:
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    resource = kubernetes.client.ResourceV1Api(cluster.api_client())
    admission = AdmissionregistrationV1Api(cluster.api_client())
    suffix = uuid.uuid4().hex[:6]
    opted_in, plain, config = f"placed-{suffix}", f"plain-{suffix}", f"fgpu-placing-{suffix}"
    plugins, kubelets = [], {}
    webhook: subprocess.Popen[bytes] | None = None
    with contextlib.ExitStack() as stack:
        try:
            for node in NODES:
                plugin = PluginUnderTest(node=node, kubeconfig=str(cluster.kubeconfig)).start()
                plugins.append(plugin)
                kubelets[node] = KubeletStandIn(node, str(cluster.kubeconfig), plugin.registrar_dir).start()
            core.create_namespace({"metadata": {"name": opted_in, "labels": {"gpu.fgpu.dev/place-pods": "fgpu"}}})
            core.create_namespace({"metadata": {"name": plain}})
            port = free_port()
            webhook = serve_webhook(cluster, port, "placing-webhook")
            admission.create_mutating_webhook_configuration(configuration(cluster, port, config))
            flags = ("--lease-namespace=default", "--policy=first-fit", "--place-pods")
            stack.enter_context(running_controller(cluster.kubeconfig, *flags))
            for node in NODES:
                wait_for(lambda n=node: complete_pool(resource, n))
            yield Placing(opted_in, plain, kubelets)
        finally:
            with contextlib.suppress(ApiException):
                admission.delete_mutating_webhook_configuration(config)
            if webhook is not None:
                webhook.terminate()
                webhook.wait(timeout=10)
            for namespace in (opted_in, plain):
                with contextlib.suppress(ApiException):
                    core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
            for node in NODES:  # nothing of this module is left for later modules' schedulers
                for found in core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}").items:
                    meta = found.metadata
                    with contextlib.suppress(ApiException):
                        core.delete_namespaced_pod(meta.name, meta.namespace, grace_period_seconds=0)
            for namespace in (opted_in, plain):
                with contextlib.suppress(ApiException):
                    core.delete_namespace(namespace)
            for kubelet in kubelets.values():
                kubelet.stop()
            for plugin in plugins:
                plugin.stop()
                shutil.rmtree(plugin.root, ignore_errors=True)
            for node in NODES:
                for found in resource.list_resource_slice(field_selector=f"spec.nodeName={node}").items:
                    with contextlib.suppress(ApiException):
                        resource.delete_resource_slice(found.metadata.name)


def pod(name: str, cpu: str = "1", **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": "registry.invalid/x:1", "resources": {"requests": {"cpu": cpu}}}
    body = {"containers": [container], "terminationGracePeriodSeconds": 1, **spec}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": body}


def gates(found: Any) -> list[str]:
    return [g.name for g in found.spec.scheduling_gates or ()]


def test_a_pod_without_claims_is_gated_pinned_to_the_policys_node_and_runs_there(placing, core_api):
    # node-a half full: kube-scheduler's LeastAllocated would take node-b, first-fit takes node-a.
    core_api.create_namespaced_pod(placing.opted_in, pod("filler", cpu="32", nodeName="node-a"))
    created = core_api.create_namespaced_pod(placing.opted_in, pod("web-1"))
    assert gates(created) == [GATE]  # the webhook gated it at create
    running = wait_for(
        lambda: (p := core_api.read_namespaced_pod("web-1", placing.opted_in)).status.phase == "Running" and p,
        timeout=60,
    )
    assert running.spec.node_name == "node-a" and gates(running) == []
    terms = running.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
    assert [[(f.key, f.operator, f.values) for f in t.match_fields] for t in terms] == [
        [("metadata.name", "In", ["node-a"])]
    ]


def test_the_pods_own_node_affinity_is_narrowed_as_kube_apiserver_allows(placing, core_api):
    gpus = {"matchExpressions": [{"key": "nvidia.com/gpu.present", "operator": "Exists"}]}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [gpus]}}}
    core_api.create_namespaced_pod(placing.opted_in, pod("web-2", affinity=affinity))
    bound = wait_for(lambda: (p := core_api.read_namespaced_pod("web-2", placing.opted_in)).spec.node_name and p)
    [term] = bound.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
    assert [(e.key, e.operator) for e in term.match_expressions] == [("nvidia.com/gpu.present", "Exists")]
    assert [(f.key, f.values) for f in term.match_fields] == [("metadata.name", [bound.spec.node_name])]


def test_pods_the_rule_leaves_alone_are_not_gated(placing, core_api):
    plain = core_api.create_namespaced_pod(placing.plain, pod("plain-1"))
    assert gates(plain) == []  # its namespace does not opt in: never sent
    bound = core_api.create_namespaced_pod(placing.opted_in, pod("bound-1", nodeName="node-b"))
    assert gates(bound) == []  # bound at create (matchConditions)
    assert wait_for(lambda: core_api.read_namespaced_pod("plain-1", placing.plain).spec.node_name, timeout=60)
    assert core_api.read_namespaced_pod("plain-1", placing.plain).spec.affinity is None
