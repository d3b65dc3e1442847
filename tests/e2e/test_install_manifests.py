"""What users apply, judged by the real apiserver: every file under daemonset/ and examples/, and the
chart's output for the values users set, through a server-side dry run (kubectl apply
--dry-run=server does the same: server-side apply, nothing stored). The webhook's cert-manager mode
against cert-manager's own CRDs (from its Go module), installed in the test cluster for the check,
with strict field validation. Needs no node."""

from __future__ import annotations

import json
import os
import subprocess
import time
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
        "webhook.hostNetwork": True,
    },
    "webhook certificate from an operator's Secret": {"webhook.tls.existingSecret": "corp-tls"},
    "... and its CA given": {"webhook.tls.existingSecret": "corp-tls", "webhook.tls.caBundle": "Q0EK"},
}
CERT_MANAGER_MODULE, CERT_MANAGER_VERSION = "github.com/cert-manager/cert-manager", "v1.21.2"
CERT_MANAGER_CRDS = ("cert-manager.io_certificates.yaml", "cert-manager.io_issuers.yaml")


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
    yield DynamicClient(client, cache_file=cluster.discovery_cache)
    if created:
        delete_namespace(core, NAMESPACE)


def dry_run_apply(dynamic: DynamicClient, document: dict[str, Any], namespace: str, strict: bool = False) -> None:
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
            # Strict: an unknown field is an error, not a warning (kubectl's default).
            query_params=[("fieldValidation", "Strict")] if strict else [],
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


@pytest.fixture(scope="module")
def cert_manager_crds(cluster, dynamic: DynamicClient) -> Iterator[None]:
    """cert-manager's Certificate and Issuer CRDs from its Go module (deploy/crds), installed for
    this module and removed after it."""
    listed = subprocess.run(["go", "mod", "download", "-json", f"{CERT_MANAGER_MODULE}@{CERT_MANAGER_VERSION}"],
                            capture_output=True, text=True, check=False, timeout=600, cwd="/",
                            env={**os.environ, "GOFLAGS": "-mod=mod", "GO111MODULE": "on"})  # fmt: skip
    assert listed.returncode == 0, listed.stdout + listed.stderr
    crds = [
        documents(Path(json.loads(listed.stdout)["Dir"]) / "deploy" / "crds" / name)[0] for name in CERT_MANAGER_CRDS
    ]
    extensions = kubernetes.client.ApiextensionsV1Api(cluster.api_client())
    for crd in crds:
        extensions.create_custom_resource_definition(crd)
    try:
        deadline = time.monotonic() + 60
        for crd in crds:
            while not any(
                c.type == "Established" and c.status == "True"
                for c in extensions.read_custom_resource_definition(crd["metadata"]["name"]).status.conditions or []
            ):
                assert time.monotonic() < deadline, f"{crd['metadata']['name']} not established"
                time.sleep(0.2)
        dynamic.resources.invalidate_cache()
        yield
    finally:
        for crd in crds:
            extensions.delete_custom_resource_definition(crd["metadata"]["name"])


@pytest.mark.go
@pytest.mark.parametrize(
    "values",
    [
        {"webhook.certManager.enabled": True},
        {
            "webhook.certManager.enabled": True,
            "webhook.certManager.issuerRef": {"name": "corp", "kind": "ClusterIssuer"},
        },
    ],
    ids=["chart's CA", "own issuer"],
)
def test_cert_manager_mode_accepted_against_cert_managers_crds(
    dynamic: DynamicClient, cert_manager_crds: None, values: dict[str, object]
) -> None:
    kinds = []
    for document in render(values):
        dry_run_apply(dynamic, document, NAMESPACE, strict=document["apiVersion"].startswith("cert-manager.io/"))
        kinds.append(document["kind"])
    assert "Certificate" in kinds
    # The check has teeth: a field cert-manager does not know is refused.
    wrong = next(d for d in render(values) if d["kind"] == "Certificate" and "dnsNames" in d["spec"])
    wrong["spec"]["dnsName"] = wrong["spec"].pop("dnsNames")
    with pytest.raises(AssertionError, match="dnsName"):
        dry_run_apply(dynamic, wrong, NAMESPACE, strict=True)
