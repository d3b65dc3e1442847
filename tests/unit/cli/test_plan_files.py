"""`fgpu plan` as a command on files given by kind (--slices, --claims, --classes): allocations,
reasons, free capacity, JSON, and a bad file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT
from tests.support.controller_cluster import discover


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
    bad.write_text(
        "kind: ResourceSlice\nmetadata: {name: s}\nspec: {devices: [{name: d, capacity: {memory: {value: lots}}}]}\n"
    )
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


def test_plan_places_no_claim_on_shares_another_namespace_holds(tmp_path: Path):
    """A GPU's MPS shares belong to one namespace at a time (driver/claims/tenancy.py): a claim of
    another namespace would wait at prepare, so the plan refuses it, naming no other tenant."""
    share = (
        "spec: {devices: {requests: [{name: r, exactly: {deviceClassName: mps.gpu.fgpu.dev,"
        " selectors: [{cel: {expression: 'device.attributes[\"gpu.fgpu.dev\"].index == 0'}}],"
        " capacity: {requests: {compute: '10'}}}}]}}\n"
    )
    held = (
        "status: {allocation: {devices: {results: [{request: r, driver: gpu.fgpu.dev, pool: n1,"
        " device: gpu-0-mps, shareID: 6f2b0c1e-0000-4000-8000-000000000001, consumedCapacity: {compute: '10'}}]}}}\n"
    )
    claims = tmp_path / "claims.yaml"
    claims.write_text(
        "\n---\n".join(
            f"apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: {name}, namespace: {ns}}}\n"
            + share
            + extra
            for name, ns, extra in (("running", "a", held), ("other", "b", ""), ("second", "a", ""))
        )
    )
    command = [sys.executable, "-m", "driver.cli", "plan", "--slices", str(discover(tmp_path, "n1", "dgx-h100"))]
    command += ["--claims", str(claims), "--classes", str(ROOT / "daemonset" / "deviceclasses.yaml")]
    run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 1, run.stderr
    assert "a/second: n1: gpu-0-mps" in run.stdout
    assert "b/other: cannot allocate:" in run.stdout
    assert "n1/gpu-0-mps (another tenant's shares: they belong to one namespace at a time" in run.stdout
    assert "a/running" not in run.stdout.split("b/other: cannot allocate:")[1].splitlines()[0]
