"""The workloads users submit instead of pods (issue 39), end to end on the real node: a JobSet, a
LeaderWorkerSet, a RayCluster and a TrainJob whose pod templates take one claim per pod from a
ResourceClaimTemplate on fgpu's device classes. Their operators (built from their modules, as host
processes: testbed/cluster/operators.py) copy the template into the pods they create through their
own Go types: each test checks that the pods still carry the claim, that each pod got a claim of
its own, and what the containers see of their devices."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import kubernetes
import pytest

from testbed.cluster.node import RealNode
from testbed.workloads import ContainerReport, claim_template, delete_namespace, pod_spec, report, unique, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]

MOCK_NODE = "c 1:3"  # mock GPUs' device nodes come from /dev/null (see driver/node/cdi.py)
WHOLE_GPU, MPS_SHARE = "gpu.fgpu.dev", "mps.gpu.fgpu.dev"
MPS_CAPACITY = {"memory": "10Gi", "compute": "25"}
WAIT_S = 120


@dataclass(frozen=True)
class Bed:
    """A namespace of the test's own on the cluster with the real node and its plugin."""

    cluster: Any
    namespace: str
    node: str

    @property
    def core(self) -> kubernetes.client.CoreV1Api:
        return kubernetes.client.CoreV1Api(self.cluster.api_client())

    @property
    def resource(self) -> kubernetes.client.ResourceV1Api:
        return kubernetes.client.ResourceV1Api(self.cluster.api_client())

    def claim_template(self, device_class: str, capacity: dict[str, str] | None = None) -> str:
        template = claim_template(unique("tpl"), device_class, capacity=capacity)
        self.resource.create_namespaced_resource_claim_template(self.namespace, template)
        return template["metadata"]["name"]

    def pod_spec(self, template: str, **extra: Any) -> dict[str, Any]:
        """A pod on the real node with one claim from `template`, reporting what its container sees."""
        return {**pod_spec(self.node, template), **extra}

    @property
    def custom(self) -> kubernetes.client.CustomObjectsApi:
        return kubernetes.client.CustomObjectsApi(self.cluster.api_client())

    def create(self, obj: dict[str, Any], plural: str) -> None:
        group, version = obj["apiVersion"].split("/")
        self.custom.create_namespaced_custom_object(group, version, self.namespace, plural, obj)

    def status(self, obj: dict[str, Any], plural: str) -> dict[str, Any]:
        group, version = obj["apiVersion"].split("/")
        name = obj["metadata"]["name"]
        found = self.custom.get_namespaced_custom_object(group, version, self.namespace, plural, name)
        return found.get("status") or {}

    def running_pods(self, selector: str, count: int) -> list[Any]:
        """The `count` pods of the selector, once all run."""

        def running() -> list[Any]:
            pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
            live = [p for p in pods if not p.metadata.deletion_timestamp]
            return live if len(live) == count and all(p.status.phase == "Running" for p in live) else []

        try:
            return wait_until(f"{count} pods of {selector} running", running, timeout_s=WAIT_S)
        except AssertionError as err:
            pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
            seen = {p.metadata.name: (p.status.phase, self._events(p.metadata.name)) for p in pods}
            raise AssertionError(f"{err}; pods: {seen}") from None

    def _events(self, name: str) -> list[str]:
        events = self.core.list_namespaced_event(self.namespace, field_selector=f"involvedObject.name={name}").items
        return [f"{e.reason}: {e.message}" for e in events]

    def devices_of(self, pod: Any) -> list[str]:
        (status,) = pod.status.resource_claim_statuses
        claim = self.resource.read_namespaced_resource_claim(status.resource_claim_name, self.namespace)
        return [result.device for result in claim.status.allocation.devices.results]

    def check_claims(self, pods: list[Any], template: str) -> dict[str, tuple[list[str], ContainerReport]]:
        """Each pod on the real node, still carrying the template's claim (what the operator's Go
        types kept), with a claim of its own; per pod its devices and its container's report."""
        seen = {}
        for pod in pods:
            assert pod.spec.node_name == self.node
            claims = [(c.name, c.resource_claim_template_name) for c in pod.spec.resource_claims or ()]
            assert claims == [("gpu", template)], f"{pod.metadata.name} lost its claim: {claims}"
            seen[pod.metadata.name] = (self.devices_of(pod), report(self.core, pod.metadata.name, self.namespace))
        claim_names = {p.status.resource_claim_statuses[0].resource_claim_name for p in pods}
        assert len(claim_names) == len(pods), "pods share a claim"
        return seen


@pytest.fixture
def bed(cluster, real_node: RealNode, node_plugin) -> Iterator[Bed]:
    """The test's namespace, deleted with all it holds (the operators still run to finish their
    objects) once the test is over."""
    namespace = unique("frameworks")
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    core.create_namespace({"metadata": {"name": namespace}})
    try:
        yield Bed(cluster, namespace, real_node.name)
    finally:
        delete_namespace(core, namespace)


def assert_whole_gpus(seen: dict[str, tuple[list[str], ContainerReport]]) -> None:
    """One whole GPU per pod, a different one each, its device node inside the container."""
    gpus = []
    for name, (devices, container) in seen.items():
        (device,) = devices
        assert device.startswith("gpu-"), (name, device)
        assert container.devices.get(f"/dev/nvidia{device.removeprefix('gpu-')}") == MOCK_NODE, (name, container)
        assert container.env["NVIDIA_VISIBLE_DEVICES"] == "void"
        gpus.append(device)
    assert len(set(gpus)) == len(gpus), gpus


def assert_mps_shares(seen: dict[str, tuple[list[str], ContainerReport]]) -> None:
    for name, (devices, container) in seen.items():
        assert len(devices) == 1, (name, devices)
        assert container.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25", (name, container.env)
        assert container.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M", (name, container.env)


def test_jobset_replicas_each_get_a_whole_gpu(bed: Bed, jobset_operator):
    template = bed.claim_template(WHOLE_GPU)
    job = {"parallelism": 1, "completions": 1, "backoffLimit": 0,
           "template": {"spec": bed.pod_spec(template, restartPolicy="Never")}}  # fmt: skip
    name = unique("jobset")
    jobset = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name},
        "spec": {"replicatedJobs": [{"name": "workers", "replicas": 2, "template": {"spec": job}}]},
    }
    bed.create(jobset, "jobsets")
    pods = bed.running_pods(f"jobset.sigs.k8s.io/jobset-name={name}", 2)
    assert_whole_gpus(bed.check_claims(pods, template))


def test_leaderworkerset_group_of_two_each_get_a_whole_gpu(bed: Bed, lws_operator):
    template = bed.claim_template(WHOLE_GPU)
    name = unique("lws")
    lws = {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "leaderWorkerTemplate": {"size": 2, "workerTemplate": {"spec": bed.pod_spec(template)}},
        },
    }
    bed.create(lws, "leaderworkersets")
    pods = bed.running_pods(f"leaderworkerset.sigs.k8s.io/name={name}", 2)
    assert_whole_gpus(bed.check_claims(pods, template))


def test_raycluster_head_and_worker_each_get_an_mps_share(bed: Bed, kuberay_operator):
    template = bed.claim_template(MPS_SHARE, MPS_CAPACITY)
    name = unique("ray")
    spec = bed.pod_spec(template)
    workers = {"groupName": "workers", "replicas": 1, "minReplicas": 1, "maxReplicas": 1, "rayStartParams": {},
               "template": {"spec": copy.deepcopy(spec)}}  # fmt: skip
    cluster = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        # The containers run busybox, not `ray start`: KubeRay keeps their command as given.
        "metadata": {"name": name, "annotations": {"ray.io/overwrite-container-cmd": "true"}},
        "spec": {"headGroupSpec": {"rayStartParams": {}, "template": {"spec": spec}}, "workerGroupSpecs": [workers]},
    }
    bed.create(cluster, "rayclusters")
    pods = bed.running_pods(f"ray.io/cluster={name}", 2)
    assert {p.metadata.labels["ray.io/node-type"] for p in pods} == {"head", "worker"}
    assert_mps_shares(bed.check_claims(pods, template))
    # KubeRay creates the workers without waiting for the head; "ready" is its word for all pods
    # running and ready (no Ray probes here: operators.KUBERAY turns their injection off).
    wait_until("the RayCluster ready", lambda: bed.status(cluster, "rayclusters").get("state") == "ready")


def test_trainjob_nodes_each_get_a_whole_gpu(bed: Bed, trainer_operator):
    template = bed.claim_template(WHOLE_GPU)
    name = unique("train")
    spec = bed.pod_spec(template, restartPolicy="Never")
    spec["containers"][0]["name"] = "node"  # the trainer's container, as Trainer's runtimes name it
    runtime = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainingRuntime",
        "metadata": {"name": name},
        "spec": {
            "mlPolicy": {"numNodes": 1},  # no framework: Trainer's plain ML policy, nodes as the TrainJob says
            "template": {"spec": {"replicatedJobs": [{
                "name": "node",
                "template": {
                    "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                    "spec": {"template": {"spec": spec}},
                },
            }]}},
        },
    }  # fmt: skip
    bed.create(runtime, "trainingruntimes")
    trainjob = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name},
        "spec": {"runtimeRef": {"name": name, "kind": "TrainingRuntime"}, "trainer": {"numNodes": 2}},
    }
    bed.create(trainjob, "trainjobs")
    pods = bed.running_pods(f"jobset.sigs.k8s.io/jobset-name={name}", 2)
    assert_whole_gpus(bed.check_claims(pods, template))
