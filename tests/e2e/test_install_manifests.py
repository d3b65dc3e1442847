"""What users apply, judged by the real apiserver: every file under daemonset/ and examples/, and the
chart's output for the values users set, through a server-side dry run (kubectl apply
--dry-run=server does the same: server-side apply, nothing stored). Needs no node."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from kubernetes.dynamic import DynamicClient

from testbed.workloads import delete_namespace
from tests.support.chart import NAMESPACE, ROOT, render

pytestmark = pytest.mark.cluster
FIELD_MANAGER = "fgpu-tests"
MANIFESTS = sorted((ROOT / "daemonset").glob("*.yaml")) + sorted((ROOT / "examples").glob("*.yaml"))
CHART_VALUES = {
    "defaults": {},
    "mock, no controller": {"nvml": "mock:dgx-h100", "controller.enabled": False},
    "MIG profile classes": {
        "deviceClasses.migProfiles": {"1g.10gb": "nvidia.com/mig-1g.10gb", "3g.40gb": "nvidia.com/mig-3g.40gb"}
    },
    "test bed": {
        "nvml": "mock:dgx-h100",
        "apiServer.host": "127.0.0.1",
        "apiServer.port": "6443",
        "kubeletPlugin.hostNetwork": True,
        "controller.hostNetwork": True,
        "sharing": {"gpus": [{"index": 0, "offer": ["mig"]}]},
        "kubeletPlugin.resources": {"requests": {"cpu": "50m", "memory": "128Mi"}},
    },
}


@pytest.fixture(scope="module")
def dynamic(cluster) -> Iterator[DynamicClient]:
    """A dynamic client, with the chart's namespace existing (namespaced objects are checked in it)."""
    client = cluster.api_client()
    core = kubernetes.client.CoreV1Api(client)
    created = False
    try:
        core.create_namespace({"metadata": {"name": NAMESPACE}})
        created = True
    except kubernetes.client.ApiException as err:
        if err.status != 409:
            raise
    yield DynamicClient(client)
    if created:
        delete_namespace(core, NAMESPACE)


def dry_run_apply(dynamic: DynamicClient, document: dict[str, Any], namespace: str) -> None:
    resource = dynamic.resources.get(api_version=document["apiVersion"], kind=document["kind"])
    if resource.namespaced:
        namespace = document["metadata"].get("namespace", namespace)
    try:
        dynamic.server_side_apply(
            resource,
            body=document,
            name=document["metadata"]["name"],
            namespace=namespace if resource.namespaced else None,
            field_manager=FIELD_MANAGER,
            dry_run="All",
        )
    except kubernetes.client.ApiException as err:
        raise AssertionError(f"{document['kind']} {document['metadata']['name']}: {err.status} {err.body}") from None


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_manifest_accepted_by_the_apiserver(dynamic: DynamicClient, path: Path) -> None:
    docs = documents(path)
    assert docs, f"{path} has no objects"
    for document in docs:
        dry_run_apply(dynamic, document, "default")


@pytest.mark.parametrize("values", list(CHART_VALUES.values()), ids=list(CHART_VALUES))
def test_chart_output_accepted_by_the_apiserver(dynamic: DynamicClient, values: dict[str, object]) -> None:
    for document in render(values):
        dry_run_apply(dynamic, document, NAMESPACE)
