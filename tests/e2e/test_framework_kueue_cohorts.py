"""Borrowing and preemption among JobSets under Kueue on fgpu's devices (issue 39 item 4): two teams'
ClusterQueues of 4 whole GPUs each (`gpu.fgpu.dev/gpus`) in one cohort, on the 8-GPU real node,
Kueue's JobSet integration and its webhook on (Kueue suspends a JobSet at creation). Team A's
JobSet of 4 Jobs x 2 GPUs borrows team B's unused 4 GPUs and runs. Team B may take its quota back
from a borrower of lower priority only (`reclaimWithinCohort: LowerPriority`): its JobSet of the
same WorkloadPriorityClass (`batch`) waits; one of class `urgent` preempts team A's JobSet (Kueue
suspends it, its pods and claims go) and runs on the GPUs it gave back. The same with TrainJobs
(Kueue's TrainJob integration and webhook on too): team A's TrainJob of 4 nodes x 2 GPUs borrows and
runs, team B's urgent one of 2 nodes preempts it. The claims are allocated by kube-scheduler."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from kubernetes.dynamic import DynamicClient
from kubernetes.utils import parse_quantity

from testbed.workloads import claim_template, pod_spec, unique, wait_until
from tests.support.frameworks import (
    GPUS,
    KUEUE,
    MOCK_NODE,
    PRIORITY_LABEL,
    QUEUE_LABEL,
    admitted,
    claimed_devices,
    cluster_queue,
    condition,
    describe,
    example,
    kueue_for,
    on_test_bed,
    pods_running,
    queues,
    waiting_for_quota,
    workloads_of,
)

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]

JOBSET = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
WAIT_S = 120


FRAMEWORKS = ["batch/job", "jobset.x-k8s.io/jobset", "trainer.kubeflow.org/trainjob"]


@pytest.fixture(scope="module")
def kueue(cluster, trainer_operator, tmp_path_factory):
    """Kueue after JobSet's and Trainer's operators (Trainer's fixture starts JobSet's first)."""
    with kueue_for(cluster, FRAMEWORKS, Path(tmp_path_factory.mktemp("kueue"))) as manager:
        yield manager


class Teams:
    def __init__(self, cluster, node: str, a: str, b: str, batch: str, urgent: str) -> None:
        self.cluster = cluster
        client = self.client = cluster.api_client()
        self.core, self.custom = kubernetes.client.CoreV1Api(client), kubernetes.client.CustomObjectsApi(client)
        self.node, self.a, self.b, self.batch, self.urgent = node, a, b, batch, urgent

    def submit(self, team: str, name: str, jobs: int, priority: str) -> None:
        """A JobSet of `jobs` Jobs of one pod with 2 GPUs, for the team's LocalQueue `gpus`."""
        spec = {**pod_spec(self.node, "two-gpus"), "restartPolicy": "Never"}
        job = {"parallelism": 1, "completions": 1, "backoffLimit": 0, "template": {"spec": spec}}
        jobset = {
            "apiVersion": "jobset.x-k8s.io/v1alpha2",
            "kind": "JobSet",
            "metadata": {"name": name, "labels": {QUEUE_LABEL: "gpus", PRIORITY_LABEL: priority}},
            "spec": {"replicatedJobs": [{"name": "w", "replicas": jobs, "template": {"spec": job}}]},
        }
        self.custom.create_namespaced_custom_object(*JOBSET[:2], team, JOBSET[2], jobset)

    def workload(self, team: str, name: str) -> dict[str, Any]:
        """The JobSet's Workload; {} until Kueue has made it."""
        found = workloads_of(self.custom, team, name)
        assert len(found) <= 1, found
        return found[0] if found else {}

    def suspended(self, team: str, name: str) -> bool:
        return bool(self.custom.get_namespaced_custom_object(*JOBSET[:2], team, JOBSET[2], name)["spec"].get("suspend"))

    def pods(self, team: str, name: str) -> list[Any]:
        selector = f"jobset.sigs.k8s.io/jobset-name={name}"
        return [p for p in self.core.list_namespaced_pod(team, label_selector=selector).items
                if not p.metadata.deletion_timestamp]  # fmt: skip

    def wait_running(self, team: str, name: str, count: int) -> list[Any]:
        selector = f"jobset.sigs.k8s.io/jobset-name={name}"
        try:
            return wait_until(f"{name}'s {count} pods running",
                              lambda: pods_running(self.core, team, selector, count), timeout_s=WAIT_S)  # fmt: skip
        except AssertionError as err:
            raise AssertionError(f"{err}; kueue: {describe(self.custom, team)}") from None

    def borrowed(self, queue: str) -> int:
        """The GPUs the ClusterQueue uses over its nominal quota."""
        status = self.custom.get_cluster_custom_object(*KUEUE, "clusterqueues", queue).get("status") or {}
        used = [r for f in status.get("flavorsUsage") or () for r in f.get("resources") or () if r["name"] == GPUS]
        return sum(int(parse_quantity(r.get("borrowed", 0))) for r in used)

    def gpus_seen(self, team: str, pods: list[Any]) -> list[str]:
        gpus = []
        for name, (devices, container) in claimed_devices(self.client, team, pods).items():
            assert len(devices) == 2, (name, devices)
            assert all(container.devices.get(f"/dev/nvidia{d.removeprefix('gpu-')}") == MOCK_NODE for d in devices)
            gpus += devices
        return gpus


@pytest.fixture
def teams(cluster, kueue, real_node, node_plugin) -> Iterator[Teams]:
    """Two teams' namespaces, each with a ClusterQueue of 4 GPUs in one cohort; team B reclaims its
    quota from borrowers of lower priority; priorities `batch` (100) and `urgent` (1000)."""
    suffix = unique("c").removeprefix("c-")
    a, b, cohort = f"team-a-{suffix}", f"team-b-{suffix}", f"research-{suffix}"
    batch, urgent = f"batch-{suffix}", f"urgent-{suffix}"
    reclaim = {"reclaimWithinCohort": "LowerPriority", "withinClusterQueue": "Never"}
    team_queues = {
        a: cluster_queue(a, a, {GPUS: 4}, cohort=cohort, flavor=cohort),
        b: cluster_queue(b, b, {GPUS: 4}, cohort=cohort, flavor=cohort, preemption=reclaim),
    }
    with queues(cluster, team_queues, priorities={batch: 100, urgent: 1000}):
        resource = kubernetes.client.ResourceV1Api(cluster.api_client())
        for team in (a, b):
            resource.create_namespaced_resource_claim_template(
                team, claim_template("two-gpus", "gpu.fgpu.dev", count=2)
            )
        yield Teams(cluster, real_node.name, a, b, batch, urgent)


def test_a_borrowing_jobset_is_preempted_by_a_higher_priority_one(teams):
    a, b = teams.a, teams.b
    # Team A: 8 GPUs on a nominal quota of 4, team B's 4 borrowed.
    teams.submit(a, "train", 4, teams.batch)
    pods = teams.wait_running(a, "train", 4)
    assert teams.borrowed(a) == 4
    assert len(set(teams.gpus_seen(a, pods))) == 8

    # Team B, same priority: may not reclaim; waits while team A runs on.
    teams.submit(b, "same-priority", 2, teams.batch)
    wait_until("team B's batch JobSet waiting for quota",
               lambda: waiting_for_quota(teams.workload(b, "same-priority"), GPUS), timeout_s=WAIT_S)  # fmt: skip
    time.sleep(3)  # a few of Kueue's scheduling passes more
    assert teams.suspended(b, "same-priority") and not teams.pods(b, "same-priority")
    assert not condition(teams.workload(a, "train"), "Evicted") and len(teams.pods(a, "train")) == 4

    # Team B, urgent: takes its 4 GPUs back from team A's borrowing JobSet, which Kueue suspends.
    teams.submit(b, "urgent", 2, teams.urgent)
    pods = teams.wait_running(b, "urgent", 2)
    preempted = condition(teams.workload(a, "train"), "Preempted")
    assert preempted and preempted["status"] == "True" and preempted["reason"] == "InCohortReclamation", preempted
    assert teams.suspended(a, "train") and not admitted(teams.workload(a, "train"))
    assert not teams.pods(a, "train")
    assert len(set(teams.gpus_seen(b, pods))) == 4


def test_a_borrowing_trainjob_is_preempted_by_a_higher_priority_one(teams):
    """The same with TrainJobs (examples/frameworks/trainjob-4x2-gpus.yaml's runtime in each team's
    namespace): team A's of 4 nodes x 2 GPUs borrows 4 and runs; team B's urgent one of 2 nodes
    (`numNodes: 2`, 4 GPUs) preempts it and runs."""
    a, b = teams.a, teams.b
    dynamic = DynamicClient(teams.client, cache_file=teams.cluster.discovery_cache)
    _, runtime, trainjob = example("trainjob-4x2-gpus.yaml")  # the claim template: the teams' own

    def submit(team: str, name: str, nodes: int, priority: str) -> None:
        job = on_test_bed(trainjob, teams.node)
        job["metadata"]["name"] = name
        job["metadata"]["labels"][PRIORITY_LABEL] = priority
        job["spec"]["trainer"]["numNodes"] = nodes
        for document in ([on_test_bed(runtime, teams.node)] if nodes == 4 else []) + [job]:
            resource = dynamic.resources.get(api_version=document["apiVersion"], kind=document["kind"])
            resource.create(body=document, namespace=team)

    submit(a, "train", 4, teams.batch)
    pods = teams.wait_running(a, "train", 4)  # the TrainJob's JobSet has its name
    assert teams.borrowed(a) == 4
    assert len(set(teams.gpus_seen(a, pods))) == 8

    dynamic.resources.get(api_version=runtime["apiVersion"], kind=runtime["kind"]).create(
        body=on_test_bed(runtime, teams.node), namespace=b
    )
    submit(b, "urgent", 2, teams.urgent)
    pods = teams.wait_running(b, "urgent", 2)
    preempted = condition(teams.workload(a, "train"), "Preempted")
    assert preempted and preempted["status"] == "True" and preempted["reason"] == "InCohortReclamation", preempted
    found = dynamic.resources.get(api_version=trainjob["apiVersion"], kind="TrainJob").get(name="train", namespace=a)
    assert found.spec.suspend is True and not teams.pods(a, "train")
    assert len(set(teams.gpus_seen(b, pods))) == 4
