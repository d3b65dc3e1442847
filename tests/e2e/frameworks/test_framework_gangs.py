"""A JobSet's gang placed all or nothing by fgpu's controller on the real node (issue 39 item 3):
JobSet's pods carry its name and how many Jobs it has (driver/scheduling/framework_gangs.py), so
the controller (`fgpu controller`, a process as in test_controller.py) waits for every pod of the
JobSet and places their opt-in claims together. A JobSet of 5 Jobs x 2 GPUs on the 8-GPU node:
nothing is allocated and no pod runs; one of 4 x 2: every pod runs with its GPUs. The pods carry the
controller's scheduling gate in their template (no webhook in this module adds it)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest

from driver.scheduling.opt_in import OPT_IN_LABEL, OPT_IN_VALUE, SCHEDULING_GATE
from testbed.cluster.node import RealNode
from testbed.workloads import claim_template, delete_namespace, pod_spec, report, unique, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]

MOCK_NODE = "c 1:3"


@pytest.fixture
def namespace(cluster, real_node: RealNode, node_plugin) -> Iterator[str]:
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    name = unique("gangs")
    core.create_namespace({"metadata": {"name": name}})
    try:
        yield name
    finally:
        delete_namespace(core, name)


def jobset(name: str, node: str, template: str, jobs: int) -> dict[str, Any]:
    spec = {**pod_spec(node, template), "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
            "schedulingGates": [{"name": SCHEDULING_GATE}]}  # fmt: skip
    job = {"parallelism": 1, "completions": 1, "backoffLimit": 0, "template": {"spec": spec}}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name},
        "spec": {"replicatedJobs": [{"name": "workers", "replicas": jobs, "template": {"spec": job}}]},
    }


def test_a_jobset_gang_is_placed_whole_or_not_at_all(cluster, real_node, namespace, controller, jobset_operator):
    client = cluster.api_client()
    core, resource = kubernetes.client.CoreV1Api(client), kubernetes.client.ResourceV1Api(client)
    custom = kubernetes.client.CustomObjectsApi(client)
    template = claim_template(unique("two-gpus"), "gpu.fgpu.dev", count=2)
    template["spec"]["metadata"] = {"labels": {OPT_IN_LABEL: OPT_IN_VALUE}}
    resource.create_namespaced_resource_claim_template(namespace, template)
    name = template["metadata"]["name"]

    def pods(jobset_name: str) -> list[Any]:
        selector = f"jobset.sigs.k8s.io/jobset-name={jobset_name}"
        return [p for p in core.list_namespaced_pod(namespace, label_selector=selector).items
                if not p.metadata.deletion_timestamp]  # fmt: skip

    def claims() -> list[Any]:
        return resource.list_namespaced_resource_claim(namespace).items

    # 5 x 2 GPUs on 8: every claim made, the controller says why, nothing allocated, no pod runs.
    too_big = unique("js")
    custom.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets",
                                           jobset(too_big, real_node.name, name, 5))  # fmt: skip
    wait_until("5 claims made", lambda: len(claims()) == 5)

    def refused() -> bool:
        events = core.list_namespaced_event(namespace).items
        return any(e.reason == "FailedAllocation" and "gang cannot be placed whole" in e.message for e in events)

    wait_until("the controller's refusal", refused, timeout_s=60)
    time.sleep(3)  # a few passes more: still nothing
    assert not [c.metadata.name for c in claims() if c.status and c.status.allocation]
    assert all(p.spec.scheduling_gates and not p.spec.node_name for p in pods(too_big))
    assert len(pods(too_big)) == 5

    custom.delete_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", too_big,
                                           propagation_policy="Foreground")  # fmt: skip
    wait_until("the first JobSet's pods and claims gone", lambda: not pods(too_big) and not claims(), timeout_s=120)

    # 4 x 2 GPUs: all placed, the gates lifted, every pod runs with its 2 GPUs.
    fits = unique("js")
    custom.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets",
                                           jobset(fits, real_node.name, name, 4))  # fmt: skip

    def running() -> list[Any]:
        found = pods(fits)
        return found if len(found) == 4 and all(p.status.phase == "Running" for p in found) else []

    ran = wait_until("4 pods running", running, timeout_s=120)
    gpus = []
    for pod in ran:
        assert pod.spec.node_name == real_node.name and not pod.spec.scheduling_gates
        (status,) = pod.status.resource_claim_statuses
        claim = resource.read_namespaced_resource_claim(status.resource_claim_name, namespace)
        devices = [r.device for r in claim.status.allocation.devices.results]
        seen = report(core, pod.metadata.name, namespace)
        assert len(devices) == 2 and all(seen.devices.get(f"/dev/nvidia{d[4:]}") == MOCK_NODE for d in devices)
        gpus += devices
    assert len(set(gpus)) == 8
