"""The workload operators' kinds on the test bed, shared by the framework e2e modules: the examples
as the test bed runs them (busybox, the real node) and the devices their containers saw; and Kueue
admitting them (issue 39 item 4): Kueue's manager with
fgpu's device class mappings (examples/kueue/configuration.yaml) and the given integrations, their
webhooks installed (testbed/cluster/kueue_manager.py); queues on fgpu's quota resources; the
framework examples as the test bed runs them (busybox, the real node); what Kueue made of a job."""

from __future__ import annotations

import contextlib
import copy
import functools
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import kubernetes
import yaml

from testbed.cluster.harness import Cluster
from testbed.cluster.images import BUSYBOX_IMAGE
from testbed.cluster.kueue_manager import KueueManager
from testbed.workloads import REPORT, delete_namespaces, report, wait_for
from tests.support import ROOT

KUEUE = ("kueue.x-k8s.io", "v1beta2")
GPUS, SHARE_MEMORY = "gpu.fgpu.dev/gpus", "gpu.fgpu.dev/share-memory"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
ADMISSION_GATE = "kueue.x-k8s.io/admission"  # Kueue's gate on the pods of its pod groups (LWS)
EXAMPLES = ROOT / "examples" / "frameworks"
MOCK_NODE = "c 1:3"  # mock GPUs' device nodes come from /dev/null (see driver/node/cdi.py)


@contextlib.contextmanager
def kueue_for(cluster: Cluster, frameworks: Sequence[str], workdir: Path) -> Iterator[KueueManager]:
    """Kueue with fgpu's mappings and these integrations, their webhooks on (the operators' CRDs
    must be there first: Kueue turns on an integration only for a kind it finds at start)."""
    configuration = yaml.safe_load((ROOT / "examples" / "kueue" / "configuration.yaml").read_text())
    configuration["integrations"] = {"frameworks": list(frameworks)}
    manager = KueueManager(cluster, configuration, workdir, integration_webhooks=True).start()
    try:
        yield manager
    finally:
        manager.stop()


def cluster_queue(name: str, namespace: str, quotas: dict[str, Any], *, cohort: str | None = None,
                  borrowing_limits: dict[str, Any] | None = None,
                  preemption: dict[str, str] | None = None, flavor: str | None = None) -> dict[str, Any]:  # fmt: skip
    """A ClusterQueue for one namespace, of one flavor (named after the queue unless given: queues
    of a cohort lend each other quota of the same flavor only), with these nominal quotas."""
    limits = borrowing_limits or {}
    resources = [
        {
            "name": resource,
            "nominalQuota": quota,
            **({"borrowingLimit": limits[resource]} if resource in limits else {}),
        }
        for resource, quota in quotas.items()
    ]
    spec: dict[str, Any] = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
        "resourceGroups": [
            {"coveredResources": list(quotas), "flavors": [{"name": flavor or name, "resources": resources}]}
        ],
    }
    if cohort:
        spec["cohortName"] = cohort
    if preemption:
        spec["preemption"] = preemption
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": name}, "spec": spec}


@contextlib.contextmanager
def queues(cluster: Cluster, queues_by_namespace: dict[str, dict[str, Any]],
           priorities: dict[str, int] | None = None) -> Iterator[None]:  # fmt: skip
    """Each namespace with its ClusterQueue (and the ResourceFlavors it names) and a LocalQueue
    `gpus` onto it, and the WorkloadPriorityClasses; everything removed after, the namespaces
    (their jobs and Workloads) first, while Kueue runs."""
    client = cluster.api_client()
    core, custom = kubernetes.client.CoreV1Api(client), kubernetes.client.CustomObjectsApi(client)
    made: list[tuple[str, str]] = []
    try:
        for name, value in (priorities or {}).items():
            priority = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass",
                        "metadata": {"name": name}, "value": value}  # fmt: skip
            custom.create_cluster_custom_object(*KUEUE, "workloadpriorityclasses", priority)
            made.append(("workloadpriorityclasses", name))
        for namespace, queue in queues_by_namespace.items():
            core.create_namespace({"metadata": {"name": namespace}})
            made.append(("namespaces", namespace))
            for group in queue["spec"]["resourceGroups"]:
                for name in (f["name"] for f in group["flavors"]):
                    if ("resourceflavors", name) not in made:
                        flavor = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
                                  "metadata": {"name": name}}  # fmt: skip
                        custom.create_cluster_custom_object(*KUEUE, "resourceflavors", flavor)
                        made.append(("resourceflavors", name))
            custom.create_cluster_custom_object(*KUEUE, "clusterqueues", queue)
            made.append(("clusterqueues", queue["metadata"]["name"]))
            local = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "gpus"},
                     "spec": {"clusterQueue": queue["metadata"]["name"]}}  # fmt: skip
            custom.create_namespaced_custom_object(*KUEUE, namespace, "localqueues", local)
        yield
    finally:
        delete_namespaces(core, [name for plural, name in made if plural == "namespaces"])
        for plural, name in reversed(made):
            if plural == "namespaces":
                continue
            try:
                custom.delete_cluster_custom_object(*KUEUE, plural, name)
            except kubernetes.client.ApiException as err:
                if err.status != 404:
                    raise


def on_test_bed(document: dict[str, Any], node: str, queue: str | None = "gpus") -> dict[str, Any]:
    """A framework example as the test bed runs it (as tests/e2e/frameworks/test_framework_examples.py does):
    every container on busybox reporting what it sees, then sleeping, on the real node; the job
    kinds labelled for the LocalQueue `queue`; all else as shipped."""
    document = copy.deepcopy(document)
    if document["kind"] in ("RayCluster", "RayJob"):
        document["metadata"].setdefault("annotations", {})["ray.io/overwrite-container-cmd"] = "true"
    if queue and document["kind"] not in ("ResourceClaimTemplate", "TrainingRuntime", "ClusterTrainingRuntime"):
        document["metadata"].setdefault("labels", {})[QUEUE_LABEL] = queue
    command = ["sh", "-c", f"{REPORT}; exec sleep 3600"]
    for spec in pod_specs(document):
        spec.update(nodeSelector={"kubernetes.io/hostname": node}, terminationGracePeriodSeconds=1)
        for container in spec["containers"]:
            container.update(image=BUSYBOX_IMAGE, imagePullPolicy="Never", command=command)
            container.pop("args", None)
    return document


def create(dynamic: Any, namespace: str, documents: list[dict[str, Any]]) -> None:
    """Create the documents, of any kind, in the namespace (`dynamic`: a kubernetes DynamicClient),
    in order. An operator's admission webhook reads what an object refers to from its informer's
    cache, which may not hold an object created a moment before (Trainer's refuses a TrainJob whose
    TrainingRuntime it has not seen yet): a create refused for something not found is tried again
    until the cache holds it (30 s)."""
    for document in documents:
        resource = dynamic.resources.get(api_version=document["apiVersion"], kind=document["kind"])
        wait_for(functools.partial(_created, resource, document, namespace), timeout=30.0, interval=0.5)


def _created(resource: Any, document: dict[str, Any], namespace: str) -> bool:
    """Whether the document was created now; False where a webhook refused it for something not
    found (yet), any other refusal raised."""
    try:
        resource.create(body=document, namespace=namespace)
    except kubernetes.dynamic.exceptions.ForbiddenError as refused:
        if "not found" not in str(refused.body):
            raise
        return False
    return True


def read(dynamic: Any, namespace: str, document: dict[str, Any]) -> dict[str, Any]:
    """The object a document made, as the API server has it now."""
    resource = dynamic.resources.get(api_version=document["apiVersion"], kind=document["kind"])
    return resource.get(name=document["metadata"]["name"], namespace=namespace).to_dict()


def pod_specs(node: Any) -> Iterator[dict[str, Any]]:
    """Every pod spec in an object, wherever its kind keeps them."""
    if isinstance(node, dict):
        if isinstance(node.get("containers"), list):
            yield node
        for value in node.values():
            yield from pod_specs(value)
    elif isinstance(node, list):
        for item in node:
            yield from pod_specs(item)


def example(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


def workloads_of(custom: kubernetes.client.CustomObjectsApi, namespace: str, owner: str) -> list[dict[str, Any]]:
    """The Workloads Kueue made for a job (owned by it; an LWS's name their owner's name annotation)."""
    found = custom.list_namespaced_custom_object(*KUEUE, namespace, "workloads")["items"]
    return [
        w for w in found
        if any(o.get("name") == owner for o in w["metadata"].get("ownerReferences") or ())
        or (w["metadata"].get("annotations") or {}).get("kueue.x-k8s.io/job-owner-name") == owner
    ]  # fmt: skip


def condition(workload: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in (workload.get("status") or {}).get("conditions") or () if c["type"] == kind), None)


def waiting_for_quota(workload: dict[str, Any], resource: str) -> bool:
    """Kueue has not reserved quota for it, saying that `resource` is short."""
    quota = condition(workload, "QuotaReserved")
    return bool(quota) and quota["status"] == "False" and resource in quota.get("message", "")


def admitted(workload: dict[str, Any]) -> bool:
    found = condition(workload, "Admitted")
    return bool(found) and found["status"] == "True"


def describe(custom: kubernetes.client.CustomObjectsApi, namespace: str) -> str:
    """What Kueue says of the namespace's Workloads, for a failure's message."""
    found = custom.list_namespaced_custom_object(*KUEUE, namespace, "workloads")["items"]

    def said(workload: dict[str, Any]) -> str:
        conditions = (workload.get("status") or {}).get("conditions") or ()
        return ", ".join(f"{c['type']}={c['status']} ({c.get('message', '')})" for c in conditions)

    return "; ".join(f"{w['metadata']['name']}: {said(w)}" for w in found)


def pods_running(core: kubernetes.client.CoreV1Api, namespace: str, selector: str, count: int) -> list[Any]:
    """The selector's `count` pods once all run (none being deleted), else []."""
    found = [p for p in core.list_namespaced_pod(namespace, label_selector=selector).items
             if not p.metadata.deletion_timestamp]  # fmt: skip
    return found if len(found) == count and all(p.status.phase == "Running" for p in found) else []


def claimed_devices(
    client: kubernetes.client.ApiClient, namespace: str, pods: list[Any]
) -> dict[str, tuple[list[str], Any]]:
    """Per pod with a claim: its claim's allocated devices and what its container saw (its report)."""
    core, resource = kubernetes.client.CoreV1Api(client), kubernetes.client.ResourceV1Api(client)
    seen = {}
    for pod in pods:
        if not pod.spec.resource_claims:
            continue
        (status,) = pod.status.resource_claim_statuses
        claim = resource.read_namespaced_resource_claim(status.resource_claim_name, namespace)
        devices = [r.device for r in claim.status.allocation.devices.results]
        seen[pod.metadata.name] = (devices, report(core, pod.metadata.name, namespace))
    return seen


def whole_gpus(seen: dict[str, tuple[list[str], Any]], per_pod: int) -> None:
    """Each pod's container saw `per_pod` whole GPUs of its own, as the mock's device nodes."""
    gpus = []
    for name, (devices, container) in seen.items():
        assert len(devices) == per_pod and all(re.fullmatch(r"gpu-\d", d) for d in devices), (name, devices)
        for device in devices:
            assert container.devices.get(f"/dev/nvidia{device.removeprefix('gpu-')}") == MOCK_NODE, (name, container)
        gpus += devices
    assert len(set(gpus)) == len(gpus), gpus
