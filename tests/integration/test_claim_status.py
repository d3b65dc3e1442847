"""status.devices of claims, written by `fgpu kubelet-plugin` as kubelet drives it, against the real
kube-apiserver, under the chart's RBAC with a pod-bound service-account token of node-a (what the
DaemonSet's pod has), so the apiserver's associated-node check on resourceclaims/driver applies."""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from tests.cluster.harness import Cluster
from tests.integration.test_plugin_process import wait_for
from tests.plugin_process import PluginUnderTest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
IDENTITY = "status-test-plugin"
NIC = {"driver": "net.example.com", "pool": "node-a", "device": "eth1"}
NIC_ENTRY = {
    **NIC,
    "conditions": [
        {"type": "Ready", "status": "True", "reason": "Up", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}
    ],
    "data": {"mac": "02:00:00:00:00:01"},
}


def chart_plugin_rules() -> list[dict[str, Any]]:
    """The plugin's ClusterRole rules as the chart renders them (daemonset/plugin.yaml)."""
    documents = yaml.safe_load_all((ROOT / "daemonset" / "plugin.yaml").read_text())
    return next(d for d in documents if d and d["kind"] == "ClusterRole")["rules"]


class PluginIdentity:
    """A service account bound to a ClusterRole, and a kubeconfig with the token of its pod on node-a."""

    def __init__(self, cluster: Cluster, workdir: Path) -> None:
        client = cluster.api_client()
        self.core = kubernetes.client.CoreV1Api(client)
        self.rbac = kubernetes.client.RbacAuthorizationV1Api(client)
        self.core.create_namespaced_service_account("default", {"metadata": {"name": IDENTITY}})
        self.rbac.create_cluster_role({"metadata": {"name": IDENTITY}, "rules": []})
        subject = {"kind": "ServiceAccount", "name": IDENTITY, "namespace": "default"}
        role_ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": IDENTITY}
        self.rbac.create_cluster_role_binding(
            {"metadata": {"name": IDENTITY}, "subjects": [subject], "roleRef": role_ref}
        )
        pod = self.core.create_namespaced_pod(
            "default",
            {
                "metadata": {"name": IDENTITY},
                "spec": {
                    "nodeName": "node-a",  # no kubelet there: it stays Pending, its token names node-a
                    "serviceAccountName": IDENTITY,
                    "containers": [{"name": "plugin", "image": "registry.invalid/fgpu:test"}],
                },
            },
        )
        bound = {"kind": "Pod", "apiVersion": "v1", "name": IDENTITY, "uid": pod.metadata.uid}
        request = {"spec": {"boundObjectRef": bound, "expirationSeconds": 3600}}
        token = self.core.create_namespaced_service_account_token(IDENTITY, "default", request).status.token
        admin = json.loads(Path(str(cluster.kubeconfig)).read_text())
        admin["users"] = [{"name": IDENTITY, "user": {"token": token}}]
        admin["contexts"][0]["context"]["user"] = IDENTITY
        self.kubeconfig = workdir / "plugin.kubeconfig"
        self.kubeconfig.write_text(json.dumps(admin))

    def grant(self, rules: list[dict[str, Any]]) -> None:
        self.rbac.patch_cluster_role(IDENTITY, {"rules": rules})

    def remove(self) -> None:
        self.core.delete_namespaced_pod(IDENTITY, "default", grace_period_seconds=0)
        self.rbac.delete_cluster_role_binding(IDENTITY)
        self.rbac.delete_cluster_role(IDENTITY)
        self.core.delete_namespaced_service_account(IDENTITY, "default")


@pytest.fixture
def identity(cluster: Cluster, tmp_path: Path) -> Iterator[PluginIdentity]:
    made = PluginIdentity(cluster, tmp_path)
    try:
        yield made
    finally:
        made.remove()


@pytest.fixture
def plugin(identity: PluginIdentity) -> Iterator[PluginUnderTest]:
    """The plugin on node-a as the service account, reconciling every second."""
    under_test = PluginUnderTest(
        node="node-a", kubeconfig=str(identity.kubeconfig), extra_args=["--reconcile-interval=1"]
    )
    identity.grant(chart_plugin_rules())
    under_test.start()
    try:
        yield under_test
    finally:
        under_test.stop()
        shutil.rmtree(under_test.root, ignore_errors=True)


def create_shared_claim(api: kubernetes.client.ResourceV1Api, devices: dict[str, str]) -> dict[str, str]:
    """A claim allocated on node-a as kube-scheduler does it (node selector included): fgpu's
    devices by request, and a NIC of another driver whose status that driver already wrote."""
    name = f"claim-{uuid.uuid4().hex[:8]}"
    requests = [{"name": r, "exactly": {"deviceClassName": "gpu.fgpu.dev"}} for r in [*devices, "nic"]]
    body = {"metadata": {"name": name}, "spec": {"devices": {"requests": requests}}}
    created = api.create_namespaced_resource_claim("default", body)
    results = [{"request": r, "driver": "gpu.fgpu.dev", "pool": "node-a", "device": d} for r, d in devices.items()]
    node = {"key": "metadata.name", "operator": "In", "values": ["node-a"]}
    allocation = {
        "devices": {"results": [*results, {"request": "nic", **NIC}]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [node]}]},
    }
    api.patch_namespaced_resource_claim_status(name, "default", {"status": {"allocation": allocation}})
    nic = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name}}
    nic["status"] = {"devices": [NIC_ENTRY]}
    api.patch_namespaced_resource_claim_status(
        name, "default", nic, field_manager="net.example.com", _content_type="application/apply-patch+yaml"
    )
    return {"namespace": "default", "name": name, "uid": created.metadata.uid}


def status_devices(api: kubernetes.client.ResourceV1Api, claim: dict[str, str]) -> dict[str, dict[str, Any]]:
    response = api.read_namespaced_resource_claim(claim["name"], claim["namespace"], _preload_content=False)
    return {d["device"]: d for d in json.loads(response.data)["status"].get("devices") or []}


def test_prepare_reports_the_devices_in_the_claim_status_and_unprepare_removes_them(plugin, resource_api):
    claim = create_shared_claim(resource_api, {"gpu": "gpu-2", "mig": "gpu-5-mig-1g10gb-0"})
    assert plugin.prepare([claim])[claim["uid"]].error == ""
    entries = status_devices(resource_api, claim)
    assert set(entries) == {"eth1", "gpu-2", "gpu-5-mig-1g10gb-0"}
    assert entries["eth1"] == NIC_ENTRY
    whole = entries["gpu-2"]
    assert whole["data"]["kind"] == "whole" and whole["data"]["gpuUUID"].startswith("GPU-")
    (ready,) = whole["conditions"]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "True", "Prepared")
    # kube-apiserver gives claims no generation (0, which the condition's JSON leaves out)
    generation = resource_api.read_namespaced_resource_claim(claim["name"], "default").metadata.generation or 0
    assert ready.get("observedGeneration", 0) == generation
    mig = entries["gpu-5-mig-1g10gb-0"]["data"]["mig"]
    assert mig["uuid"].startswith("MIG-") and mig["profile"] == "1g.10gb"
    assert mig["placement"] == {"start": 0, "size": 1}
    assert isinstance(mig["gpuInstanceID"], int) and isinstance(mig["computeInstanceID"], int)

    assert plugin.unprepare([claim]) == {claim["uid"]: ""}
    assert status_devices(resource_api, claim) == {"eth1": NIC_ENTRY}


def test_a_refused_status_write_is_retried_and_the_prepare_succeeds(plugin, identity, resource_api):
    without_driver = [r for r in chart_plugin_rules() if r["resources"] != ["resourceclaims/driver"]]
    identity.grant(without_driver)
    claim = create_shared_claim(resource_api, {"gpu": "gpu-3"})
    wait_for(lambda: _refused(resource_api, claim))  # RBAC's cache has seen the narrower role
    assert plugin.prepare([claim])[claim["uid"]].error == ""
    assert set(status_devices(resource_api, claim)) == {"eth1"}
    failures = [line for line in plugin.logs().splitlines() if "writing its status.devices failed" in line]
    assert failures and claim["name"] in failures[0] and "resourceclaims/driver" in failures[0]

    identity.grant(chart_plugin_rules())
    entries = wait_for(lambda: (found := status_devices(resource_api, claim)).get("gpu-3") and found)
    assert entries["gpu-3"]["data"]["gpuIndex"] == 3 and entries["eth1"] == NIC_ENTRY
    assert plugin.unprepare([claim]) == {claim["uid"]: ""}
    assert status_devices(resource_api, claim) == {"eth1": NIC_ENTRY}


def _refused(api: kubernetes.client.ResourceV1Api, claim: dict[str, str]) -> bool:
    """Whether the plugin's identity may not write fgpu's entries (asked of the apiserver)."""
    review = kubernetes.client.AuthorizationV1Api(api.api_client).create_subject_access_review(
        {
            "spec": {
                "user": f"system:serviceaccount:default:{IDENTITY}",
                "groups": ["system:serviceaccounts"],
                "resourceAttributes": {
                    "group": "resource.k8s.io",
                    "resource": "resourceclaims",
                    "subresource": "driver",
                    "name": "gpu.fgpu.dev",
                    "namespace": claim["namespace"],
                    "verb": "associated-node:patch",
                },
            }
        }
    )
    return not review.status.allowed
