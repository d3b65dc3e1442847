"""status.devices of claims, written by `fgpu kubelet-plugin` as kubelet drives it, against the real
kube-apiserver, under the chart's RBAC with a pod-bound service-account token of node-a (what the
DaemonSet's pod has), so the apiserver's associated-node check on resourceclaims/driver applies.
Claims with opaque configs are allocated by the real kube-scheduler, which copies their bytes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from driver.sizing.initial import ORIGINAL_ANNOTATION
from testbed.cluster.harness import Cluster
from testbed.plugin_process import PluginUnderTest
from testbed.workloads import wait_for
from tests.support.pools import complete_pool

pytestmark = pytest.mark.cluster

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
    offer = "--offer=whole,mig,mps,timeslice,mig-mps,mig-timeslice"  # every kind a claim can hold
    under_test = PluginUnderTest(
        node="node-a", kubeconfig=str(identity.kubeconfig), extra_args=["--reconcile-interval=1", offer]
    )
    identity.grant(chart_plugin_rules())
    under_test.start()
    try:
        yield under_test
    finally:
        under_test.stop()
        shutil.rmtree(under_test.root, ignore_errors=True)


def create_shared_claim(
    api: kubernetes.client.ResourceV1Api,
    devices: dict[str, str],
    annotations: dict[str, str] | None = None,
    capacity: dict[str, str] | None = None,
) -> dict[str, str]:
    """A claim allocated on node-a as kube-scheduler does it (node selector included): fgpu's
    devices by request (each asking `capacity`), and a NIC of another driver whose status that
    driver already wrote."""
    name = f"claim-{uuid.uuid4().hex[:8]}"
    asked = {"capacity": {"requests": capacity}} if capacity else {}
    requests = [{"name": r, "exactly": {"deviceClassName": "gpu.fgpu.dev", **asked}} for r in devices]
    requests.append({"name": "nic", "exactly": {"deviceClassName": "gpu.fgpu.dev"}})
    body = {"metadata": {"name": name, "annotations": annotations or {}}, "spec": {"devices": {"requests": requests}}}
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


def test_a_refused_write_makes_one_event_and_waits_for_the_claim_to_change(plugin, identity, resource_api, core_api):
    without_driver = [r for r in chart_plugin_rules() if r["resources"] != ["resourceclaims/driver"]]
    identity.grant(without_driver)
    claim = create_shared_claim(resource_api, {"gpu": "gpu-3"})
    wait_for(lambda: _refused(resource_api, claim))  # RBAC's cache has seen the narrower role
    assert plugin.prepare([claim])[claim["uid"]].error == ""
    assert set(status_devices(resource_api, claim)) == {"eth1"}
    (event,) = wait_for(lambda: claim_events(core_api, claim))
    assert (event.type, event.reason, event.involved_object.uid) == ("Warning", "DeviceStatusRefused", claim["uid"])
    assert f"claim default/{claim['name']}" in event.message and "resourceclaims/driver" in event.message

    identity.grant(chart_plugin_rules())
    wait_for(lambda: not _refused(resource_api, claim))
    time.sleep(3)  # three reconciler passes on the same claim
    assert set(status_devices(resource_api, claim)) == {"eth1"}  # not sent again: the claim is the same
    refusals = [line for line in plugin.logs().splitlines() if "writing its status.devices was refused" in line]
    assert len(refusals) == 1 and claim["name"] in refusals[0] and "trying again when the claim changes" in refusals[0]

    resource_api.patch_namespaced_resource_claim(claim["name"], "default", {"metadata": {"labels": {"touched": "1"}}})
    entries = wait_for(lambda: (found := status_devices(resource_api, claim)).get("gpu-3") and found)
    assert entries["gpu-3"]["data"]["gpuIndex"] == 3 and entries["eth1"] == NIC_ENTRY
    assert len(claim_events(core_api, claim)) == 1
    assert plugin.unprepare([claim]) == {claim["uid"]: ""}
    assert status_devices(resource_api, claim) == {"eth1": NIC_ENTRY}


def test_a_sized_claim_gets_one_rightsized_event_however_often_it_is_prepared(plugin, resource_api, core_api):
    """The webhook's sizing (driver/admission/rightsize.py) as the claim shows it: the annotation
    with the template's requests, the request's capacity as sized."""
    original = {ORIGINAL_ANNOTATION: json.dumps({"gpu": {"compute": "25", "memory": "10Gi"}})}
    sized_to = {"memory": "2560Mi", "compute": "9"}
    plain = create_shared_claim(resource_api, {"gpu": "gpu-1"}, capacity=sized_to)
    sized = create_shared_claim(resource_api, {"gpu": "gpu-4"}, original, sized_to)
    last = create_shared_claim(resource_api, {"gpu": "gpu-6"}, original, sized_to)
    try:
        for claim in (plain, sized):
            assert plugin.prepare([claim])[claim["uid"]].error == ""
        (event,) = wait_for(lambda: claim_events(core_api, sized))
        assert (event.type, event.reason, event.involved_object.uid) == ("Normal", "RightSized", sized["uid"])
        assert event.message == (
            "request gpu sized to compute 9, memory 2560Mi from compute 25, memory 10Gi "
            f"by its workload's usage history ({ORIGINAL_ANNOTATION})"
        )
        assert event.source.component == "gpu.fgpu.dev/node-a"
        assert plugin.unprepare([sized]) == {sized["uid"]: ""}
        assert plugin.prepare([sized])[sized["uid"]].error == ""  # afresh: the claim read again
        assert plugin.prepare([last])[last["uid"]].error == ""
        wait_for(lambda: claim_events(core_api, last))  # written in order: the second try's is done by now
        assert len(claim_events(core_api, sized)) == 1
        assert claim_events(core_api, plain) == []
        assert "RightSized event" not in plugin.logs()  # no write failed, none was refused
    finally:
        assert plugin.unprepare([plain, sized, last]) == dict.fromkeys((plain["uid"], sized["uid"], last["uid"]), "")
        for claim in (plain, sized, last):  # their GPUs are the scheduler's again, for the tests below
            resource_api.delete_namespaced_resource_claim(claim["name"], claim["namespace"])


def claim_events(core: kubernetes.client.CoreV1Api, claim: dict[str, str]) -> list[Any]:
    selector = f"involvedObject.name={claim['name']},involvedObject.kind=ResourceClaim"
    return core.list_namespaced_event(claim["namespace"], field_selector=selector).items


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
                    "verb": "associated-node:update",
                },
            }
        }
    )
    return not review.status.allowed


# --- claims with opaque configs --------------------------------------------------------------------

API = "gpu.fgpu.dev/v1alpha1"


@dataclass(frozen=True)
class Kind:
    device_class: str
    capacity: dict[str, str]  # what the request asks of a share's capacity
    config: dict[str, Any]  # keys out of order: the stored bytes are what the Python client sends
    shown: dict[str, Any]  # what status.devices' data must show of the config
    interval: str | None = None  # what `fgpu status` must show


def _mps(percentage: int, memory: str) -> dict[str, Any]:
    mps = {"pinnedMemoryLimit": memory, "activeThreadPercentage": percentage}
    return {"sharing": {"mps": mps, "strategy": "MPS"}, "kind": "ShareConfig", "apiVersion": API}


def _timeslicing(interval: str) -> dict[str, Any]:
    sharing = {"timeSlicing": {"interval": interval}, "strategy": "TimeSlicing"}
    return {"sharing": sharing, "kind": "ShareConfig", "apiVersion": API}


KINDS = {
    "whole": Kind("gpu.fgpu.dev", {}, {"kind": "GpuConfig", "apiVersion": API}, {"kind": "whole"}),
    "mig": Kind("mig.gpu.fgpu.dev", {}, {"kind": "MigDeviceConfig", "apiVersion": API}, {"kind": "mig"}),
    "mps": Kind(
        "mps.gpu.fgpu.dev",
        {"memory": "4Gi", "compute": "20"},
        _mps(15, "2Gi"),
        {"kind": "mps", "mps": {"activeThreadPercentage": 15, "pinnedMemoryLimitBytes": 2 * 2**30}},
    ),
    "timeslice": Kind(  # a claim's config may repeat its class's interval (Default), never change it
        "timeslice.gpu.fgpu.dev",
        {},
        _timeslicing("Default"),
        {"kind": "timeslice", "timeSlice": {"interval": "Default"}},
        "Default",
    ),
    "mig-mps": Kind(
        "mig-mps.gpu.fgpu.dev",
        {"memory": "2Gi", "compute": "20"},
        _mps(10, "1Gi"),
        {"kind": "mig-mps", "mps": {"activeThreadPercentage": 10, "pinnedMemoryLimitBytes": 2**30}},
    ),
    "mig-timeslice": Kind(  # a MIG partition's interval is the GPU's: the config names only the strategy
        "mig-timeslice.gpu.fgpu.dev",
        {},
        {"sharing": {"strategy": "TimeSlicing"}, "kind": "ShareConfig", "apiVersion": API},
        {"kind": "mig-timeslice"},
    ),
}


@dataclass
class Workloads:
    """Pods on node-a whose claims come from templates, with each kind's config in the claim (sent
    by the Python client) or in a DeviceClass of its own (sent as compact JSON, as Go clients do);
    kube-scheduler allocates them (no kubelet: they stay Pending there) and copies the config."""

    resource: kubernetes.client.ResourceV1Api
    core: kubernetes.client.CoreV1Api
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    pods: list[str] = field(default_factory=list)
    templates: list[str] = field(default_factory=list)
    classes: list[str] = field(default_factory=list)

    def start(self, name: str, kind: Kind, source: str) -> str:
        """The pod's name; its template's request is named `name` too."""
        opaque = {"driver": "gpu.fgpu.dev", "parameters": kind.config}
        device_class = kind.device_class
        if source == "FromClass":
            device_class = f"{self.tag}-{name}.test.fgpu.dev"
            base = self.resource.read_device_class(kind.device_class)
            selectors = [{"cel": {"expression": s.cel.expression}} for s in base.spec.selectors]
            spec = {"selectors": selectors, "config": [{"opaque": opaque}]}
            body = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": device_class}}
            create_compact(self.resource.api_client, "/apis/resource.k8s.io/v1/deviceclasses", {**body, "spec": spec})
            self.classes.append(device_class)
        exactly: dict[str, Any] = {"deviceClassName": device_class}
        if kind.capacity:
            exactly["capacity"] = {"requests": kind.capacity}
        devices: dict[str, Any] = {"requests": [{"name": name, "exactly": exactly}]}
        if source == "FromClaim":
            devices["config"] = [{"requests": [name], "opaque": opaque}]
        template = f"{self.tag}-{name}"
        self.resource.create_namespaced_resource_claim_template(
            "default", {"metadata": {"name": template}, "spec": {"spec": {"devices": devices}}}
        )
        self.templates.append(template)
        pod = f"{self.tag}-{name}"
        self.core.create_namespaced_pod("default", _pod(pod, template))
        self.pods.append(pod)
        return pod

    def allocated_claim(self, pod: str) -> dict[str, Any] | None:
        """The pod's claim once kube-scheduler has allocated and reserved it (the API's JSON), else None."""
        statuses = self.core.read_namespaced_pod(pod, "default").status.resource_claim_statuses or []
        if not statuses or not statuses[0].resource_claim_name:
            return None
        claim = read_claim(self.resource, "default", statuses[0].resource_claim_name)
        status = claim.get("status") or {}
        return claim if status.get("allocation") and status.get("reservedFor") else None

    def remove(self) -> None:
        for pod in self.pods:
            self.core.delete_namespaced_pod(pod, "default", grace_period_seconds=0)
        for template in self.templates:
            self.resource.delete_namespaced_resource_claim_template(template, "default")
        for name in self.classes:
            self.resource.delete_device_class(name)


def create_compact(client: kubernetes.client.ApiClient, path: str, body: dict[str, Any]) -> None:
    """Create an object from compact JSON in the key order given, as a Go client writes a typed
    struct; the Python client's own methods send JSON with spaces. An opaque config keeps either
    form, byte for byte, and neither a server-side apply (which sorts keys) nor a JSON PUT from
    Python (which adds spaces) reproduces this one."""
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    method, url, headers, _, _ = client.param_serialize(
        "POST", path, header_params=headers, auth_settings=["BearerToken"]
    )
    data = json.dumps(body, separators=(",", ":")).encode()
    response = client.rest_client.pool_manager.request(method, url, body=data, headers=headers)
    assert response.status == 201, response.data


def _pod(name: str, template: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": "node-a"},
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
            "containers": [
                {"name": "main", "image": "registry.invalid/cuda:12", "resources": {"claims": [{"name": "gpu"}]}}
            ],
        },
    }


def read_claim(api: kubernetes.client.ResourceV1Api, namespace: str, name: str) -> dict[str, Any]:
    return json.loads(api.read_namespaced_resource_claim(name, namespace, _preload_content=False).data)


def ref(claim: dict[str, Any]) -> dict[str, str]:
    meta = claim["metadata"]
    return {"namespace": meta["namespace"], "name": meta["name"], "uid": meta["uid"]}


@pytest.fixture
def workloads(resource_api, core_api) -> Iterator[Workloads]:
    made = Workloads(resource_api, core_api)
    try:
        yield made
    finally:
        made.remove()


def fgpu_status(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """`fgpu status -o json` of node-a: each claim's holding by claim name."""
    command = [sys.executable, "-m", "driver.cli", "status", "--kubeconfig", str(cluster.kubeconfig)]
    run = subprocess.run([*command, "--node", "node-a", "-o", "json"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    (node,) = json.loads(run.stdout)["nodes"]
    return {c["claim"]: c for gpu in node["gpus"] for c in gpu["claims"]}


@pytest.mark.parametrize("source", ["FromClaim", "FromClass"])
def test_claims_with_opaque_configs_get_their_status_for_every_kind(source, plugin, workloads, resource_api, cluster):
    wait_for(lambda: complete_pool(resource_api, "node-a"), timeout=60)
    pods = {kind: workloads.start(kind, spec, source) for kind, spec in KINDS.items()}
    claims = {kind: wait_for(lambda pod=pod: workloads.allocated_claim(pod), timeout=90) for kind, pod in pods.items()}
    for kind, claim in claims.items():  # the scheduler copied the config into the allocation
        (config,) = claim["status"]["allocation"]["devices"]["config"]
        assert (config["source"], config["opaque"]["parameters"]) == (source, KINDS[kind].config)
        _assert_apply_is_refused(resource_api, claim)  # what the plugin's write must not do

    refs = [ref(c) for c in claims.values()]
    try:
        results = plugin.prepare(refs)
        assert {kind: results[c["metadata"]["uid"]].error for kind, c in claims.items()} == dict.fromkeys(KINDS, "")
        for kind, claim in claims.items():
            (result,) = claim["status"]["allocation"]["devices"]["results"]
            after = read_claim(resource_api, "default", claim["metadata"]["name"])
            written = after["status"].get("devices")
            assert written, (kind, [line for line in plugin.logs().splitlines() if "status.devices" in line][-1:])
            (entry,) = written
            assert (entry["device"], entry.get("shareID")) == (result["device"], result.get("shareID"))
            assert entry["conditions"][0]["status"] == "True"
            assert contains(entry["data"], KINDS[kind].shown), (kind, entry["data"])  # the config's effect
            assert after["status"]["allocation"] == claim["status"]["allocation"]
            assert after["status"]["reservedFor"] == claim["status"]["reservedFor"]
        assert "was refused" not in plugin.logs() and "status.devices failed" not in plugin.logs()

        shown = fgpu_status(cluster)
        for kind, claim in claims.items():
            holding = shown[f"default/{claim['metadata']['name']}"]
            (result,) = claim["status"]["allocation"]["devices"]["results"]
            assert (holding["device"], holding["kind"], holding["configError"]) == (result["device"], kind, None)
            assert (holding["interval"], holding["pods"]) == (KINDS[kind].interval, [f"default/{pods[kind]}"])
    finally:
        unprepared = plugin.unprepare(refs)  # MPS daemons outlive the plugin: none is left behind
    assert unprepared == {r["uid"]: "" for r in refs}
    for claim in refs:
        assert "devices" not in read_claim(resource_api, "default", claim["name"])["status"]


def contains(actual: Any, expected: Any) -> bool:
    """Whether `actual` has every key of `expected`, recursively, with the same values."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(k in actual and contains(actual[k], v) for k, v in expected.items())
    return actual == expected


def _assert_apply_is_refused(api: kubernetes.client.ResourceV1Api, claim: dict[str, Any]) -> None:
    """kube-apiserver 1.37 refuses a server-side apply of status.devices on a claim whose allocation
    carries an opaque config not stored in Go's canonical JSON: the apply re-encodes it and the
    allocation counts as modified. Should an upstream release accept it, this says so."""
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": claim["metadata"]["name"]},
    }
    body["status"] = {"devices": []}
    with pytest.raises(ApiException) as refused:
        api.patch_namespaced_resource_claim_status(
            claim["metadata"]["name"],
            "default",
            body,
            field_manager="probe",
            _content_type="application/apply-patch+yaml",
        )
    assert refused.value.status == 422 and "status.allocation" in refused.value.body
    assert "field cannot be modified once set" in refused.value.body
