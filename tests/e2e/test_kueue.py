"""Kueue's quotas on fgpu's devices, end to end on the real node: Kueue's manager (v0.19, built from
its module) with examples/kueue/configuration.yaml, two teams' queues from examples/kueue/queues.yaml,
and Jobs from examples/kueue/jobs.yaml whose containers run on the real node. Each Job runs until
the test tells it to finish (a file in its container), so "another finishes" is the test's choice."""

from __future__ import annotations

import copy
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from kubernetes.stream import stream
from kubernetes.utils import parse_quantity

from driver.scheduling.opt_in import OPT_IN_LABEL, SCHEDULING_GATE
from testbed.cluster.images import BUSYBOX_IMAGE
from testbed.cluster.kueue_manager import KueueManager
from testbed.workloads import delete_namespaces, wait_until
from tests.support import ROOT
from tests.support.controller import CONTROLLER, by_kube_scheduler

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]

EXAMPLES = ROOT / "examples" / "kueue"
TEAMS = ("team-a", "team-b")
KUEUE = ("kueue.x-k8s.io", "v1beta2")
GPUS, MIG_SLICES, SHARE_MEMORY = "gpu.fgpu.dev/gpus", "gpu.fgpu.dev/mig-slices", "gpu.fgpu.dev/share-memory"
MiB = 2**20
FINISH = "/tmp/finish"
WAIT_S = 120


def documents(name: str) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((EXAMPLES / name).read_text()))


@pytest.fixture(scope="module")
def kueue(cluster, tmp_path_factory) -> Iterator[KueueManager]:
    configuration = yaml.safe_load((EXAMPLES / "configuration.yaml").read_text())
    manager = KueueManager(cluster, configuration, Path(tmp_path_factory.mktemp("kueue"))).start()
    try:
        yield manager
    finally:
        manager.stop()


@pytest.fixture(scope="module")
def teams(cluster, kueue, real_node, node_plugin) -> Iterator[Teams]:
    """The teams' namespaces, queues and claim templates, as the examples have them."""
    client = cluster.api_client()
    core = kubernetes.client.CoreV1Api(client)
    for team in TEAMS:
        core.create_namespace({"metadata": {"name": team}})
    queues = documents("queues.yaml")
    custom = kubernetes.client.CustomObjectsApi(client)
    try:
        for obj in queues:
            _create(custom, obj)
        for team in TEAMS:
            for template in (d for d in documents("jobs.yaml") if d["kind"] == "ResourceClaimTemplate"):
                kubernetes.utils.create_from_dict(client, template, namespace=team)
        yield Teams(cluster, real_node.name)
    finally:
        delete_namespaces(core, list(TEAMS))  # their Jobs, Workloads and LocalQueues with them, while Kueue runs
        for obj in reversed(queues):
            if "namespace" not in obj["metadata"]:
                _delete(custom, obj)


def _plural(kind: str) -> str:
    return kind.lower() + ("es" if kind.endswith("s") else "s")


def _create(custom: kubernetes.client.CustomObjectsApi, obj: dict[str, Any]) -> None:
    namespace = obj["metadata"].get("namespace")
    if namespace:
        custom.create_namespaced_custom_object(*KUEUE, namespace, _plural(obj["kind"]), obj)
    else:
        custom.create_cluster_custom_object(*KUEUE, _plural(obj["kind"]), obj)


def _delete(custom: kubernetes.client.CustomObjectsApi, obj: dict[str, Any]) -> None:
    try:
        custom.delete_cluster_custom_object(*KUEUE, _plural(obj["kind"]), obj["metadata"]["name"])
    except kubernetes.client.ApiException as err:
        if err.status != 404:
            raise


class Teams:
    """The teams' Jobs (examples/kueue/jobs.yaml, run on the real node) and what Kueue made of them."""

    def __init__(self, cluster, node: str) -> None:
        client = cluster.api_client()
        self.core = kubernetes.client.CoreV1Api(client)
        self.batch = kubernetes.client.BatchV1Api(client)
        self.custom = kubernetes.client.CustomObjectsApi(client)
        self.resource = kubernetes.client.ResourceV1Api(client)
        self.node = node
        self.jobs = {d["metadata"]["name"]: d for d in documents("jobs.yaml") if d["kind"] == "Job"}

    def submit(self, team: str, example: str, name: str, priority: str | None = None) -> str:
        """The example Job under a new name, its container on the real node, running until told."""
        job = copy.deepcopy(self.jobs[example])
        job["metadata"]["name"] = name
        if priority:
            job["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] = priority
        spec = job["spec"]["template"]["spec"]
        spec["nodeSelector"] = {"kubernetes.io/hostname": self.node}
        spec["terminationGracePeriodSeconds"] = 1
        (container,) = spec["containers"]
        container.update(image=BUSYBOX_IMAGE, imagePullPolicy="Never")
        container["command"] = ["sh", "-c", f"until [ -e {FINISH} ]; do sleep 0.2; done"]
        self.batch.create_namespaced_job(team, job)
        return name

    def workload(self, team: str, job: str) -> dict[str, Any] | None:
        workloads = self.custom.list_namespaced_custom_object(*KUEUE, team, "workloads")["items"]
        owned = [w for w in workloads if any(o["name"] == job for o in w["metadata"].get("ownerReferences", ()))]
        return owned[0] if owned else None

    def condition(self, team: str, job: str, kind: str) -> dict[str, Any] | None:
        workload = self.workload(team, job) or {}
        conditions = (workload.get("status") or {}).get("conditions") or ()
        return next((c for c in conditions if c["type"] == kind and c["status"] == "True"), None)

    def usage(self, team: str, job: str) -> dict[str, int]:
        """What Kueue charged the team's quota for the Job (in units: bytes, devices)."""
        workload = self.workload(team, job) or {}
        (assignment,) = workload["status"]["admission"]["podSetAssignments"]
        return {name: int(parse_quantity(value)) for name, value in assignment["resourceUsage"].items()}

    def running_pod(self, team: str, job: str) -> Any:
        pods = self.core.list_namespaced_pod(team, label_selector=f"batch.kubernetes.io/job-name={job}").items
        return next((p for p in pods if p.status.phase == "Running" and not p.metadata.deletion_timestamp), None)

    def wait_running(self, team: str, job: str) -> Any:
        def running() -> Any:
            return self.condition(team, job, "Admitted") and self.running_pod(team, job)

        return self._wait(team, job, "admitted and running", running)

    def _wait(self, team: str, job: str, what: str, probe: Any) -> Any:
        """wait_until, failing with what Kueue says of the Job's workload."""
        try:
            return wait_until(f"{team}/{job} {what}", probe, timeout_s=WAIT_S)
        except AssertionError as err:
            status = (self.workload(team, job) or {}).get("status")
            raise AssertionError(f"{err}; its workload's status: {status}") from None

    def suspended(self, team: str, job: str) -> bool:
        return bool(self.batch.read_namespaced_job(job, team).spec.suspend)

    def wait_waiting(self, team: str, job: str) -> None:
        """Kueue holds the Job: suspended, its workload pending without quota, no pod."""

        def waiting() -> bool:
            pending = self.condition(team, job, "QuotaReserved") is None and self.workload(team, job) is not None
            return pending and self.suspended(team, job) and self.running_pod(team, job) is None

        self._wait(team, job, "suspended, waiting for quota", waiting)

    def finish(self, team: str, job: str) -> None:
        pod = self.running_pod(team, job)
        stream(self.core.connect_get_namespaced_pod_exec, pod.metadata.name, team, command=["touch", FINISH],
               stderr=True, stdin=False, stdout=True, tty=False)  # fmt: skip
        wait_until(f"{team}/{job} finished", lambda: self.condition(team, job, "Finished"), timeout_s=WAIT_S)

    def delete_all(self) -> None:
        """Every team's Jobs, waited for until their pods are gone (their quota then is free)."""
        for team in TEAMS:
            for job in self.batch.list_namespaced_job(team).items:
                self.batch.delete_namespaced_job(
                    job.metadata.name, team, propagation_policy="Foreground", grace_period_seconds=1
                )

        def gone() -> bool:
            # Foreground: a Job is gone once its pods and its Workload (Kueue's quota) are.
            return not any(self.batch.list_namespaced_job(team).items for team in TEAMS)

        wait_until("the teams' jobs and pods gone", gone, timeout_s=WAIT_S)


@pytest.fixture(autouse=True)
def _jobs_deleted(teams: Teams) -> Iterator[None]:
    """Each test starts with the teams' quotas free, also after one that failed half-way."""
    yield
    teams.delete_all()


def test_within_quota_jobs_run_and_over_quota_they_wait_suspended_until_another_finishes(teams: Teams):
    # MIG: team-a has 4 MIG memory slices and lends none. A 3g.40gb (four of the GPU's eight
    # memory slices, as the hardware gives it) leaves none for a 1g.10gb (one slice), which waits.
    teams.submit("team-a", "eval-3g", "eval")
    teams.wait_running("team-a", "eval")
    assert teams.usage("team-a", "eval") == {MIG_SLICES: 4}
    teams.submit("team-a", "notebook-1g", "notebook")
    teams.wait_waiting("team-a", "notebook")
    teams.finish("team-a", "eval")
    teams.wait_running("team-a", "notebook")
    assert teams.usage("team-a", "notebook") == {MIG_SLICES: 1}

    # MPS: team-b has 20Gi of share memory; two 10Gi shares run, a third waits for one to finish.
    # (The third is submitted once two run: Kueue orders by creation time, whole seconds, so three
    # submitted together could be admitted in any order.)
    for name in ("serve-1", "serve-2"):
        teams.submit("team-b", "serve-mps", name)
    teams.wait_running("team-b", "serve-1")
    teams.wait_running("team-b", "serve-2")
    assert teams.usage("team-b", "serve-1") == {SHARE_MEMORY: 10 * 1024 * MiB}
    teams.submit("team-b", "serve-mps", "serve-3")
    teams.wait_waiting("team-b", "serve-3")
    teams.finish("team-b", "serve-1")
    teams.wait_running("team-b", "serve-3")


def test_a_team_borrows_idle_gpus_of_the_cohort_and_gives_them_back_when_the_owner_needs_them(teams: Teams):
    teams.submit("team-a", "train", "train-1")
    teams.wait_running("team-a", "train-1")
    assert teams.usage("team-a", "train-1") == {GPUS: 1}
    teams.submit("team-a", "train", "train-2")  # over team-a's 1 GPU: borrows team-b's idle one
    teams.wait_running("team-a", "train-2")

    teams.submit("team-b", "train", "own")  # team-b wants its GPU back
    teams.wait_running("team-b", "own")
    preempted = teams.condition("team-a", "train-2", "Evicted") or teams.condition("team-a", "train-1", "Evicted")
    assert preempted is not None and preempted["reason"] == "Preempted", preempted
    assert "reclaim" in preempted["message"].lower() or "cohort" in preempted["message"].lower(), preempted
    borrower = "train-2" if teams.condition("team-a", "train-2", "Evicted") else "train-1"
    teams.wait_waiting("team-a", borrower)  # back in the queue, suspended
    assert teams.running_pod("team-a", "train-1" if borrower == "train-2" else "train-2") is not None

    teams.finish("team-b", "own")  # team-b's GPU idle again: team-a borrows it again
    teams.wait_running("team-a", borrower)


def test_a_higher_priority_job_preempts_a_lower_one_in_the_same_queue(teams: Teams):
    teams.submit("team-b", "eval-3g", "batch-eval", priority="batch")
    teams.wait_running("team-b", "batch-eval")
    teams.submit("team-b", "eval-3g", "urgent-eval", priority="urgent")  # 40448Mi more: none to borrow
    teams.wait_running("team-b", "urgent-eval")
    evicted = teams.condition("team-b", "batch-eval", "Evicted")
    assert evicted is not None and evicted["reason"] == "Preempted", evicted
    teams.wait_waiting("team-b", "batch-eval")
    teams.finish("team-b", "urgent-eval")
    teams.wait_running("team-b", "batch-eval")


@pytest.fixture(scope="module")
def fgpu_controller(cluster) -> Iterator[None]:
    process = subprocess.Popen([*CONTROLLER, f"--kubeconfig={cluster.kubeconfig}", "--lease-namespace=default"])
    try:
        yield
    finally:
        process.terminate()
        process.wait(timeout=15)


def test_kueue_admits_and_the_fgpu_controller_places_opt_in_claims(teams: Teams, fgpu_controller):
    job = teams.jobs["train-placed"]
    assert job["spec"]["template"]["spec"]["schedulingGates"] == [{"name": SCHEDULING_GATE}]
    teams.submit("team-a", "train-placed", "placed")
    pod = teams.wait_running("team-a", "placed")  # admitted by quota, then placed and ungated
    assert teams.usage("team-a", "placed") == {GPUS: 1}
    (status,) = pod.status.resource_claim_statuses
    claim = teams.resource.read_namespaced_resource_claim(status.resource_claim_name, "team-a")
    assert claim.metadata.labels[OPT_IN_LABEL] == "fgpu" and claim.status.allocation is not None
    assert not by_kube_scheduler(teams.resource, claim.metadata.name, "team-a")
    assert not pod.spec.scheduling_gates
