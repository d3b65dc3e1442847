"""Kueue admits a JobSet by its quota on fgpu's devices (issue 39 item 4, begun): Kueue's manager
(v0.19, tests/e2e/test_kueue.py's) with examples/kueue/configuration.yaml's device class mappings and
its JobSet integration on, a ClusterQueue of 10 whole GPUs (`gpu.fgpu.dev/gpus`) for the 8-GPU real
node. A JobSet of 4 Jobs x 2 GPUs is admitted and its pods run; a second JobSet of 2 x 2 GPUs waits
suspended, without a pod, until the first is gone, then runs. Kueue admits by quota and fgpu's
controller places: a JobSet of 5 x 2 GPUs, opted in, is admitted (10 of 10) but its gang fits no
node, so nothing of it is allocated and no pod runs. The JobSets are created suspended, as Kueue asks
where its JobSet webhook is not installed (the test bed installs Kueue's webhooks for its own kinds
and batch Jobs only)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from driver.scheduling.opt_in import OPT_IN_LABEL, OPT_IN_VALUE, SCHEDULING_GATE
from testbed.cluster.kueue_manager import KueueManager
from testbed.workloads import claim_template, delete_namespace, pod_spec, unique, wait_until
from tests.support import ROOT
from tests.support.controller import running_controller

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]

KUEUE = ("kueue.x-k8s.io", "v1beta2")
JOBSET = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
WAIT_S = 120
GPU = "gpu.fgpu.dev"


@pytest.fixture(scope="module")
def kueue(cluster, jobset_operator, tmp_path_factory) -> Iterator[KueueManager]:
    """Kueue with fgpu's mappings and the JobSet integration (JobSet's CRD is there first: Kueue
    turns on an integration only for a kind it finds at start)."""
    configuration = yaml.safe_load((ROOT / "examples" / "kueue" / "configuration.yaml").read_text())
    configuration["integrations"] = {"frameworks": ["batch/job", "jobset.x-k8s.io/jobset"]}
    manager = KueueManager(cluster, configuration, Path(tmp_path_factory.mktemp("kueue"))).start()
    try:
        yield manager
    finally:
        manager.stop()


@pytest.fixture
def queue(cluster, kueue, real_node, node_plugin) -> Iterator[str]:
    """A namespace with a LocalQueue `gpus` onto a ClusterQueue of 10 whole GPUs; claim templates of
    2 GPUs, one opted in to fgpu's controller."""
    client = cluster.api_client()
    core, custom = kubernetes.client.CoreV1Api(client), kubernetes.client.CustomObjectsApi(client)
    namespace = unique("kueue-jobsets")
    core.create_namespace({"metadata": {"name": namespace}})
    flavor = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": namespace}}
    resources = [{"name": "gpu.fgpu.dev/gpus", "nominalQuota": 10}]
    cluster_queue = {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "ClusterQueue",
        "metadata": {"name": namespace},
        "spec": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "resourceGroups": [{"coveredResources": ["gpu.fgpu.dev/gpus"],
                                "flavors": [{"name": namespace, "resources": resources}]}],
        },
    }  # fmt: skip
    local = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "gpus"},
             "spec": {"clusterQueue": namespace}}  # fmt: skip
    try:
        custom.create_cluster_custom_object(*KUEUE, "resourceflavors", flavor)
        custom.create_cluster_custom_object(*KUEUE, "clusterqueues", cluster_queue)
        custom.create_namespaced_custom_object(*KUEUE, namespace, "localqueues", local)
        resource = kubernetes.client.ResourceV1Api(client)
        resource.create_namespaced_resource_claim_template(namespace, claim_template("two-gpus", GPU, count=2))
        placed = claim_template("two-gpus-placed", GPU, count=2)
        placed["spec"]["metadata"] = {"labels": {OPT_IN_LABEL: OPT_IN_VALUE}}
        resource.create_namespaced_resource_claim_template(namespace, placed)
        yield namespace
    finally:
        delete_namespace(core, namespace)
        for plural in ("clusterqueues", "resourceflavors"):
            try:
                custom.delete_cluster_custom_object(*KUEUE, plural, namespace)
            except kubernetes.client.ApiException as err:
                if err.status != 404:
                    raise


def jobset(name: str, node: str, jobs: int, placed: bool = False) -> dict[str, Any]:
    """`jobs` Jobs of one pod with 2 GPUs; `placed`: opted in to fgpu's controller, the pods gated
    (no webhook here adds the gate)."""
    spec = {**pod_spec(node, "two-gpus-placed" if placed else "two-gpus"), "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1}  # fmt: skip
    if placed:
        spec["schedulingGates"] = [{"name": SCHEDULING_GATE}]
    job = {"parallelism": 1, "completions": 1, "backoffLimit": 0, "template": {"spec": spec}}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "labels": {"kueue.x-k8s.io/queue-name": "gpus"}},
        "spec": {"suspend": True, "replicatedJobs": [{"name": "w", "replicas": jobs, "template": {"spec": job}}]},
    }


def test_kueue_admits_jobsets_by_their_gpu_quota(cluster, real_node, queue):
    client = cluster.api_client()
    core, custom = kubernetes.client.CoreV1Api(client), kubernetes.client.CustomObjectsApi(client)

    def pods(name: str) -> list[Any]:
        found = core.list_namespaced_pod(queue, label_selector=f"jobset.sigs.k8s.io/jobset-name={name}").items
        return [p for p in found if not p.metadata.deletion_timestamp]

    def running(name: str, count: int) -> list[Any]:
        found = pods(name)
        return found if len(found) == count and all(p.status.phase == "Running" for p in found) else []

    def suspended(name: str) -> bool:
        return bool(custom.get_namespaced_custom_object(*JOBSET[:2], queue, JOBSET[2], name)["spec"].get("suspend"))

    first, second = unique("js"), unique("js")
    custom.create_namespaced_custom_object(*JOBSET[:2], queue, JOBSET[2], jobset(first, real_node.name, 4))
    wait_until("the first JobSet's 4 pods running", lambda: running(first, 4), timeout_s=WAIT_S)
    custom.create_namespaced_custom_object(*JOBSET[:2], queue, JOBSET[2], jobset(second, real_node.name, 2))

    def workload_pending() -> bool:
        workloads = custom.list_namespaced_custom_object(*KUEUE, queue, "workloads")["items"]
        mine = [w for w in workloads if any(o.get("name") == second for o in w["metadata"].get("ownerReferences", []))]
        conditions = {c["type"]: c for w in mine for c in (w.get("status") or {}).get("conditions", [])}
        quota = conditions.get("QuotaReserved")
        return bool(quota) and quota["status"] == "False" and "gpu.fgpu.dev/gpus" in quota.get("message", "")

    wait_until("the second JobSet's Workload waiting for GPU quota", workload_pending, timeout_s=WAIT_S)
    assert suspended(second) and not pods(second)

    custom.delete_namespaced_custom_object(*JOBSET[:2], queue, JOBSET[2], first, propagation_policy="Foreground")
    wait_until("the second JobSet running", lambda: running(second, 2), timeout_s=WAIT_S)
    assert not suspended(second)


@pytest.fixture
def controller(cluster, queue) -> Iterator[subprocess.Popen]:
    with running_controller(cluster.kubeconfig, f"--lease-namespace={queue}") as process:
        yield process


def test_an_admitted_jobset_whose_gang_fits_no_node_holds_nothing(cluster, real_node, queue, controller):
    client = cluster.api_client()
    core, custom = kubernetes.client.CoreV1Api(client), kubernetes.client.CustomObjectsApi(client)
    resource = kubernetes.client.ResourceV1Api(client)
    name = unique("js")
    custom.create_namespaced_custom_object(*JOBSET[:2], queue, JOBSET[2], jobset(name, real_node.name, 5, True))

    def admitted() -> bool:
        found = custom.get_namespaced_custom_object(*JOBSET[:2], queue, JOBSET[2], name)
        return not found["spec"].get("suspend")

    wait_until("Kueue admitting the JobSet (10 GPUs of 10)", admitted, timeout_s=WAIT_S)

    def refused() -> bool:
        events = core.list_namespaced_event(queue).items
        return any(e.reason == "FailedAllocation" and "gang cannot be placed whole" in e.message for e in events)

    wait_until("fgpu's controller refusing the gang whole", refused, timeout_s=WAIT_S)
    time.sleep(3)  # a few passes more: still nothing
    claims = resource.list_namespaced_resource_claim(queue).items
    assert len(claims) == 5 and not [c.metadata.name for c in claims if c.status and c.status.allocation]
    pods = core.list_namespaced_pod(queue, label_selector=f"jobset.sigs.k8s.io/jobset-name={name}").items
    assert len(pods) == 5 and all(p.spec.scheduling_gates and not p.spec.node_name for p in pods)
