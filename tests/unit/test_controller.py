"""Controller pieces without an API server: leader election, pod claims, gang labels, plan CLI."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from driver.allocator.model import claim_from_object
from driver.controller.controller import gang_of, pending, pod_claim_names
from driver.controller.leader import LeaderElector
from driver.kube import ConflictError, NotFoundError
from tests.conftest import ROOT


class LeaseApi:
    """Leases with resourceVersions, refusing stale writes as the API server does."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0

    def get_lease(self, namespace: str, name: str) -> dict[str, Any]:
        if self.lease is None:
            raise NotFoundError(name)
        return copy.deepcopy(self.lease)

    def create_lease(self, namespace: str, lease: dict[str, Any]) -> dict[str, Any]:
        if self.lease is not None:
            raise ConflictError("exists")
        return self._store(lease)

    def replace_lease(self, namespace: str, lease: dict[str, Any]) -> dict[str, Any]:
        if self.lease is None or lease["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            raise ConflictError("stale")
        return self._store(lease)

    def _store(self, lease: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        self.lease = copy.deepcopy(lease)
        self.lease["metadata"]["resourceVersion"] = str(self.version)
        return copy.deepcopy(self.lease)


def test_one_replica_leads_and_another_takes_over_when_it_stops_renewing():
    api = LeaseApi()
    first, second = (LeaderElector(api, "ns", "lease", name, lease_s=15, renew_s=5) for name in ("a", "b"))
    assert first.try_acquire_or_renew() and not second.try_acquire_or_renew()
    assert first.try_acquire_or_renew()  # renewing keeps it
    assert api.lease is not None and api.lease["spec"]["holderIdentity"] == "a"
    api.lease["spec"]["renewTime"] = "2000-01-01T00:00:00.000000Z"  # "a" stopped renewing long ago
    assert second.try_acquire_or_renew()
    assert api.lease["spec"]["holderIdentity"] == "b" and api.lease["spec"]["leaseTransitions"] == 1


def test_a_stale_write_loses_the_race():
    api = LeaseApi()
    first, second = (LeaderElector(api, "ns", "lease", name) for name in ("a", "b"))
    real_get = api.get_lease
    api.get_lease = lambda ns, name: (_ for _ in ()).throw(NotFoundError(name))  # both saw no lease
    assert first.try_acquire_or_renew()
    assert not second.try_acquire_or_renew()  # its create conflicts
    api.get_lease = real_get
    assert not second.is_leader.is_set()


def test_pod_claims_from_names_and_templates():
    pod = {
        "spec": {
            "resourceClaims": [
                {"name": "a", "resourceClaimName": "shared"},
                {"name": "b", "resourceClaimTemplateName": "t"},
            ]
        },
        "status": {},
    }
    assert pod_claim_names(pod) is None  # the template's claim is not made yet
    pod["status"]["resourceClaimStatuses"] = [{"name": "b", "resourceClaimName": "pod-b-x1"}]
    assert pod_claim_names(pod) == ["shared", "pod-b-x1"]


def test_gang_labels_and_opt_in():
    labels = {"gpu.fgpu.dev/allocator": "fgpu", "gpu.fgpu.dev/gang": "train", "gpu.fgpu.dev/gang-size": "4"}
    obj = {"metadata": {"name": "c", "namespace": "ns", "labels": labels}, "spec": {"devices": {"requests": []}}}
    assert pending(obj) and gang_of(claim_from_object(obj)) == ("ns/train", 4)
    obj["metadata"]["labels"] = {**labels, "gpu.fgpu.dev/gang-size": "four"}
    assert gang_of(claim_from_object(obj)) == ("ns/train", 0)
    assert not pending({**obj, "status": {"allocation": {"devices": {}}}})
    assert not pending({"metadata": {"labels": {}}})


def discover(tmp_path: Path, node: str, machine: str) -> Path:
    command = [
        sys.executable,
        "-m",
        "driver.cli",
        "discover",
        "--nvml",
        f"mock:{machine}",
        "--node-name",
        node,
        "-o",
        "json",
    ]
    path = tmp_path / f"{node}.json"
    path.write_text(subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT).stdout)
    return path


def test_plan_prints_allocations_reasons_and_free_capacity(tmp_path: Path):
    claims = tmp_path / "claims.yaml"
    claims.write_text(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: four, namespace: ml}\n"
        "spec: {devices: {requests: [{name: r, exactly: {deviceClassName: gpu.fgpu.dev, count: 4}}]}}\n---\n"
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: huge-share, namespace: ml}\n"
        "spec: {devices: {requests: [{name: r, exactly: {deviceClassName: mps.gpu.fgpu.dev,"
        " capacity: {requests: {memory: 100Gi}}}}]}}\n"
    )
    slices = [discover(tmp_path, "n1", "dgx-h100"), discover(tmp_path, "n2", "l4x4")]
    command = [sys.executable, "-m", "driver.cli", "plan", "--slices", *map(str, slices), "--claims", str(claims)]
    command += ["--classes", str(ROOT / "daemonset" / "deviceclasses.yaml")]
    run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 1, run.stderr
    assert "ml/four: n1: gpu-0, gpu-1, gpu-2, gpu-3" in run.stdout
    assert (
        "ml/huge-share: cannot allocate: request r: no device of class mps.gpu.fgpu.dev with memory >= 100Gi"
        in run.stdout
    )
    assert "1 allocated, 1 failed" in run.stdout
    assert "  gpu-0-counters: full" in run.stdout and "  gpu-4-counters: free" in run.stdout
    as_json = json.loads(subprocess.run([*command, "-o", "json"], capture_output=True, text=True, cwd=ROOT).stdout)
    assert as_json["claims"][0]["node"] == "n1" and "error" in as_json["claims"][1]


def test_plan_reports_bad_files(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: ResourceSlice\nspec: {devices: [{name: d, capacity: {memory: {value: lots}}}]}\n")
    command = [
        sys.executable,
        "-m",
        "driver.cli",
        "plan",
        "--slices",
        str(bad),
        "--classes",
        str(bad),
        "--claims",
        str(bad),
    ]
    run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2 and "invalid quantity 'lots'" in run.stderr
