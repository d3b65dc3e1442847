"""Borrowing and preemption under Kueue on fgpu's devices (issue 39 item 4): two teams'
ClusterQueues of 4 whole GPUs (`gpu.fgpu.dev/gpus`) and 40Gi of share memory
(`gpu.fgpu.dev/share-memory`) each, in one cohort, on the 8-GPU real node, Kueue's JobSet, TrainJob,
LeaderWorkerSet, RayJob and RayCluster integrations and their webhooks on. Team A's job over its
nominal quota borrows team B's unused quota and runs. Team B may take its quota back from a
borrower of lower priority only (`reclaimWithinCohort: LowerPriority`): its JobSet of the same
WorkloadPriorityClass (`batch`) waits; one of class `urgent` preempts team A's (`InCohortReclamation`:
Kueue suspends it, its pods and claims go) and runs on what it gave back. The same for a TrainJob of
4 nodes x 2 GPUs preempted by one of 2 nodes; a LeaderWorkerSet group of 2 x 4 GPUs preempted by a
group of 2 x 2 (Kueue deletes the borrower's pods, LWS makes them again, gated by Kueue, their
claims unallocated); a RayJob of 2 workers on 39Gi MPS shares preempted by one of 1 worker, and a
RayCluster of 4 workers on 19Gi shares by one of 2 (KubeRay deletes the suspended cluster's pods).
The claims are allocated by kube-scheduler."""

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
    ADMISSION_GATE,
    GPUS,
    KUEUE,
    PRIORITY_LABEL,
    QUEUE_LABEL,
    SHARE_MEMORY,
    admitted,
    claimed_devices,
    cluster_queue,
    condition,
    create,
    describe,
    example,
    kueue_for,
    on_test_bed,
    pods_running,
    queues,
    read,
    waiting_for_quota,
    whole_gpus,
    workloads_of,
)

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]

JOBSET = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
WAIT_S = 120
RAY_NODES = "ray.io/is-ray-node=yes"  # a RayCluster's pods, or a RayJob's cluster's: one job a team here


FRAMEWORKS = ["batch/job", "jobset.x-k8s.io/jobset", "trainer.kubeflow.org/trainjob",
              "leaderworkerset.x-k8s.io/leaderworkerset", "ray.io/rayjob", "ray.io/raycluster"]  # fmt: skip


@pytest.fixture(scope="module")
def kueue(cluster, trainer_operator, lws_operator, kuberay_operator, tmp_path_factory):
    """Kueue after the operators (Trainer's fixture starts JobSet's first): Kueue turns on an
    integration only for a kind whose CRD it finds at start."""
    with kueue_for(cluster, FRAMEWORKS, Path(tmp_path_factory.mktemp("kueue"))) as manager:
        yield manager


class Teams:
    def __init__(self, cluster, node: str, a: str, b: str, batch: str, urgent: str) -> None:
        self.cluster = cluster
        client = self.client = cluster.api_client()
        self.core, self.custom = kubernetes.client.CoreV1Api(client), kubernetes.client.CustomObjectsApi(client)
        self.dynamic = DynamicClient(client, cache_file=cluster.discovery_cache)
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

    def apply(
        self, team: str, documents: list[dict[str, Any]], priority: str, name: str | None = None
    ) -> dict[str, Any]:
        """Examples on the test bed in the team's namespace, the job (the last) of WorkloadPriorityClass
        `priority` and renamed `name`; returns the job."""
        applied = [on_test_bed(d, self.node) for d in documents]
        job = applied[-1]
        job["metadata"]["labels"][PRIORITY_LABEL] = priority
        if name:
            job["metadata"]["name"] = name
        create(self.dynamic, team, applied)
        return job

    def workload(self, team: str, name: str) -> dict[str, Any]:
        """The JobSet's Workload; {} until Kueue has made it."""
        found = workloads_of(self.custom, team, name)
        assert len(found) <= 1, found
        return found[0] if found else {}

    def preempted(self, team: str, name: str) -> None:
        """The job's Workload was preempted for team B's reclaiming its quota and is not admitted."""
        found = workloads_of(self.custom, team, name)
        assert len(found) == 1, describe(self.custom, team)
        (workload,) = found
        preempted = condition(workload, "Preempted")
        assert preempted and preempted["status"] == "True" and preempted["reason"] == "InCohortReclamation", preempted
        assert not admitted(workload), describe(self.custom, team)

    def suspended(self, team: str, name: str) -> bool:
        return bool(self.custom.get_namespaced_custom_object(*JOBSET[:2], team, JOBSET[2], name)["spec"].get("suspend"))

    def pods(self, team: str, selector: str) -> list[Any]:
        return [p for p in self.core.list_namespaced_pod(team, label_selector=selector).items
                if not p.metadata.deletion_timestamp]  # fmt: skip

    def wait_running(self, team: str, name: str, count: int, selector: str | None = None) -> list[Any]:
        """The job's `count` pods running (a JobSet's unless `selector`)."""
        selector = selector or f"jobset.sigs.k8s.io/jobset-name={name}"
        try:
            return wait_until(f"{name}'s {count} pods running",
                              lambda: pods_running(self.core, team, selector, count), timeout_s=WAIT_S)  # fmt: skip
        except AssertionError as err:
            raise AssertionError(f"{err}; kueue: {describe(self.custom, team)}") from None

    def wait_released(self, team: str, selector: str, gated: int = 0) -> None:
        """No pod of the selector's runs, none bound, every claim in the namespace unallocated (Kueue's
        pod gate on `gated` pods made again: an LWS group's; else none left)."""

        def released() -> bool:
            pods = self.pods(team, selector)
            held = all(ADMISSION_GATE in [g.name for g in p.spec.scheduling_gates or ()] and not p.spec.node_name
                       for p in pods)  # fmt: skip
            claims = kubernetes.client.ResourceV1Api(self.client).list_namespaced_resource_claim(team).items
            return len(pods) == gated and held and not any(c.status and c.status.allocation for c in claims)

        try:
            wait_until(f"{team}'s pods and claims released", released, timeout_s=WAIT_S)
        except AssertionError as err:
            seen = {p.metadata.name: p.status.phase for p in self.core.list_namespaced_pod(team).items}
            raise AssertionError(f"{err}; pods: {seen}") from None

    def borrowed(self, queue: str, resource: str = GPUS) -> int:
        """How much of `resource` the ClusterQueue uses over its nominal quota (share memory: bytes)."""
        status = self.custom.get_cluster_custom_object(*KUEUE, "clusterqueues", queue).get("status") or {}
        used = [r for f in status.get("flavorsUsage") or () for r in f.get("resources") or () if r["name"] == resource]
        return sum(int(parse_quantity(r.get("borrowed", 0))) for r in used)

    def wait_borrowed(self, queue: str, amount: int, resource: str = GPUS) -> None:
        """Wait until the ClusterQueue borrows `amount`: Kueue writes its status after admitting, so the
        pods can run before the status says so."""
        wait_until(f"{queue} borrowing {amount} {resource}", lambda: self.borrowed(queue, resource) == amount)

    def whole_gpus(self, team: str, pods: list[Any], per_pod: int) -> None:
        """Every pod's claim has `per_pod` whole GPUs of its own, seen in its container."""
        seen = claimed_devices(self.client, team, pods)
        assert len(seen) == len(pods), seen
        whole_gpus(seen, per_pod)


@pytest.fixture
def teams(cluster, kueue, real_node, node_plugin) -> Iterator[Teams]:
    """Two teams' namespaces, each with a ClusterQueue of 4 GPUs and 40Gi of share memory in one
    cohort; team B reclaims its quota from borrowers of lower priority; priorities `batch` (100) and
    `urgent` (1000); a claim template `two-gpus` in each namespace."""
    suffix = unique("c").removeprefix("c-")
    a, b, cohort = f"team-a-{suffix}", f"team-b-{suffix}", f"research-{suffix}"
    batch, urgent = f"batch-{suffix}", f"urgent-{suffix}"
    reclaim = {"reclaimWithinCohort": "LowerPriority", "withinClusterQueue": "Never"}
    quotas = {GPUS: 4, SHARE_MEMORY: "40Gi"}
    team_queues = {
        a: cluster_queue(a, a, quotas, cohort=cohort, flavor=cohort),
        b: cluster_queue(b, b, quotas, cohort=cohort, flavor=cohort, preemption=reclaim),
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
    teams.wait_borrowed(a, 4)
    teams.whole_gpus(a, pods, 2)  # 8 GPUs, each once

    # Team B, same priority: may not reclaim; waits while team A runs on.
    teams.submit(b, "same-priority", 2, teams.batch)
    wait_until("team B's batch JobSet waiting for quota",
               lambda: waiting_for_quota(teams.workload(b, "same-priority"), GPUS), timeout_s=WAIT_S)  # fmt: skip
    time.sleep(3)  # a few of Kueue's scheduling passes more
    assert teams.suspended(b, "same-priority") and not teams.pods(b, "jobset.sigs.k8s.io/jobset-name=same-priority")
    assert not condition(teams.workload(a, "train"), "Evicted")
    assert len(teams.pods(a, "jobset.sigs.k8s.io/jobset-name=train")) == 4

    # Team B, urgent: takes its 4 GPUs back from team A's borrowing JobSet, which Kueue suspends.
    teams.submit(b, "urgent", 2, teams.urgent)
    pods = teams.wait_running(b, "urgent", 2)
    teams.preempted(a, "train")
    assert teams.suspended(a, "train")
    teams.wait_released(a, "jobset.sigs.k8s.io/jobset-name=train")
    teams.whole_gpus(b, pods, 2)


def test_a_borrowing_trainjob_is_preempted_by_a_higher_priority_one(teams):
    """The same with TrainJobs (examples/frameworks/trainjob-4x2-gpus.yaml's runtime in each team's
    namespace): team A's of 4 nodes x 2 GPUs borrows 4 and runs; team B's urgent one of 2 nodes
    (`numNodes: 2`, 4 GPUs) preempts it and runs."""
    a, b = teams.a, teams.b
    _, runtime, trainjob = example("trainjob-4x2-gpus.yaml")  # the claim template: the teams' own
    trainjob["metadata"]["name"] = "train"

    teams.apply(a, [runtime, trainjob], teams.batch)
    pods = teams.wait_running(a, "train", 4)  # the TrainJob's JobSet has its name
    teams.wait_borrowed(a, 4)
    teams.whole_gpus(a, pods, 2)  # 8 GPUs, each once

    trainjob["spec"]["trainer"]["numNodes"] = 2
    teams.apply(b, [runtime, trainjob], teams.urgent, name="urgent")
    pods = teams.wait_running(b, "urgent", 2)
    teams.preempted(a, "train")
    assert read(teams.dynamic, a, trainjob)["spec"]["suspend"] is True
    teams.wait_released(a, "jobset.sigs.k8s.io/jobset-name=train")
    teams.whole_gpus(b, pods, 2)


def test_a_borrowing_leaderworkerset_group_is_preempted_by_a_higher_priority_one(teams):
    """LWS has no suspend: Kueue runs each group as a pod group. Team A's group of 2 pods x 4 GPUs
    (examples/frameworks/lws-2x4-gpus.yaml) borrows 4 GPUs and runs; team B's urgent LWS, a group of
    2 pods x 2 GPUs (the teams' `two-gpus` template), preempts it: Kueue deletes team A's pods, LWS
    makes them again and Kueue's webhook gates them, their new claims unallocated."""
    a, b = teams.a, teams.b
    documents = example("lws-2x4-gpus.yaml")  # claim template four-gpus, LWS serve-2x4
    teams.apply(a, documents, teams.batch)
    group = "leaderworkerset.sigs.k8s.io/name=serve-2x4"
    pods = teams.wait_running(a, "serve-2x4", 2, selector=group)
    teams.wait_borrowed(a, 4)
    teams.whole_gpus(a, pods, 4)  # 8 GPUs, each once

    lws = documents[-1]
    (claim,) = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["resourceClaims"]
    claim["resourceClaimTemplateName"] = "two-gpus"
    teams.apply(b, [lws], teams.urgent, name="urgent")
    pods = teams.wait_running(b, "urgent", 2, selector="leaderworkerset.sigs.k8s.io/name=urgent")
    teams.preempted(a, "serve-2x4")
    teams.wait_released(a, group, gated=2)
    teams.whole_gpus(b, pods, 2)


@pytest.mark.parametrize(
    ("file", "workers", "borrowed", "urgent_workers"),
    [("rayjob-mps.yaml", 2, "38Gi", 1), ("raycluster-mps.yaml", 4, "36Gi", 2)],
    ids=["rayjob", "raycluster"],
)
def test_a_borrowing_ray_job_is_preempted_by_a_higher_priority_one(teams, file, workers, borrowed, urgent_workers):
    """KubeRay by share memory: team A's RayJob (2 workers x 39Gi = 78Gi on a nominal 40Gi) or
    RayCluster (4 x 19Gi = 76Gi) borrows from team B and runs, head and workers; team B's urgent one
    with fewer workers, within its 40Gi, preempts it: Kueue suspends it, KubeRay deletes its pods (a
    RayJob's whole RayCluster), and team B's runs on its MPS shares."""
    a, b = teams.a, teams.b
    documents = example(file)  # claim template, the RayJob or RayCluster; the head takes no GPU
    job = teams.apply(a, documents, teams.batch)
    pods = teams.wait_running(a, job["metadata"]["name"], 1 + workers, selector=RAY_NODES)
    teams.wait_borrowed(a, int(parse_quantity(borrowed)), SHARE_MEMORY)
    seen = claimed_devices(teams.client, a, pods)
    assert len(seen) == workers and all(len(d) == 1 and d[0].endswith("-mps") for d, _ in seen.values()), seen

    spec = documents[-1]["spec"]
    cluster = spec.get("rayClusterSpec", spec)
    for template in [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]:
        template["metadata"]["labels"]["gpu.fgpu.dev/gang-size"] = str(1 + urgent_workers)
    for group in cluster["workerGroupSpecs"]:
        group.update(replicas=urgent_workers, minReplicas=urgent_workers, maxReplicas=urgent_workers)
    teams.apply(b, documents, teams.urgent, name="urgent")
    pods = teams.wait_running(b, "urgent", 1 + urgent_workers, selector=RAY_NODES)
    teams.preempted(a, job["metadata"]["name"])
    assert read(teams.dynamic, a, job)["spec"]["suspend"] is True
    teams.wait_released(a, RAY_NODES)
    seen = claimed_devices(teams.client, b, pods)
    assert len(seen) == urgent_workers and all(d[0].endswith("-mps") for d, _ in seen.values()), seen
