"""Kueue admits a TrainJob, a LeaderWorkerSet, a RayJob and a RayCluster by their quota on fgpu's
devices (issue 39 item 4): Kueue's manager (v0.19) with examples/kueue/configuration.yaml's device
class mappings and the integrations `trainer.kubeflow.org/trainjob` (with `jobset.x-k8s.io/jobset`,
what a TrainJob runs as), `leaderworkerset.x-k8s.io/leaderworkerset` (Kueue runs each LWS group as a
pod group: its `pod` integration, its pod webhook limited to pods of a queue), `ray.io/rayjob` and
`ray.io/raycluster`, their webhooks installed (Kueue suspends a TrainJob, RayJob or RayCluster at
creation and gates an LWS's pods). Each kind's example from examples/frameworks/, labelled for a
LocalQueue onto a ClusterQueue of 10 GPUs (`gpu.fgpu.dev/gpus`) and 100Gi of share memory
(`gpu.fgpu.dev/share-memory`), is admitted and its pods run on the real node with their devices; a
second one, over the quota, is held by Kueue (suspended, or its pods gated) without a device until
the first is deleted, then runs. The claims are allocated by kube-scheduler (no fgpu webhook gates
the pods here), which waits for every gate. With fgpu's controller instead (its gate on an LWS's
pod template), a group Kueue holds gets no device either: the controller places a claim only once
no other scheduling gate holds its pods (driver/scheduling/opt_in.py `held_by_another_gate`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from kubernetes.dynamic import DynamicClient

from driver.scheduling.opt_in import SCHEDULING_GATE
from testbed.workloads import unique, wait_until
from tests.support.controller import running_controller
from tests.support.frameworks import (
    ADMISSION_GATE,
    GPUS,
    SHARE_MEMORY,
    admitted,
    claimed_devices,
    cluster_queue,
    create,
    describe,
    example,
    kueue_for,
    on_test_bed,
    pod_specs,
    pods_running,
    queues,
    read,
    waiting_for_quota,
    whole_gpus,
    workloads_of,
)

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]

FRAMEWORKS = ["batch/job", "jobset.x-k8s.io/jobset", "trainer.kubeflow.org/trainjob",
              "leaderworkerset.x-k8s.io/leaderworkerset", "ray.io/rayjob", "ray.io/raycluster"]  # fmt: skip
WAIT_S = 180


@pytest.fixture(scope="module")
def kueue(cluster, trainer_operator, lws_operator, kuberay_operator, tmp_path_factory):
    """Kueue after the operators (their CRDs must exist for Kueue to turn their integrations on),
    stopped before them."""
    with kueue_for(cluster, FRAMEWORKS, Path(tmp_path_factory.mktemp("kueue"))) as manager:
        yield manager


class Queue:
    """A namespace with the LocalQueue `gpus`, and the examples applied there."""

    def __init__(self, cluster, namespace: str, node: str) -> None:
        self.client = cluster.api_client()
        self.core = kubernetes.client.CoreV1Api(self.client)
        self.custom = kubernetes.client.CustomObjectsApi(self.client)
        self.dynamic = DynamicClient(self.client, cache_file=cluster.discovery_cache)
        self.namespace, self.node = namespace, node

    def apply(self, documents: list[dict[str, Any]], name: str | None = None) -> dict[str, Any]:
        """The documents on the test bed, the job kind (the last) renamed `name`; returns it."""
        applied = [on_test_bed(d, self.node) for d in documents]
        if name:
            applied[-1]["metadata"]["name"] = name
        create(self.dynamic, self.namespace, applied)
        return applied[-1]

    def get(self, job: dict[str, Any]) -> dict[str, Any]:
        return read(self.dynamic, self.namespace, job)

    def delete(self, job: dict[str, Any]) -> None:
        resource = self.dynamic.resources.get(api_version=job["apiVersion"], kind=job["kind"])
        resource.delete(name=job["metadata"]["name"], namespace=self.namespace,
                        body={"propagationPolicy": "Foreground"})  # fmt: skip

    def running(self, selector: str | Callable[[], str | None], count: int) -> list[Any]:
        def probe() -> list[Any]:
            chosen = selector() if callable(selector) else selector
            return pods_running(self.core, self.namespace, chosen, count) if chosen else []

        try:
            pods = wait_until(f"{count} pods running", probe, timeout_s=WAIT_S)
        except AssertionError as err:
            seen = {p.metadata.name: p.status.phase for p in self.core.list_namespaced_pod(self.namespace).items}
            raise AssertionError(f"{err}; pods: {seen}; kueue: {describe(self.custom, self.namespace)}") from None
        assert {p.spec.node_name for p in pods} == {self.node}
        return pods

    def admitted(self, owner: str) -> bool:
        return any(admitted(w) for w in workloads_of(self.custom, self.namespace, owner))

    def wait_held(self, owner: str, resource: str) -> None:
        def held() -> bool:
            found = workloads_of(self.custom, self.namespace, owner)
            return bool(found) and all(waiting_for_quota(w, resource) for w in found)

        try:
            wait_until(f"{owner}'s Workload waiting for {resource}", held, timeout_s=WAIT_S)
        except AssertionError as err:
            raise AssertionError(f"{err}; kueue: {describe(self.custom, self.namespace)}") from None

    def unallocated(self) -> set[str]:
        """The namespace's claims without an allocation."""
        resource = kubernetes.client.ResourceV1Api(self.client)
        claims = resource.list_namespaced_resource_claim(self.namespace).items
        return {c.metadata.name for c in claims if not (c.status and c.status.allocation)}


@pytest.fixture
def queue(cluster, kueue, real_node, node_plugin) -> Iterator[Queue]:
    namespace = unique("kueue-kinds")
    quotas = {GPUS: 10, SHARE_MEMORY: "100Gi"}
    with queues(cluster, {namespace: cluster_queue(namespace, namespace, quotas)}):
        yield Queue(cluster, namespace, real_node.name)


def test_kueue_admits_a_trainjob_by_its_gpu_quota_and_holds_a_second(queue):
    documents = example("trainjob-4x2-gpus.yaml")  # claim template, runtime, TrainJob: 4 x 2 GPUs
    first = queue.apply(documents)
    pods = queue.running("jobset.sigs.k8s.io/jobset-name=train-4x2", 4)
    assert queue.admitted("train-4x2")
    whole_gpus(claimed_devices(queue.client, queue.namespace, pods), 2)

    second = queue.apply([documents[-1]], name="train-4x2-second")  # the runtime is there
    queue.wait_held("train-4x2-second", GPUS)  # 8 + 8 > 10
    assert queue.get(second)["spec"]["suspend"] is True
    selector = "jobset.sigs.k8s.io/jobset-name=train-4x2-second"
    assert not queue.core.list_namespaced_pod(queue.namespace, label_selector=selector).items

    queue.delete(first)
    pods = queue.running(selector, 4)
    assert not queue.get(second)["spec"].get("suspend")
    whole_gpus(claimed_devices(queue.client, queue.namespace, pods), 2)


def test_kueue_admits_a_leaderworkerset_group_and_gates_a_second(queue):
    documents = example("lws-2x4-gpus.yaml")  # claim template, LWS: a group of 2 pods x 4 GPUs
    first = queue.apply(documents)
    pods = queue.running("leaderworkerset.sigs.k8s.io/name=serve-2x4", 2)
    assert queue.admitted("serve-2x4")
    whole_gpus(claimed_devices(queue.client, queue.namespace, pods), 4)

    queue.apply([documents[-1]], name="serve-2x4-second")
    queue.wait_held("serve-2x4-second", GPUS)
    selector = "leaderworkerset.sigs.k8s.io/name=serve-2x4-second"

    def gated() -> list[Any]:
        found = queue.core.list_namespaced_pod(queue.namespace, label_selector=selector).items
        return found if len(found) == 2 else []

    held = wait_until("the second group's 2 pods, gated", gated, timeout_s=WAIT_S)
    for pod in held:  # Kueue's gate, not bound, no device
        assert ADMISSION_GATE in [g.name for g in pod.spec.scheduling_gates or ()], pod.metadata.name
        assert not pod.spec.node_name
    assert len(queue.unallocated()) == 2

    queue.delete(first)
    pods = queue.running(selector, 2)
    whole_gpus(claimed_devices(queue.client, queue.namespace, pods), 4)


def test_kueue_admits_a_rayjob_by_its_share_memory_quota_and_holds_a_second(queue):
    documents = example("rayjob-mps.yaml")  # claim template, RayJob: a head and 2 workers on 39Gi shares

    def cluster_pods(job: dict[str, Any]) -> Callable[[], str | None]:
        def selector() -> str | None:
            name = (queue.get(job).get("status") or {}).get("rayClusterName")
            return f"ray.io/cluster={name},ray.io/is-ray-node=yes" if name else None

        return selector

    first = queue.apply(documents)
    pods = queue.running(cluster_pods(first), 3)
    assert queue.admitted("rayjob-mps")
    seen = claimed_devices(queue.client, queue.namespace, pods)
    assert len(seen) == 2  # the head takes no GPU
    for name, (devices, container) in seen.items():
        assert len(devices) == 1 and devices[0].endswith("-mps"), (name, devices)
        assert container.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={39 * 1024}M", (name, container.env)

    second = queue.apply([documents[-1]], name="rayjob-mps-second")
    queue.wait_held("rayjob-mps-second", SHARE_MEMORY)  # 78Gi + 78Gi > 100Gi
    held = queue.get(second)
    assert held["spec"]["suspend"] is True and not (held.get("status") or {}).get("rayClusterName")

    queue.delete(first)
    pods = queue.running(cluster_pods(second), 3)
    assert len(claimed_devices(queue.client, queue.namespace, pods)) == 2


def test_kueue_admits_a_raycluster_by_its_share_memory_quota_and_holds_a_second(queue):
    documents = example("raycluster-mps.yaml")  # claim template, RayCluster: a head and 4 workers on 19Gi shares
    first = queue.apply(documents)
    pods = queue.running("ray.io/cluster=ray-mps", 5)
    assert queue.admitted("ray-mps")
    seen = claimed_devices(queue.client, queue.namespace, pods)
    assert len(seen) == 4 and all(len(devices) == 1 and devices[0].endswith("-mps") for devices, _ in seen.values())

    second = queue.apply([documents[-1]], name="ray-mps-second")
    queue.wait_held("ray-mps-second", SHARE_MEMORY)  # 76Gi + 76Gi > 100Gi
    assert queue.get(second)["spec"]["suspend"] is True
    assert not queue.core.list_namespaced_pod(queue.namespace, label_selector="ray.io/cluster=ray-mps-second").items

    queue.delete(first)
    pods = queue.running("ray.io/cluster=ray-mps-second", 5)
    assert len(claimed_devices(queue.client, queue.namespace, pods)) == 4


@pytest.fixture
def small_queue(cluster, kueue, real_node, node_plugin) -> Iterator[Queue]:
    """A queue of 4 GPUs: an LWS group of 2 x 4 GPUs is never admitted."""
    namespace = unique("kueue-small")
    with queues(cluster, {namespace: cluster_queue(namespace, namespace, {GPUS: 4})}):
        yield Queue(cluster, namespace, real_node.name)


def test_a_held_lws_group_opted_in_to_the_controller_holds_no_device(cluster, small_queue):
    """fgpu's controller and Kueue's admission gate: the group's pods carry both gates (the
    controller's from the template, as fgpu's webhook would add it), Kueue holds the group (8 GPUs
    over a quota of 4), the node's 8 GPUs are free: nothing is allocated while Kueue holds it
    (before the fix the controller allocated both claims, 8 GPUs outside any quota, within a
    second)."""
    queue = small_queue
    documents = example("lws-2x4-gpus.yaml")
    for spec in pod_specs(documents[-1]):
        spec["schedulingGates"] = [{"name": SCHEDULING_GATE}]
    with running_controller(cluster.kubeconfig, f"--lease-namespace={queue.namespace}"):
        queue.apply(documents)
        queue.wait_held("serve-2x4", GPUS)
        selector = "leaderworkerset.sigs.k8s.io/name=serve-2x4"

        def both_gated() -> list[Any]:
            found = queue.core.list_namespaced_pod(queue.namespace, label_selector=selector).items
            return found if len(found) == 2 else []

        wait_until("the group's 2 pods", both_gated, timeout_s=WAIT_S)
        time.sleep(10)  # the controller's passes over a complete gang
        assert len(queue.unallocated()) == 2, "claims allocated for a group Kueue has not admitted"
