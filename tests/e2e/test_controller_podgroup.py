"""Upstream gangs on the real control plane (GenericWorkload on, scheduling.k8s.io/v1beta1 served):
a PodGroup with a gang policy of minCount 4 and four gated pods, each with an opt-in claim made
from a template, on two fake nodes of 8 GPUs with room for three of the four claims of 4 GPUs.
The controller allocates nothing (and says why, on the claims, the pods and the PodGroup); once
capacity frees it places all four, by its own decision, and kube-scheduler binds the pods."""

from __future__ import annotations

import uuid
from typing import Any

import kubernetes
import pytest

from testbed.workloads import wait_for
from tests.support.controller import by_kube_scheduler, events_on, gated_pod

pytestmark = pytest.mark.cluster
NS = "default"
OPT_IN = {"gpu.fgpu.dev/allocator": "fgpu"}
GPUS = {"name": "gpu", "exactly": {"deviceClassName": "gpu.fgpu.dev", "count": 4}}


# Plugins and kubelet stand-ins on node-a and node-b (8 GPUs each), one first-fit controller.


def member(name: str, group: str, template: str) -> dict[str, Any]:
    body = gated_pod(name, "")
    body["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": template}]
    body["spec"]["schedulingGroup"] = {"podGroupName": group}
    return body


def claim_of(core_api, resource_api, pod: str) -> Any:
    """The claim kube-controller-manager made for the pod from its template (None until named)."""
    statuses = core_api.read_namespaced_pod(pod, NS).status.resource_claim_statuses or []
    names = [s.resource_claim_name for s in statuses if s.resource_claim_name]
    return resource_api.read_namespaced_resource_claim(names[0], NS) if names else None


def test_a_podgroup_gang_is_allocated_all_or_nothing(controlled_nodes, cluster, resource_api, core_api):
    scheduling = kubernetes.client.SchedulingV1beta1Api(cluster.api_client())
    suffix = uuid.uuid4().hex[:6]
    group, template, blocker = f"train-{suffix}", f"four-gpus-{suffix}", f"blocker-{suffix}"
    pods = [f"{group}-{i}" for i in range(4)]
    resource_api.create_namespaced_resource_claim_template(
        NS,
        {
            "metadata": {"name": template},
            "spec": {"metadata": {"labels": OPT_IN}, "spec": {"devices": {"requests": [GPUS]}}},
        },
    )
    # 4 of the 16 GPUs taken by a lone claim: room for three members of four GPUs, not four.
    resource_api.create_namespaced_resource_claim(
        NS, {"metadata": {"name": blocker, "labels": OPT_IN}, "spec": {"devices": {"requests": [GPUS]}}}
    )
    scheduling.create_namespaced_pod_group(
        NS,
        {
            "apiVersion": "scheduling.k8s.io/v1beta1",
            "kind": "PodGroup",
            "metadata": {"name": group},
            "spec": {"schedulingPolicy": {"gang": {"minCount": 4}}},
        },
    )
    try:
        wait_for(lambda: resource_api.read_namespaced_resource_claim(blocker, NS).status.allocation, timeout=30)
        for name in pods[:3]:
            core_api.create_namespaced_pod(NS, member(name, group, template))
        three = f"pod group {NS}/{group} waits for 1 more pod(s) of 4"  # once their claims are made
        waiting = lambda: [e for e in events_on(core_api, "PodGroup", group, "WaitingForGang") if e.message == three]  # noqa: E731
        wait_for(waiting, timeout=30)
        core_api.create_namespaced_pod(NS, member(pods[3], group, template))

        (failed, *_) = wait_for(lambda: events_on(core_api, "PodGroup", group, "FailedAllocation"), timeout=30)
        assert failed.message.startswith(f"pod group {NS}/{group} (gang of 4 pods): gang cannot be placed whole")
        assert wait_for(lambda: events_on(core_api, "Pod", pods[3], "FailedAllocation"), timeout=10)
        claims = [claim_of(core_api, resource_api, name) for name in pods]
        assert all(c is not None and c.status.allocation is None for c in claims), "a member was allocated"
        assert all(core_api.read_namespaced_pod(name, NS).spec.scheduling_gates for name in pods)

        resource_api.delete_namespaced_resource_claim(blocker, NS)  # capacity frees

        def allocated() -> list[Any] | None:
            found = [claim_of(core_api, resource_api, name) for name in pods]
            return found if all(c.status.allocation for c in found) else None

        claims = wait_for(allocated, timeout=60)
        placed = sorted(c.status.allocation.devices.results[0].pool for c in claims)
        assert placed == ["node-a", "node-a", "node-b", "node-b"]
        devices = [(r.pool, r.device) for c in claims for r in c.status.allocation.devices.results]
        assert len(devices) == len(set(devices)) == 16
        for name, claim in zip(pods, claims, strict=True):
            pod = wait_for(lambda n=name: (p := core_api.read_namespaced_pod(n, NS)).spec.node_name and p, timeout=60)
            assert pod.spec.node_name == claim.status.allocation.devices.results[0].pool
            wait_for(lambda p=pod: p.metadata.uid in controlled_nodes.kubelets[p.spec.node_name].prepared, timeout=30)
        claims = [claim_of(core_api, resource_api, name) for name in pods]
        assert not any(by_kube_scheduler(resource_api, c.metadata.name) for c in claims), "re-allocated"
    finally:
        for name in pods:
            try:
                core_api.delete_namespaced_pod(name, NS)
            except kubernetes.client.ApiException as err:
                if err.status != 404:
                    raise
        wait_for(lambda: not any(p.metadata.name in pods for p in core_api.list_namespaced_pod(NS).items), timeout=60)
        scheduling.delete_namespaced_pod_group(group, NS)
        resource_api.delete_namespaced_resource_claim_template(template, NS)
        try:
            resource_api.delete_namespaced_resource_claim(blocker, NS)
        except kubernetes.client.ApiException as err:
            if err.status != 404:
                raise
