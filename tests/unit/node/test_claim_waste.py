"""Waste on the dashboard (issue 42): what each claim was given beside what its processes use
(fgpu_claim_memory_allocated_bytes, fgpu_claim_compute_allocated_ratio; driver/node/claim_usage.py),
with the workload that owns its pods as labels where tenant labels are on (driver/node/metrics.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from driver.claims.refs import ClaimRef
from driver.kube.client import JsonObject
from driver.kube.errors import KubeUnavailableError
from driver.node.kubelet.dra_service import DraV1Service
from driver.node.metrics import ClaimHolders, NodeCollector, node_registry
from driver.nvml.mock import MockProcess
from testbed.fakes import InMemoryKubeApi, allocated_claim, result
from testbed.node_env import NodeEnv
from tests.support.dra_calls import prepare

GIB = 2**30
WEB_POD = "0f0e0d0c-1111-2222-3333-444455556666"
JOB_POD = "5a5b5c5d-7777-8888-9999-000011112222"
LABELS = ("claim_namespace", "claim", "kind", "workload_kind", "workload")
USED, GIVEN = "fgpu_claim_memory_used_bytes", "fgpu_claim_memory_allocated_bytes"
COMPUTE_GIVEN = "fgpu_claim_compute_allocated_ratio"


def share_claim(api: InMemoryKubeApi, name: str, device: str, capacity: dict[str, str], pod: str = "") -> ClaimRef:
    share = {**result(device), "shareID": name, "consumedCapacity": capacity}
    claim = allocated_claim("team", name, f"uid-{name}", [share])
    if pod:
        uid = api.pods[("team", pod)]["metadata"]["uid"]
        claim["status"]["reservedFor"] = [{"resource": "pods", "name": pod, "uid": uid}]
    api.claims[("team", name)] = claim
    return ClaimRef("team", name, f"uid-{name}")


def owned_pod(api: InMemoryKubeApi, name: str, uid: str, owner: tuple[str, str], labels: dict[str, str]) -> None:
    reference = {"kind": owner[0], "name": owner[1], "controller": True}
    metadata = {"name": name, "namespace": "team", "uid": uid, "labels": labels, "ownerReferences": [reference]}
    api.pods[("team", name)] = {"metadata": metadata}


@pytest.fixture
def claims(node: tuple[InMemoryKubeApi, NodeEnv], tmp_path: Path) -> tuple[InMemoryKubeApi, NodeEnv, Path]:
    """An MPS share of 10Gi and 25% whose Deployment's process holds 2Gi, a 4Gi time-sliced share of a
    Job using nothing, and an MPS share no pod holds yet."""
    api, env = node
    owned_pod(api, "web-7d4b9c-x2x", WEB_POD, ("ReplicaSet", "web-7d4b9c"), {"pod-template-hash": "7d4b9c"})
    owned_pod(api, "train-q8z", JOB_POD, ("Job", "train"), {})
    mps = {"memory": "10Gi", "compute": "25"}
    refs = [
        share_claim(api, "web", "gpu-3-mps", mps, pod="web-7d4b9c-x2x"),
        share_claim(api, "train", "gpu-4-ts", {"memory": "4Gi"}, pod="train-q8z"),
        share_claim(api, "pending", "gpu-3-mps", mps),
    ]
    assert not any(prepare(DraV1Service(env.preparer, lambda uids, answered: None), refs).values())
    proc = tmp_path / "proc"
    (proc / "4242").mkdir(parents=True)
    (proc / "4242" / "cgroup").write_text(f"0::/kubepods/besteffort/pod{WEB_POD}/c0ffee\n")
    env.session.nvml.set_process(3, MockProcess(4242, sm_percent=8, memory_mib=2048))
    return api, env, proc


def waste_series(collector: NodeCollector) -> dict[tuple[str, ...], float]:
    return {
        (s.name, *(s.labels[label] for label in LABELS)): s.value
        for family in node_registry(collector).collect()
        for s in family.samples
        if s.name in (USED, GIVEN, COMPUTE_GIVEN)
    }


def pod_gets(api: InMemoryKubeApi, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the pods the collector reads, in order."""
    read, real = [], api.get_pod

    def get_pod(namespace: str, name: str) -> JsonObject:
        read.append(name)
        return real(namespace, name)

    monkeypatch.setattr(api, "get_pod", get_pod)
    return read


def test_each_claim_is_given_and_uses_per_claim_with_its_workload(claims, monkeypatch):
    api, env, proc = claims
    read = pod_gets(api, monkeypatch)
    collector = NodeCollector("node-a", env.claims, env.session, env.gpus, ClaimHolders(api),
                              proc_root=proc, tenant_labels=True)  # fmt: skip
    web = ("team", "web", "mps", "Deployment", "web")
    train = ("team", "train", "timeslice", "Job", "train")
    pending = ("team", "pending", "mps", "", "")
    assert waste_series(collector) == {
        (USED, *web): 2 * GIB,  # 8Gi of its 10Gi wasted
        (GIVEN, *web): 10 * GIB,
        (COMPUTE_GIVEN, *web): 0.25,
        (USED, *train): 0,
        (GIVEN, *train): 4 * GIB,  # its allocation, not the GPU it may fill: nothing enforces it
        (USED, *pending): 0,  # no pod yet: no workload
        (GIVEN, *pending): 10 * GIB,
        (COMPUTE_GIVEN, *pending): 0.25,
    }  # a time-sliced share is given no compute of its own: no series
    assert sorted(read) == ["train-q8z", "web-7d4b9c-x2x"]
    waste_series(collector)
    assert len(read) == 2  # a pod's owner does not change: read once


def test_without_tenant_labels_what_claims_are_given_is_by_kind_and_no_pod_is_read(claims, monkeypatch):
    api, env, proc = claims
    read = pod_gets(api, monkeypatch)
    collector = NodeCollector("node-a", env.claims, env.session, env.gpus, ClaimHolders(api), proc_root=proc)
    assert waste_series(collector) == {
        (USED, "", "", "mps", "", ""): 2 * GIB,
        (GIVEN, "", "", "mps", "", ""): 20 * GIB,
        (COMPUTE_GIVEN, "", "", "mps", "", ""): 0.5,
        (USED, "", "", "timeslice", "", ""): 0,
        (GIVEN, "", "", "timeslice", "", ""): 4 * GIB,
    }
    assert read == []


def test_a_pod_that_cannot_be_read_leaves_its_workload_unnamed_and_spares_the_api_server(claims, monkeypatch):
    api, env, proc = claims
    now = [0.0]
    collector = NodeCollector("node-a", env.claims, env.session, env.gpus, ClaimHolders(api, clock=lambda: now[0]),
                              proc_root=proc, tenant_labels=True)  # fmt: skip
    tries, real = [], api.get_pod

    def unavailable(namespace: str, name: str) -> JsonObject:
        tries.append(name)
        raise KubeUnavailableError("connection refused")

    monkeypatch.setattr(api, "get_pod", unavailable)
    workloads = {key[4:] for key in waste_series(collector)}
    assert workloads == {("", "")} and len(tries) == 1  # the other pod is not tried
    now[0] = 30
    waste_series(collector)
    assert len(tries) == 1  # quiet for the refresh period
    monkeypatch.setattr(api, "get_pod", real)
    now[0] = 61
    assert {key[4:] for key in waste_series(collector)} == {("Deployment", "web"), ("Job", "train"), ("", "")}
    # A pod re-created under its name is not the pod that holds the claim: no workload, not asked again.
    api.pods[("team", "train-q8z")]["metadata"]["uid"] = "another"
    fresh = NodeCollector("node-a", env.claims, env.session, env.gpus, ClaimHolders(api),
                          proc_root=proc, tenant_labels=True)  # fmt: skip
    assert ("Job", "train") not in {key[4:] for key in waste_series(fresh)}
