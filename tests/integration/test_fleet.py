"""A kwok fleet through the real control plane: `fgpu simulate-fleet` publishes each labelled
node's devices from its machine profile, identical for one machine type and as its template says;
kube-scheduler allocates and binds a claim there, fgpu's controller places an opt-in one, kwok runs
both pods; a node's slices go with it."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest
import yaml

from driver.fleet.machine_types import MACHINE_LABEL
from driver.scheduling.opt_in import OPT_IN_LABEL, SCHEDULING_GATE
from testbed.cluster.harness import Cluster
from testbed.cluster.kwok_manager import ON_FLEET_NODES, Kwok
from testbed.workloads import wait_until
from tests.support.controller import CONTROLLER, by_kube_scheduler
from tests.support.pools import complete_pool

H100_NODES = ("kwok-h100-a", "kwok-h100-b")
L4_NODE = "kwok-l4"
FLEET = (sys.executable, "-m", "driver.cli", "simulate-fleet")


@pytest.fixture(scope="module")
def fleet(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kwok]:
    """kwok with two DGX H100 nodes and an L4 node offering whole GPUs and MPS shares, the fleet
    publisher (as users run it) and fgpu's controller."""
    kwok = Kwok(cluster, tmp_path_factory.mktemp("kwok"))
    processes: list[subprocess.Popen[bytes]] = []
    try:
        kwok.start()
        kwok.add_nodes(list(H100_NODES), "dgx-h100")
        kwok.add_nodes([L4_NODE], "l4x4", offer="whole,mps")
        for argv in (FLEET, (*CONTROLLER, "--lease-namespace=default", "--policy=first-fit")):
            processes.append(subprocess.Popen([*argv, f"--kubeconfig={cluster.kubeconfig}"]))
        yield kwok
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=15)
        _delete_pods_on(cluster, kwok.nodes)
        kwok.stop()


def _delete_pods_on(cluster: Cluster, nodes: list[str]) -> None:
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    for node in nodes:
        for pod in core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}").items:
            core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0)


def _without_node(slices: list[Any]) -> list[dict[str, Any]]:
    """The slices' specs less what names the node: what every node of a machine type shares."""
    specs = []
    for found in sorted(slices, key=lambda s: s.metadata.name):
        spec = kubernetes.client.ApiClient().sanitize_for_serialization(found.spec)
        spec.pop("nodeName")
        spec["pool"].pop("name")
        specs.append(spec)
    return specs


def test_nodes_of_one_machine_type_publish_what_its_template_promises(fleet: Kwok, resource_api) -> None:
    first, second = (wait_until(f"{node}'s pool", lambda n=node: complete_pool(resource_api, n)) for node in H100_NODES)
    assert _without_node(first) == _without_node(second)
    template = subprocess.run(
        [sys.executable, "-m", "driver.cli", "slice-template", "--machine=dgx-h100", "--format=resourceslices",
         "-o", "json"], capture_output=True, text=True, check=True,
    )  # fmt: skip
    promised = [{**s["spec"], "pool": {k: v for k, v in s["spec"]["pool"].items() if k != "name"}}
                for s in yaml.safe_load(template.stdout)["items"]]  # fmt: skip
    published = _without_node(first)
    for spec in published:  # the template leaves out the GPUs' serial facts (uuid, parentUUID)
        for device in spec.get("devices") or []:
            for attribute in ("uuid", "parentUUID"):
                device.get("attributes", {}).pop(attribute, None)
    assert published == promised
    assert complete_pool(resource_api, L4_NODE)


def _pod(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    container = {"name": "main", "image": "registry.invalid/cuda:12", "resources": {"claims": [{"name": "gpu"}]}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            **ON_FLEET_NODES,
            "terminationGracePeriodSeconds": 0,
            "containers": [container],
            **spec,
        },
    }


def _claim(
    name: str, device_class: str, labels: dict[str, str] | None = None, selector: str | None = None
) -> dict[str, Any]:
    request: dict[str, Any] = {"name": "gpu", "exactly": {"deviceClassName": device_class}}
    if selector:
        request["exactly"]["selectors"] = [{"cel": {"expression": selector}}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"devices": {"requests": [request]}},
    }


@contextlib.contextmanager
def claim_and_pod(resource_api, core_api, claim: dict[str, Any], pod_spec: dict[str, Any]) -> Iterator[str]:
    """The claim and a pod using it (both named after the claim), deleted after the block: the pod
    first, waited for, then the claim."""
    name = claim["metadata"]["name"]
    resource_api.create_namespaced_resource_claim("default", claim)
    spec = {**pod_spec, "resourceClaims": [{"name": "gpu", "resourceClaimName": name}]}
    core_api.create_namespaced_pod("default", _pod(name, spec))
    try:
        yield name
    finally:
        core_api.delete_namespaced_pod(name, "default", grace_period_seconds=0)
        selector = f"metadata.name={name}"
        wait_until(
            f"pod {name} gone", lambda: not core_api.list_namespaced_pod("default", field_selector=selector).items
        )
        resource_api.delete_namespaced_resource_claim(name, "default")


def _running_on(core_api, name: str) -> str:
    def running() -> str | None:
        pod = core_api.read_namespaced_pod(name, "default")
        return pod.spec.node_name if pod.status.phase == "Running" else None

    return wait_until(f"pod {name} Running", running)


def test_kube_scheduler_places_a_claim_on_the_fleet_and_kwok_runs_the_pod(fleet: Kwok, resource_api, core_api) -> None:
    with claim_and_pod(resource_api, core_api, _claim("fleet-mps", "mps.gpu.fgpu.dev"), {}) as name:
        assert _running_on(core_api, name) in (*H100_NODES, L4_NODE)
        allocation = resource_api.read_namespaced_resource_claim(name, "default").status.allocation
        assert allocation.devices.results[0].device.endswith("-mps")


def test_the_controller_places_an_opt_in_claim_on_the_fleet(fleet: Kwok, resource_api, core_api) -> None:
    claim = _claim("fleet-whole", "gpu.fgpu.dev", {OPT_IN_LABEL: "fgpu"})
    with claim_and_pod(resource_api, core_api, claim, {"schedulingGates": [{"name": SCHEDULING_GATE}]}) as name:
        node = _running_on(core_api, name)
        allocation = resource_api.read_namespaced_resource_claim(name, "default").status.allocation
        assert allocation.devices.results[0].pool == node


def test_a_claim_that_fits_no_node_shows_its_pod_unschedulable_until_a_node_arrives(
    fleet: Kwok, resource_api, core_api
) -> None:
    """What a node autoscaler sees (PodScheduled=False, Unschedulable) while the pod keeps its gate;
    the node it would add arrives; the controller, and only the controller, allocates the claim."""
    b200 = 'device.attributes["gpu.fgpu.dev"].productName == "NVIDIA B200"'
    claim = _claim("fleet-b200", "gpu.fgpu.dev", {OPT_IN_LABEL: "fgpu"}, selector=b200)

    def unschedulable() -> Any:
        pod = core_api.read_namespaced_pod("fleet-b200", "default")
        found = [c for c in pod.status.conditions or () if c.type == "PodScheduled" and c.reason == "Unschedulable"]
        return found and pod

    with claim_and_pod(resource_api, core_api, claim, {"schedulingGates": [{"name": SCHEDULING_GATE}]}) as name:
        pod = wait_until("the pod marked unschedulable", unschedulable)
        assert [g.name for g in pod.spec.scheduling_gates] == [SCHEDULING_GATE]
        time.sleep(3)  # kube-scheduler leaves a gated pod's condition alone
        assert unschedulable()
        fleet.add_nodes(["kwok-b200"], "dgx-b200")
        assert _running_on(core_api, name) == "kwok-b200"
        assert not by_kube_scheduler(resource_api, name)
        assert resource_api.read_namespaced_resource_claim(name, "default").status.allocation


def test_a_node_gone_takes_its_slices_and_an_unlabelled_node_gets_none(fleet: Kwok, resource_api, core_api) -> None:
    wait_until("the L4 node's pool", lambda: complete_pool(resource_api, L4_NODE))
    core_api.patch_node(L4_NODE, {"metadata": {"labels": {MACHINE_LABEL: None}}})
    wait_until("the unlabelled node's slices gone", lambda: not complete_pool(resource_api, L4_NODE))
    fleet.delete_node(H100_NODES[1])
    wait_until("the deleted node's slices gone", lambda: not complete_pool(resource_api, H100_NODES[1]))
    assert complete_pool(resource_api, H100_NODES[0])
