"""The framework examples users copy (examples/frameworks/, issue 39 item 2), applied as shipped on
the real node (mock dgx-h100: 8 GPUs), one at a time: only their images and commands are swapped
for the test bed's busybox, which reports what the container sees (the examples name CUDA, PyTorch,
vLLM and Ray images this machine has no registry for; KubeRay keeps a given command only with its
ray.io/overwrite-container-cmd annotation, added here), and the pods are pinned to the real node
(the control plane's fake nodes run nothing, and a pod without a claim, a Ray head, would go
there). Every pod runs on the real node, and each pod with a claim sees its devices. The examples'
opt-in claims are allocated by kube-scheduler here (no webhook gates the pods in this module); the
controller's gangs: test_framework_gangs.py."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import kubernetes
import pytest
import yaml
from kubernetes.dynamic import DynamicClient

from testbed.cluster.node import RealNode
from testbed.workloads import ContainerReport, delete_namespace, report, unique, wait_until
from tests.support import ROOT
from tests.support.frameworks import on_test_bed, whole_gpus

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]

EXAMPLES = ROOT / "examples" / "frameworks"
PLURALS = {"TrainingRuntime": "trainingruntimes", "TrainJob": "trainjobs", "LeaderWorkerSet": "leaderworkersets",
           "RayCluster": "rayclusters", "RayJob": "rayjobs"}  # fmt: skip
WAIT_S = 180


@dataclass(frozen=True)
class Applied:
    """An example applied in the test's namespace."""

    client: kubernetes.client.ApiClient
    namespace: str
    node: str
    documents: list[dict[str, Any]]

    @property
    def core(self) -> kubernetes.client.CoreV1Api:
        return kubernetes.client.CoreV1Api(self.client)

    def custom(self, kind: str) -> dict[str, Any]:
        (document,) = [d for d in self.documents if d["kind"] == kind]
        group, version = document["apiVersion"].split("/")
        return kubernetes.client.CustomObjectsApi(self.client).get_namespaced_custom_object(
            group, version, self.namespace, PLURALS[kind], document["metadata"]["name"]
        )

    def running(self, selector: str | Callable[[], str | None], count: int) -> list[Any]:
        """The `count` pods of the selector, once all run on the real node."""

        def all_running() -> list[Any]:
            chosen = selector() if callable(selector) else selector
            if chosen is None:
                return []
            pods = [p for p in self.core.list_namespaced_pod(self.namespace, label_selector=chosen).items
                    if not p.metadata.deletion_timestamp]  # fmt: skip
            return pods if len(pods) == count and all(p.status.phase == "Running" for p in pods) else []

        try:
            pods = wait_until(f"{count} pods running", all_running, timeout_s=WAIT_S)
        except AssertionError as err:
            seen = {p.metadata.name: p.status.phase for p in self.core.list_namespaced_pod(self.namespace).items}
            raise AssertionError(f"{err}; pods: {seen}") from None
        assert {p.spec.node_name for p in pods} == {self.node}
        return pods

    def devices(self, pods: list[Any]) -> dict[str, tuple[list[str], ContainerReport]]:
        """Per pod with a claim: its claim's devices and what its container saw."""
        resource = kubernetes.client.ResourceV1Api(self.client)
        seen = {}
        for pod in pods:
            if not pod.spec.resource_claims:
                continue
            (status,) = pod.status.resource_claim_statuses
            claim = resource.read_namespaced_resource_claim(status.resource_claim_name, self.namespace)
            devices = [r.device for r in claim.status.allocation.devices.results]
            seen[pod.metadata.name] = (devices, report(self.core, pod.metadata.name, self.namespace))
        return seen


@pytest.fixture
def apply(cluster, real_node: RealNode, node_plugin) -> Iterator[Callable[[str], Applied]]:
    """Applies an example into a namespace of the test's own, deleted with all it holds after."""
    client = cluster.api_client()
    core = kubernetes.client.CoreV1Api(client)
    namespace = unique("examples")
    core.create_namespace({"metadata": {"name": namespace}})

    def applying(name: str) -> Applied:
        dynamic = DynamicClient(client, cache_file=cluster.discovery_cache)  # after the operators' CRDs
        documents = [
            on_test_bed(d, real_node.name, queue=None) for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d
        ]
        for document in documents:
            resource = dynamic.resources.get(api_version=document["apiVersion"], kind=document["kind"])
            resource.create(body=document, namespace=namespace)
        return Applied(client, namespace, real_node.name, documents)

    try:
        yield applying
    finally:
        delete_namespace(core, namespace)


def mps_shares(seen: dict[str, tuple[list[str], ContainerReport]], memory_mi: int, compute: int) -> None:
    for name, (devices, container) in seen.items():
        assert len(devices) == 1 and devices[0].endswith("-mps"), (name, devices)
        assert container.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(compute), (name, container.env)
        assert container.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={memory_mi}M", (name, container.env)


def test_trainjob_of_4_nodes_with_2_gpus_each(apply, trainer_operator):
    example = apply("trainjob-4x2-gpus.yaml")
    pods = example.running("jobset.sigs.k8s.io/jobset-name=train-4x2", 4)
    whole_gpus(example.devices(pods), 2)


def test_trainjob_of_4_nodes_on_mig_3g_40gb(apply, trainer_operator):
    example = apply("trainjob-mig-3g.yaml")
    pods = example.running("jobset.sigs.k8s.io/jobset-name=train-mig-3g", 4)
    seen = example.devices(pods)
    partitions = [d for devices, _ in seen.values() for d in devices]
    assert len(partitions) == 4 and all(re.fullmatch(r"gpu-\d-mig-3g40gb-\d", d) for d in partitions), partitions
    assert len(set(partitions)) == 4
    assert all(container.devices for _, container in seen.values()), seen


def test_leaderworkerset_group_of_2_with_4_gpus_each(apply, lws_operator):
    example = apply("lws-2x4-gpus.yaml")
    pods = example.running("leaderworkerset.sigs.k8s.io/name=serve-2x4", 2)
    whole_gpus(example.devices(pods), 4)


def test_raycluster_workers_on_quarter_gpu_mps_shares(apply, kuberay_operator):
    example = apply("raycluster-mps.yaml")
    pods = example.running("ray.io/cluster=ray-mps", 5)
    seen = example.devices(pods)
    assert len(seen) == 4  # the head takes no GPU
    mps_shares(seen, 19 * 1024, 25)


def test_rayjob_cluster_workers_on_half_gpu_mps_shares(apply, kuberay_operator):
    example = apply("rayjob-mps.yaml")

    def cluster_pods() -> str | None:
        name = (example.custom("RayJob").get("status") or {}).get("rayClusterName")
        return f"ray.io/cluster={name},ray.io/is-ray-node=yes" if name else None

    pods = example.running(cluster_pods, 3)
    seen = example.devices(pods)
    assert len(seen) == 2
    mps_shares(seen, 39 * 1024, 50)


def test_serving_deployment_of_8_replicas_on_10gi_shares(apply):
    example = apply("serving-mps-8x10gi.yaml")
    pods = example.running("app=serve-small-model", 8)
    mps_shares(example.devices(pods), 10 * 1024, 10)
