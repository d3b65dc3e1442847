"""`fgpu plan --kubeconfig` against the real kube-apiserver: it plans the input's workloads on the
slices, classes, nodes, templates and allocated claims the cluster holds now, and writes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from driver.inventory.discovery import discover_gpus
from driver.inventory.offers import node_inventory
from driver.inventory.sharing import SharingConfig
from driver.inventory.slices import build_slices
from driver.nvml.session import NvmlSession
from testbed.claims_api import DRIVER, create_allocated_claim
from tests.support import ROOT

pytestmark = pytest.mark.cluster

NODE = "plan-node"  # a node of its own, with H200s (no other test publishes any): nothing else matches
H200 = 'device.attributes["gpu.fgpu.dev"].productName == "NVIDIA H200"'
REQUEST = {"deviceClassName": "gpu.fgpu.dev", "selectors": [{"cel": {"expression": H200}}]}
WHOLE_H200 = {"devices": {"requests": [{"name": "gpu", "exactly": REQUEST}]}}
GANG = {"gpu.fgpu.dev/allocator": "fgpu", "gpu.fgpu.dev/gang": "pair", "gpu.fgpu.dev/gang-size": "2"}


def plan(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "driver.cli", "plan", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)


def claim(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    metadata = {"name": name, "namespace": "default", "labels": labels or {}}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": metadata, "spec": WHOLE_H200}


def claims_in(api: kubernetes.client.ResourceV1Api) -> dict[str, str]:
    """Every claim in the cluster and its resourceVersion."""
    return {
        f"{c.metadata.namespace}/{c.metadata.name}": c.metadata.resource_version
        for c in api.list_resource_claim_for_all_namespaces().items
    }


@pytest.fixture
def h200_node(cluster, resource_api: kubernetes.client.ResourceV1Api) -> Iterator[list[str]]:
    """NODE with an hgx-h200's slices, a template in the cluster, and 5 of its 8 GPUs allocated: 4
    by plain claims, 1 by a member of a gang of 2 (opted in to the controller)."""
    cluster.add_node(NODE)
    inventory = node_inventory(discover_gpus(NvmlSession.open("mock:hgx-h200")), SharingConfig())
    for body in build_slices(DRIVER, NODE, inventory, generation=1, owner=None):
        resource_api.create_resource_slice(body)
    template = {"metadata": {"name": "h200"}, "spec": {"spec": WHOLE_H200}}
    resource_api.create_namespaced_resource_claim_template("default", template)
    held = [
        create_allocated_claim(resource_api, [{"request": "gpu", "device": f"gpu-{i}", "pool": NODE}])["name"]
        for i in range(4)
    ]
    resource_api.create_namespaced_resource_claim("default", claim("pair-0", GANG))
    result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-4"}
    status = {"status": {"allocation": {"devices": {"results": [result]}}}}
    resource_api.patch_namespaced_resource_claim_status("pair-0", "default", status)
    try:
        yield held
    finally:
        for name in [*held, "pair-0"]:
            resource_api.delete_namespaced_resource_claim(name, "default")
        resource_api.delete_namespaced_resource_claim_template("h200", "default")
        resource_api.delete_collection_resource_slice(field_selector=f"spec.nodeName={NODE}")
        kubernetes.client.CoreV1Api(cluster.api_client()).delete_node(NODE)


def test_plan_against_the_cluster_counts_what_it_holds_and_writes_nothing(
    cluster, h200_node: list[str], resource_api: kubernetes.client.ResourceV1Api, tmp_path: Path
):
    manifests = tmp_path / "train.yaml"
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "train"},
        "spec": {
            "replicas": 3,
            "selector": {"matchLabels": {"app": "train"}},
            "template": {  # uses the template in the cluster
                "metadata": {"labels": {"app": "train"}},
                "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "h200"}], "containers": []},
            },
        },
    }
    documents = [deployment, claim("pair-1", GANG), claim(h200_node[0])]  # the last: held in the cluster already
    manifests.write_text("\n---\n".join(json.dumps(d) for d in documents))
    before = claims_in(resource_api)

    run = plan("--kubeconfig", str(cluster.kubeconfig), str(manifests), "-o", "json")
    assert run.returncode == 1, run.stderr  # the gang's second member finds no GPU left
    document = json.loads(run.stdout)
    got = {c["subject"]: c for c in document["claims"]}
    replicas = [f"deployment default/train replica {i}: claim gpu from template h200" for i in range(3)]
    assert list(got) == [*replicas, "resourceclaim default/pair-1"]
    assert sorted(got[s]["devices"][0] for s in replicas) == ["gpu-5", "gpu-6", "gpu-7"]  # 0-4 are held
    assert {got[s]["node"] for s in replicas} == {NODE}
    # The gang's allocated member in the cluster counts: the gang is whole, and cannot be placed.
    assert got["resourceclaim default/pair-1"]["error"].startswith("gang cannot be placed whole: default/pair-1: ")
    assert document["skipped"] == [
        {"object": f"resourceclaim default/{h200_node[0]}", "where": f"{manifests}: document 3",
         "reason": "already allocated in the cluster (counted)"}
    ]  # fmt: skip
    assert any(note.startswith("placement only on the ") for note in document["notes"])
    assert document["nodes"][NODE] == [f"  gpu-{i}-counters: full" for i in range(8)]
    assert claims_in(resource_api) == before  # nothing created, changed or deleted
