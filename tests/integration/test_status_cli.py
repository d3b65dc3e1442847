"""`fgpu status` as a process against the real kube-apiserver: slices and allocated claims as the
plugin and the scheduler write them, read back as JSON, YAML and the table; errors in one line."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from driver.inventory.discovery import discover_gpus
from driver.inventory.offers import node_inventory
from driver.inventory.sharing import SharingConfig
from driver.inventory.slices import build_slices
from driver.nvml.session import NvmlSession
from testbed.claims_api import DRIVER, create_allocated_claim
from tests.support.cli import status

pytestmark = pytest.mark.cluster

NODE = "status-node"  # a pool of its own: other tests' claims in node-a's pool stay out of the way
TAINT = {"key": "gpu.fgpu.dev/xid", "value": "79", "effect": "NoExecute"}
TIME_SLICING = {  # the class's, as kube-scheduler copies it: only a class sets the interval
    "source": "FromClass",
    "requests": ["ts"],
    "opaque": {
        "driver": DRIVER,
        "parameters": {
            "apiVersion": "gpu.fgpu.dev/v1alpha1",
            "kind": "ShareConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}},
        },
    },
}


def gated_pod(claim: str) -> dict[str, Any]:
    """A pod using `claim` that a scheduling gate keeps from being scheduled."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "trainer"},
        "spec": {
            "schedulingGates": [{"name": "fgpu.test/hold"}],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
            "containers": [
                {"name": "main", "image": "registry.invalid/cuda:12", "resources": {"claims": [{"name": "gpu"}]}}
            ],
        },
    }


@pytest.fixture
def published(
    resource_api: kubernetes.client.ResourceV1Api, core_api: kubernetes.client.CoreV1Api
) -> Iterator[dict[str, dict[str, str]]]:
    """NODE's slices (gpu-3's devices tainted), four claims allocated in its pool, and a pod
    reserving the whole GPU's claim."""
    inventory = node_inventory(discover_gpus(NvmlSession.open("mock:dgx-h100")), SharingConfig())
    slices = build_slices(DRIVER, NODE, inventory, generation=1, owner=None)
    for device in (d for s in slices for d in s["spec"].get("devices", [])):
        if device["name"].startswith("gpu-3"):
            device["taints"] = [TAINT]
    for body in slices:
        resource_api.create_resource_slice(body)
    claims = {
        "whole": create_allocated_claim(resource_api, [{"request": "gpu", "device": "gpu-0", "pool": NODE}]),
        "mig": create_allocated_claim(resource_api, [{"request": "mig", "device": "gpu-1-mig-3g40gb-4", "pool": NODE}]),
        "mps": create_allocated_claim(
            resource_api,
            [
                {
                    "request": "mps",
                    "device": "gpu-2-mps",
                    "pool": NODE,
                    "consumedCapacity": {"memory": "8Gi", "compute": "20", "clients": "1"},
                }
            ],
        ),
        "ts": create_allocated_claim(
            resource_api,
            [{"request": "ts", "device": "gpu-4-ts", "pool": NODE, "consumedCapacity": {"memory": "4Gi"}}],
            config=[TIME_SLICING],
        ),
    }
    # The claim controller drops reservations of pods that do not exist: a real pod, held unscheduled.
    pod = core_api.create_namespaced_pod("default", gated_pod(claims["whole"]["name"]))
    reserved = {"reservedFor": [{"resource": "pods", "name": pod.metadata.name, "uid": pod.metadata.uid}]}
    resource_api.patch_namespaced_resource_claim_status(claims["whole"]["name"], "default", {"status": reserved})
    try:
        yield claims
    finally:
        core_api.delete_namespaced_pod(pod.metadata.name, "default", grace_period_seconds=0)
        for claim in claims.values():
            resource_api.delete_namespaced_resource_claim(claim["name"], claim["namespace"])
        resource_api.delete_collection_resource_slice(field_selector=f"spec.nodeName={NODE}")


def test_status_reports_holdings_free_capacity_and_taints(cluster, published):
    run = status("--kubeconfig", str(cluster.kubeconfig), "--node", f"{NODE},ghost", "-o", "json")
    assert run.returncode == 0, run.stderr
    document = json.loads(run.stdout)
    assert [(n["name"], n["problem"]) for n in document["nodes"]] == [
        ("ghost", "publishes no gpu.fgpu.dev devices"),
        (NODE, None),
    ]
    assert document["unpublished"] == []
    gpus = {gpu["index"]: gpu for gpu in document["nodes"][1]["gpus"]}
    assert [gpus[i]["state"] for i in range(8)] == [
        "full",
        "partial",
        "partial",
        "free",
        "partial",
        "free",
        "free",
        "free",
    ]
    whole, mig, mps, ts = (gpus[i]["claims"][0] for i in (0, 1, 2, 4))
    assert (whole["claim"], whole["kind"], whole["pods"]) == (
        f"default/{published['whole']['name']}",
        "whole",
        ["default/trainer"],
    )
    assert (mig["kind"], mig["profile"], mig["placementStart"]) == ("mig", "3g.40gb", 4)
    assert {p["device"] for p in gpus[1]["migPlaceable"]} >= {"gpu-1-mig-4g40gb-0", "gpu-1-mig-1g10gb-3"}
    assert "gpu-1-mig-1g10gb-4" not in {p["device"] for p in gpus[1]["migPlaceable"]}
    assert (mps["consumedCapacity"], mps["shareID"] is not None) == (
        {"memory": "8Gi", "compute": "20", "clients": "1"},
        True,
    )
    assert gpus[2]["shares"][0]["free"] == {"clients": "47", "compute": "80", "memory": "73216Mi"}  # 79.5Gi less 8Gi
    assert (ts["kind"], ts["interval"]) == ("timeslice", "Long")
    assert gpus[3]["taints"] == [{**TAINT, "devices": gpus[3]["taints"][0]["devices"]}]
    assert (gpus[3]["healthy"], len(gpus[3]["taints"][0]["devices"]), gpus[5]["healthy"]) == (False, 28, True)

    repeated = status("--kubeconfig", str(cluster.kubeconfig), "--node", NODE, "--node", "ghost", "-o", "yaml")
    assert yaml.safe_load(repeated.stdout) == document


def test_status_table_reads_kubeconfig_from_the_environment(cluster, published):
    run = status("--node", NODE, env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)})
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].split() == ["NODE", "GPU", "PRODUCT", "HEALTH", "STATE", "FREE"]
    assert lines[3].split()[-8:] == ["partial", "mps", "clients", "47,", "compute", "80,", "memory", "73216Mi"]
    holds = {line.split()[0]: line for line in lines if line.startswith("default/")}
    assert holds[f"default/{published['ts']['name']}"].split()[4:] == [
        "timeslice",
        "memory",
        "4Gi,",
        "interval",
        "Long",
        "-",
    ]
    assert lines[-1].split() == [NODE, "3", "gpu.fgpu.dev/xid=79:NoExecute", "gpu-3", "and", "27", "more"]


def test_status_errors_are_one_line_and_exit_2(tmp_path: Path):
    unreachable = tmp_path / "kubeconfig"
    unreachable.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters: [{name: k, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    run = status("--kubeconfig", str(unreachable))
    assert (run.returncode, run.stdout, len(run.stderr.splitlines())) == (2, "", 1)
    assert run.stderr.startswith("fgpu status: API server unreachable: ")
    missing = status("--kubeconfig", str(tmp_path / "missing"))
    assert (missing.returncode, len(missing.stderr.splitlines())) == (2, 1)
    assert missing.stderr.startswith(
        f"fgpu: cannot load the Kubernetes client configuration from {tmp_path / 'missing'}"
    )
