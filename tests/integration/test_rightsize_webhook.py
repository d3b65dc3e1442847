"""Automatic sizing of new claims (Initial mode) on the real control plane: `fgpu webhook
--rightsize-history-namespace` as a process behind kube-apiserver, configured by the chart's own
rightsize entries of the MutatingWebhookConfiguration (only the address is the test's), and the
claims kube-controller-manager makes from Deployments' pod templates. The usage history is seeded
as a node plugin writes it (a ConfigMap: driver/sizing/store.py): a 10Gi MPS share of Deployment
`web` that used 2Gi for two days. The claim of an opted-in namespace, and the claim of a template
annotated `initial` in a namespace that is not, carry 2560Mi and the original request; a pinned
template's claim keeps its 10Gi."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client import ApiException, AppsV1Api, CoreV1Api, ResourceV1Api

from driver.sizing import store
from driver.sizing.history import DAY_S, ClaimRecord, Sample, UsageHistory, Workload, record
from driver.sizing.initial import ORIGINAL_ANNOTATION, RIGHTSIZE
from driver.sizing.owner import POD_CLAIM_NAME
from driver.sizing.sizes import Size
from testbed.cluster.harness import Cluster
from testbed.workloads import unique
from tests.support.webhook import rightsize_webhook

pytestmark = pytest.mark.cluster

H100 = "NVIDIA H100 80GB HBM3"
ORIGINAL = {"memory": "10Gi", "compute": "25"}


def seeded_history(namespaces: list[str], now: float) -> UsageHistory:
    """Deployment `web` (template `t`, request `gpu`) in each namespace: 2Gi of a 10Gi share for two days."""
    records = [
        ClaimRecord(f"uid-{ns}", ns, "web-claim", Workload("Deployment", "web"), "t", "gpu", 0, H100,
                    Size("mps", 10240, 25))
        for ns in namespaces
    ]  # fmt: skip
    start = int(now - 2 * DAY_S)
    samples = [Sample(r.uid, t, 2048, 8.0) for r in records for t in range(start, int(now), 60)]
    return record(UsageHistory(60), records, samples)


def template(name: str, annotations: dict[str, str]) -> dict[str, Any]:
    request = {"name": "gpu", "exactly": {"deviceClassName": "mps.gpu.fgpu.dev",
                                          "capacity": {"requests": ORIGINAL}}}  # fmt: skip
    return {
        "metadata": {"name": name},
        "spec": {"metadata": {"annotations": annotations}, "spec": {"devices": {"requests": [request]}}},
    }


def deployment(name: str, claim_template: str) -> dict[str, Any]:
    labels = {"app": name}
    container = {"name": "c", "image": "registry.k8s.io/pause:3.10", "resources": {"claims": [{"name": "gpu"}]}}
    pod_spec = {"containers": [container], "terminationGracePeriodSeconds": 0,
                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": claim_template}]}  # fmt: skip
    return {
        "metadata": {"name": name},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": pod_spec}},
    }  # fmt: skip


@pytest.fixture
def webhook(cluster: Cluster, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The webhook serving /rightsize and the chart's rightsize entries pointed at it; yields the
    history namespace and its log."""
    log = tmp_path / "webhook.log"
    with rightsize_webhook(cluster, log) as history_ns:
        yield history_ns, log


def claim_of(cluster: Cluster, namespace: str, name: str, timeout_s: float = 60) -> dict[str, Any]:
    """The claim kube-controller-manager made for the Deployment's pod, once it is sized; while the
    apiserver has not taken the configuration up (or the webhook not serving yet), a claim is made
    unsized (failurePolicy Ignore): its pod is deleted and the ReplicaSet makes another."""
    resource, core = ResourceV1Api(cluster.api_client()), CoreV1Api(cluster.api_client())
    deadline = time.monotonic() + timeout_s
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        pods = core.list_namespaced_pod(namespace, label_selector=f"app={name}").items
        claims = [c for c in resource.list_namespaced_resource_claim(namespace).to_dict()["items"]
                  if any(p.metadata.name in c["metadata"]["name"] for p in pods)]  # fmt: skip
        for made in claims:
            last = made
            if ORIGINAL_ANNOTATION in (made["metadata"].get("annotations") or {}):
                return made
            if time.time() - made["metadata"]["creation_timestamp"].timestamp() > 3:
                for pod in pods:  # made before the webhook answered: another pod, another claim
                    with contextlib.suppress(ApiException):
                        core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
        time.sleep(0.5)
    return last


def capacity(made: dict[str, Any]) -> dict[str, str]:
    return made["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]


def test_claims_made_from_templates_get_the_recommended_size_and_their_original(cluster, webhook) -> None:
    history_ns, log = webhook
    core, resource = CoreV1Api(cluster.api_client()), ResourceV1Api(cluster.api_client())
    apps = AppsV1Api(cluster.api_client())
    opted, plain = unique("fgpu-opted"), unique("fgpu-plain")
    core.create_namespace({"metadata": {"name": opted, "labels": {RIGHTSIZE: "initial"}}})
    core.create_namespace({"metadata": {"name": plain}})
    try:
        seeded = store.configmap("node-a", history_ns, seeded_history([opted, plain], time.time()))
        core.create_namespaced_config_map(history_ns, seeded)
        resource.create_namespaced_resource_claim_template(opted, template("t", {}))
        resource.create_namespaced_resource_claim_template(plain, template("t", {RIGHTSIZE: "initial"}))
        apps.create_namespaced_deployment(opted, deployment("web", "t"))
        apps.create_namespaced_deployment(plain, deployment("web", "t"))
        for namespace in (opted, plain):
            made = claim_of(cluster, namespace, "web")
            assert capacity(made) == {"memory": "2560Mi", "compute": "9"}, (made, log.read_text())
            annotations = made["metadata"]["annotations"]
            assert json.loads(annotations[ORIGINAL_ANNOTATION]) == {"gpu": ORIGINAL}
            assert annotations[POD_CLAIM_NAME] == "gpu"
        assert f"claim {opted}/web-" in log.read_text() and "fits the observed use" in log.read_text()

        # A pinned template in the opted-in namespace: its claim is never sent, and keeps its size.
        resource.create_namespaced_resource_claim_template(opted, template("pinned", {RIGHTSIZE: "off"}))
        apps.create_namespaced_deployment(opted, deployment("pinned", "pinned"))
        made = claim_of(cluster, opted, "pinned", timeout_s=8)
        assert made and capacity(made) == ORIGINAL and ORIGINAL_ANNOTATION not in made["metadata"]["annotations"]
    finally:
        for namespace in (opted, plain):
            with contextlib.suppress(ApiException):
                core.delete_namespace(namespace)
