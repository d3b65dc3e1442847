"""End to end on the real node, containers running: fgpu's controller makes room (issue 28).

A Deployment of movable MPS-share pods spread over the two GPUs the test's claims may use (CEL:
GPU 0 or 1), a pod that is not movable beside one of them, a PodDisruptionBudget; a whole-GPU pod
then fits nowhere. While the budget allows no disruption the controller evicts nothing; once it
allows one, the controller evicts the one movable pod whose GPU it empties, the Deployment's new
pod is placed beside its sibling (the freed GPU is reserved), and the whole-GPU pod runs there.
A pod of higher priority preempts one of lower priority, never one of its own. The benchmark of
how long such a claim waits (bench/make_room_wait.py) runs one round."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest

from bench import make_room_wait
from driver.scheduling.opt_in import MOVABLE_ANNOTATION, OPT_IN_LABEL, OPT_IN_VALUE, SCHEDULING_GATE
from testbed.cluster.harness import free_port
from testbed.workloads import NS, claim_template, deployment, pod, unique, wait_until
from tests.support.controller import CONTROLLER
from tests.support.metrics import scrape, value

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]

TWO_GPUS = 'device.attributes["gpu.fgpu.dev"].index <= 1'


@pytest.fixture(scope="module")
def controller(cluster, node_plugin) -> Iterator[int]:
    """fgpu's controller making room (at most 5 evictions a minute); its metrics port."""
    port = free_port()
    process = subprocess.Popen(
        [
            *CONTROLLER,
            f"--kubeconfig={cluster.kubeconfig}",
            "--lease-namespace=default",
            f"--metrics-port={port}",
            "--make-room",
            "--evictions-per-minute=5",
        ]
    )
    try:
        wait_until("the controller leads", lambda: value(scrape(port), "fgpu_controller_leader") == 1)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=15)


def opt_in(template: dict[str, Any]) -> dict[str, Any]:
    template["spec"]["metadata"] = {"labels": {OPT_IN_LABEL: OPT_IN_VALUE}}
    return template


def gated(spec: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {**spec, "schedulingGates": [{"name": SCHEDULING_GATE}], **more}


def create(cluster, workloads, obj: dict[str, Any]) -> None:
    kubernetes.utils.create_from_dict(cluster.api_client(), obj, namespace=NS)
    workloads.append((obj["kind"], obj["metadata"]["name"]))


def share_template(memory: str) -> dict[str, Any]:
    return opt_in(claim_template(unique("share"), "mps.gpu.fgpu.dev", selector=TWO_GPUS, capacity={"memory": memory}))


def bare_pod(node: str, template: dict[str, Any], **spec: Any) -> dict[str, Any]:
    obj = pod(unique("pod"), node, template["metadata"]["name"])
    obj["spec"] = gated(obj["spec"], **spec)
    return obj


def gpu_of(resource_api, core_api, pod_name: str) -> str:
    """The device the pod's (template) claim was allocated."""
    found = core_api.read_namespaced_pod(pod_name, NS)
    claim_name = found.status.resource_claim_statuses[0].resource_claim_name
    claim = resource_api.read_namespaced_resource_claim(claim_name, NS)
    return claim.status.allocation.devices.results[0].device


def running(core_api, name: str) -> bool:
    try:
        return core_api.read_namespaced_pod(name, NS).status.phase == "Running"
    except kubernetes.client.ApiException as err:
        if err.status == 404:
            return False
        raise


def replicas_of(core_api, app: str) -> dict[str, Any]:
    """name -> pod of the Deployment's pods not being deleted."""
    items = core_api.list_namespaced_pod(NS, label_selector=f"app={app}").items
    return {p.metadata.name: p for p in items if p.metadata.deletion_timestamp is None}


def claim_events(core_api, pod_name: str) -> list[str]:
    found = core_api.read_namespaced_pod(pod_name, NS)
    statuses = found.status.resource_claim_statuses or []
    if not statuses:
        return []
    selector = f"involvedObject.name={statuses[0].resource_claim_name}"
    return [e.message for e in core_api.list_namespaced_event(NS, field_selector=selector).items]


def test_movable_pods_are_moved_within_their_budget_and_the_whole_gpu_pod_runs(
    cluster, core_api, resource_api, real_node, node_plugin, controller, workloads
):
    node = real_node.name
    apps = kubernetes.client.AppsV1Api(cluster.api_client())
    small, big = share_template("10Gi"), share_template("60Gi")
    whole = opt_in(claim_template(unique("whole"), "gpu.fgpu.dev", selector=TWO_GPUS))
    for template in (small, big, whole):
        create(cluster, workloads, template)

    # One replica; a pod that fills the rest of its GPU; the second replica then goes to the other.
    app = unique("infer")
    infer = deployment(app, node, small["metadata"]["name"], replicas=1)
    template = infer["spec"]["template"]
    template["metadata"]["annotations"] = {MOVABLE_ANNOTATION: "true"}
    template["spec"] = gated(template["spec"])
    create(cluster, workloads, infer)
    wait_until(
        "the first replica runs",
        lambda: [p for p in replicas_of(core_api, app).values() if p.status.phase == "Running"],
    )
    filler = bare_pod(node, big)
    create(cluster, workloads, filler)
    wait_until("the filler runs", lambda: running(core_api, filler["metadata"]["name"]))
    apps.patch_namespaced_deployment_scale(app, NS, {"spec": {"replicas": 2}})
    wait_until(
        "both replicas run",
        lambda: sum(p.status.phase == "Running" for p in replicas_of(core_api, app).values()) == 2,
    )
    core_api.delete_namespaced_pod(filler["metadata"]["name"], NS, grace_period_seconds=1)
    wait_until("the filler is gone", lambda: not running(core_api, filler["metadata"]["name"]))
    by_gpu = {gpu_of(resource_api, core_api, name): name for name in replicas_of(core_api, app)}
    assert sorted(by_gpu) == ["gpu-0-mps", "gpu-1-mps"], by_gpu  # spread: no GPU free

    # A pod that is not movable beside one replica: the other replica is the one to move.
    bystander = bare_pod(node, small)
    create(cluster, workloads, bystander)
    wait_until("the bystander runs", lambda: running(core_api, bystander["metadata"]["name"]))
    beside = gpu_of(resource_api, core_api, bystander["metadata"]["name"])
    freed = "gpu-1" if beside == "gpu-0-mps" else "gpu-0"
    to_move = by_gpu[f"{freed}-mps"]

    policy = kubernetes.client.PolicyV1Api(cluster.api_client())
    budget = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": app},
        "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": app}}},
    }
    policy.create_namespaced_pod_disruption_budget(NS, budget)
    try:
        wait_until(
            "the budget counts both replicas",
            lambda: (policy.read_namespaced_pod_disruption_budget(app, NS).status.current_healthy or 0) == 2,
        )
        train = bare_pod(node, whole)
        create(cluster, workloads, train)
        train_name = train["metadata"]["name"]
        wait_until(
            "the budget refuses the eviction",
            lambda: any("refused" in m and "disruption budget" in m for m in claim_events(core_api, train_name)),
        )
        assert set(replicas_of(core_api, app)) == set(by_gpu.values())  # nothing evicted
        assert not running(core_api, train_name)

        policy.patch_namespaced_pod_disruption_budget(app, NS, {"spec": {"minAvailable": 1}})
        wait_until("the whole-GPU pod runs", lambda: running(core_api, train_name), timeout_s=120)
    finally:
        policy.delete_namespaced_pod_disruption_budget(app, NS)

    assert gpu_of(resource_api, core_api, train_name) == freed
    events = core_api.list_namespaced_event(NS, field_selector=f"involvedObject.name={to_move}").items
    assert any(e.reason == "EvictedToMakeRoom" for e in events)
    wait_until(
        "the Deployment's new pod runs",
        lambda: sum(p.status.phase == "Running" for p in replicas_of(core_api, app).values()) == 2,
    )
    now = replicas_of(core_api, app)
    assert to_move not in now and len(set(now) - set(by_gpu.values())) == 1  # exactly one pod moved
    assert {gpu_of(resource_api, core_api, name) for name in now} == {beside}  # packed beside the bystander
    assert running(core_api, bystander["metadata"]["name"])  # not movable: never touched
    families = scrape(controller)
    assert value(families, "fgpu_controller_evictions_total", reason="movable") == 1
    assert (value(families, "fgpu_controller_evictions_total", reason="refused") or 0) >= 1


def test_a_higher_priority_pod_preempts_a_lower_one_never_an_equal(
    cluster, core_api, resource_api, real_node, node_plugin, controller, workloads
):
    node = real_node.name
    scheduling = kubernetes.client.SchedulingV1Api(cluster.api_client())
    low, high = unique("low"), unique("high")
    for name, rank in ((low, 10), (high, 1000)):
        scheduling.create_priority_class(
            {"metadata": {"name": name}, "value": rank, "preemptionPolicy": "PreemptLowerPriority"}
        )
    try:
        whole = opt_in(claim_template(unique("whole"), "gpu.fgpu.dev", selector=TWO_GPUS))
        create(cluster, workloads, whole)
        lesser, peer = bare_pod(node, whole, priorityClassName=low), bare_pod(node, whole, priorityClassName=high)
        for obj in (lesser, peer):
            create(cluster, workloads, obj)
            wait_until(f"{obj['metadata']['name']} runs", lambda o=obj: running(core_api, o["metadata"]["name"]))
        urgent = bare_pod(node, whole, priorityClassName=high)
        create(cluster, workloads, urgent)
        wait_until("the urgent pod runs", lambda: running(core_api, urgent["metadata"]["name"]), timeout_s=120)
        assert not running(core_api, lesser["metadata"]["name"])
        events = core_api.list_namespaced_event(NS, field_selector=f"involvedObject.name={lesser['metadata']['name']}")
        assert any(e.reason == "Preempted" and "lower priority" in e.message for e in events.items)
        assert running(core_api, peer["metadata"]["name"])  # of equal priority: never preempted
    finally:
        for name in (low, high):
            scheduling.delete_priority_class(name)


def test_the_making_room_benchmark_measures_a_round(cluster, resource_api, real_node, node_plugin, controller):
    client = cluster.api_client()
    for template in make_room_wait.templates():
        kubernetes.utils.create_from_dict(client, template, namespace=NS)
    try:
        seen = make_room_wait.Round(client, real_node.name).measure()
    finally:
        for template in make_room_wait.templates():
            resource_api.delete_namespaced_resource_claim_template(template["metadata"]["name"], NS)
    assert 0 < seen["evicted"] <= seen["victim_claim_gone"] <= seen["allocated"] <= seen["running"]
