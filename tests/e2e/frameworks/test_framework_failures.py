"""A worker of a running JobSet gang fails (issue 39 item 5): one of its pods is deleted while the
JobSet runs, its 4 Jobs x 2 GPUs filling the 8-GPU real node, its claims opted in to fgpu's
controller (`fgpu controller`, a process; the pods carry the controller's gate in their template, no
webhook adds it here). JobSet's pods form one gang per JobSet run
(driver/scheduling/framework_gangs.py).

- The whole JobSet restarts (its failure policy: a Job of `backoffLimit: 0` fails, JobSet recreates
  every Job, `restart-attempt` 1): the new pods are a new gang, whose claims are placed together
  once all 4 exist and the old claims have given their GPUs back; no new pod's gate is lifted
  before every new pod exists with its claim allocated; all 4 run with their GPUs.
- Only the pod is replaced (its Job's `backoffLimit: 1`): the replacement joins its running gang,
  gets a claim of its own allocated and prepared, and sees its GPUs; the other 3 run on untouched.
- A TrainJob's node (examples/frameworks/trainjob-4x2-gpus.yaml on the test bed, the gate added to
  its runtime's pod template): Trainer's node Job runs the 4 nodes as one indexed Job, which
  replaces the deleted pod (same completion index) in the same gang (`gpu.fgpu.dev/gang-size` 4);
  it gets its GPUs again beside the other 3."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest
from kubernetes.dynamic import DynamicClient

from driver.scheduling.opt_in import OPT_IN_LABEL, OPT_IN_VALUE, SCHEDULING_GATE
from testbed.cluster.node import RealNode
from testbed.workloads import claim_template, delete_namespace, pod_spec, unique, wait_until
from tests.support.frameworks import MOCK_NODE, claimed_devices, example, on_test_bed, pod_specs, pods_running

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]

JOBSET = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
RESTART_ATTEMPT = "jobset.sigs.k8s.io/restart-attempt"
WAIT_S = 120


@pytest.fixture
def namespace(cluster, real_node: RealNode, node_plugin, jobset_operator) -> Iterator[str]:
    client = cluster.api_client()
    core, resource = kubernetes.client.CoreV1Api(client), kubernetes.client.ResourceV1Api(client)
    name = unique("failures")
    core.create_namespace({"metadata": {"name": name}})
    try:
        template = claim_template("two-gpus", "gpu.fgpu.dev", count=2)
        template["spec"]["metadata"] = {"labels": {OPT_IN_LABEL: OPT_IN_VALUE}}
        resource.create_namespaced_resource_claim_template(name, template)
        yield name
    finally:
        delete_namespace(core, name)


class Gang:
    """A JobSet of 4 Jobs of one pod with 2 GPUs, and what became of its pods and claims."""

    def __init__(self, cluster, namespace: str, node: str, backoff_limit: int, max_restarts: int) -> None:
        self.client = cluster.api_client()
        self.core = kubernetes.client.CoreV1Api(self.client)
        self.resource = kubernetes.client.ResourceV1Api(self.client)
        self.namespace, self.name = namespace, unique("train")
        spec = {**pod_spec(node, "two-gpus"), "restartPolicy": "Never", "schedulingGates": [{"name": SCHEDULING_GATE}]}
        job = {"parallelism": 1, "completions": 1, "backoffLimit": backoff_limit, "template": {"spec": spec}}
        jobset = {
            "apiVersion": "jobset.x-k8s.io/v1alpha2",
            "kind": "JobSet",
            "metadata": {"name": self.name},
            "spec": {
                "failurePolicy": {"maxRestarts": max_restarts},
                "replicatedJobs": [{"name": "w", "replicas": 4, "template": {"spec": job}}],
            },
        }
        kubernetes.client.CustomObjectsApi(self.client).create_namespaced_custom_object(
            *JOBSET[:2], namespace, JOBSET[2], jobset
        )

    def selector(self, attempt: int | None = None) -> str:
        selector = f"jobset.sigs.k8s.io/jobset-name={self.name}"
        return selector if attempt is None else f"{selector},{RESTART_ATTEMPT}={attempt}"

    def pods(self, attempt: int | None = None) -> list[Any]:
        found = self.core.list_namespaced_pod(self.namespace, label_selector=self.selector(attempt)).items
        return [p for p in found if not p.metadata.deletion_timestamp and p.status.phase not in ("Failed", "Succeeded")]

    def running(self, attempt: int | None = None) -> list[Any]:
        return wait_until(f"{self.name}'s 4 pods running",
                          lambda: pods_running(self.core, self.namespace, self.selector(attempt), 4),
                          timeout_s=WAIT_S)  # fmt: skip

    def allocated(self, pod: Any) -> bool:
        statuses = pod.status.resource_claim_statuses or ()
        if not statuses or not statuses[0].resource_claim_name:
            return False
        claim = self.resource.read_namespaced_resource_claim(statuses[0].resource_claim_name, self.namespace)
        return bool(claim.status and claim.status.allocation)

    def gpus(self, pods: list[Any]) -> dict[str, list[str]]:
        """Each pod's GPUs, as its claim has them and its container sees them."""
        seen = {}
        for name, (devices, container) in claimed_devices(self.client, self.namespace, pods).items():
            assert len(devices) == 2, (name, devices)
            for device in devices:
                assert container.devices.get(f"/dev/nvidia{device.removeprefix('gpu-')}") == MOCK_NODE, (name, device)
            seen[name] = devices
        return seen


def claim_names(pods: list[Any]) -> set[str]:
    return {s.resource_claim_name for p in pods for s in p.status.resource_claim_statuses or ()}


def test_a_deleted_worker_restarts_the_whole_jobset_as_a_new_gang(cluster, real_node, namespace, controller):
    gang = Gang(cluster, namespace, real_node.name, backoff_limit=0, max_restarts=2)
    first = gang.running(attempt=0)
    before = gang.gpus(first)
    assert len({g for gpus in before.values() for g in gpus}) == 8

    gang.core.delete_namespaced_pod(first[0].metadata.name, namespace)
    # Until the new run's 4 pods run: no new pod leaves the gate before all 4 exist with their
    # claims allocated (the old run's claims hold every GPU until its pods are gone).
    deadline, ungated_seen = time.monotonic() + WAIT_S, False
    while time.monotonic() < deadline:
        new = gang.pods(attempt=1)
        ungated = [p.metadata.name for p in new if not p.spec.scheduling_gates]
        if ungated:
            ungated_seen = True
            assert len(new) == 4, f"gate lifted for {ungated} with {len(new)} of 4 pods"
            assert all(gang.allocated(p) for p in new), f"gate lifted for {ungated} before every claim was placed"
        if len(new) == 4 and all(p.status.phase == "Running" for p in new):
            break
        time.sleep(0.3)
    assert ungated_seen, "the restarted JobSet's pods never left the gate"
    second = gang.running(attempt=1)
    assert not gang.pods(attempt=0)  # the old run is gone
    assert not claim_names(second) & claim_names(first)  # new claims, allocated again
    after = gang.gpus(second)
    assert len({g for gpus in after.values() for g in gpus}) == 8


def test_a_deleted_worker_replaced_alone_gets_its_gpus_again(cluster, real_node, namespace, controller):
    gang = Gang(cluster, namespace, real_node.name, backoff_limit=1, max_restarts=0)
    first = gang.running(attempt=0)
    before = gang.gpus(first)
    victim, *others = first
    gang.core.delete_namespaced_pod(victim.metadata.name, namespace)

    def replaced() -> list[Any]:
        pods = pods_running(gang.core, namespace, gang.selector(0), 4)
        return pods if victim.metadata.name not in {p.metadata.name for p in pods} else []

    pods = wait_until("the replacement running beside the other 3", replaced, timeout_s=WAIT_S)
    (replacement,) = [p for p in pods if p.metadata.name not in {o.metadata.name for o in others}]
    still = {p.metadata.name: p.metadata.uid for p in pods}
    assert all(still.get(o.metadata.name) == o.metadata.uid for o in others)  # not restarted
    assert not claim_names([replacement]) & claim_names(first)  # a claim of its own
    after = gang.gpus(pods)
    assert {n: g for n, g in after.items() if n != replacement.metadata.name} == {
        o.metadata.name: before[o.metadata.name] for o in others
    }
    assert len({g for gpus in after.values() for g in gpus}) == 8


def test_a_deleted_trainjob_node_is_replaced_in_its_gang(cluster, real_node, namespace, controller, trainer_operator):
    client = cluster.api_client()
    core = kubernetes.client.CoreV1Api(client)
    dynamic = DynamicClient(client, cache_file=cluster.discovery_cache)
    for document in example("trainjob-4x2-gpus.yaml")[1:]:  # the runtime and the TrainJob (the template is there)
        document = on_test_bed(document, real_node.name, queue=None)
        for spec in pod_specs(document):
            spec["schedulingGates"] = [{"name": SCHEDULING_GATE}]
        resource = dynamic.resources.get(api_version=document["apiVersion"], kind=document["kind"])
        resource.create(body=document, namespace=namespace)
    selector = "jobset.sigs.k8s.io/jobset-name=train-4x2"
    first = wait_until("the TrainJob's 4 nodes running", lambda: pods_running(core, namespace, selector, 4),
                       timeout_s=WAIT_S)  # fmt: skip
    index = "batch.kubernetes.io/job-completion-index"
    victim = next(p for p in first if p.metadata.labels[index] == "1")
    core.delete_namespaced_pod(victim.metadata.name, namespace)

    def replaced() -> list[Any]:
        pods = pods_running(core, namespace, selector, 4)
        return pods if victim.metadata.uid not in {p.metadata.uid for p in pods} else []

    pods = wait_until("node 1 replaced and running", replaced, timeout_s=WAIT_S)
    (replacement,) = [p for p in pods if p.metadata.labels[index] == "1"]
    assert replacement.metadata.labels.get(RESTART_ATTEMPT, "0") == "0"  # the same JobSet run: the same gang
    assert {p.metadata.uid for p in pods} - {replacement.metadata.uid} == {
        p.metadata.uid for p in first if p is not victim
    }
    assert not claim_names([replacement]) & claim_names(first)
    seen = claimed_devices(client, namespace, pods)
    gpus = [d for devices, _ in seen.values() for d in devices]
    assert len(gpus) == 8 and len(set(gpus)) == 8
    for name, (devices, container) in seen.items():
        assert all(container.devices.get(f"/dev/nvidia{d.removeprefix('gpu-')}") == MOCK_NODE for d in devices), name
