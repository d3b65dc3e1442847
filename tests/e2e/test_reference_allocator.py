"""The reference allocator CLI (k8s.io/dynamic-resource-allocation/structured) over our slices."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from testbed.claims_api import gpu_request
from testbed.cluster.harness import build_binaries

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.go


def claim(name: str, expression: str, count: int = 1) -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
        "spec": {"devices": {"requests": [gpu_request(selector=expression, count=count)]}},
    }


@pytest.fixture(scope="module")
def allocate_binary() -> Path:
    return build_binaries() / "allocate"


def discover(node: str, machine: str) -> dict:
    command = [sys.executable, "-m", "driver.cli", "discover", "--nvml", f"mock:{machine}", "--node-name", node]
    return json.loads(subprocess.run([*command, "-o", "json"], capture_output=True, text=True, check=True).stdout)


def test_allocates_claims_in_turn_and_explains_failure(tmp_path: Path, allocate_binary: Path):
    slices = tmp_path / "slices.json"
    slices.write_text(
        json.dumps({"kind": "List", "items": discover("n1", "l4x4")["items"] + discover("n2", "dgx-h100")["items"]})
    )
    big = 'device.capacity["gpu.fgpu.dev"].memory.compareTo(quantity("40Gi")) >= 0'
    claims = tmp_path / "claims.yaml"
    claims.write_text(
        yaml.safe_dump_all(
            [
                claim("four-l4", 'device.attributes["gpu.fgpu.dev"].productName == "NVIDIA L4"', count=4),
                claim("one-more-l4", 'device.attributes["gpu.fgpu.dev"].productName == "NVIDIA L4"'),
                claim("eight-big", big, count=8),
                claim("ninth-big", big),
            ]
        )
    )
    run = subprocess.run(
        [str(allocate_binary), str(ROOT / "daemonset" / "deviceclasses.yaml"), str(slices), str(claims)],
        capture_output=True,
        text=True,
        check=True,
    )
    out = json.loads(run.stdout)
    by_claim = {r["claim"]: r for r in out["results"]}
    four = by_claim["default/four-l4"]
    assert four["node"] == "n1"
    assert sorted(r["device"] for r in four["allocation"]["devices"]["results"]) == [f"gpu-{i}" for i in range(4)]
    assert "cannot allocate" in by_claim["default/one-more-l4"]["error"]  # all four L4s are taken
    assert by_claim["default/eight-big"]["node"] == "n2"
    assert "cannot allocate" in by_claim["default/ninth-big"]["error"]
    assert (out["allocated"], out["failed"]) == (2, 2)


def test_bad_input_is_reported(tmp_path: Path, allocate_binary: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: Gadget\nmetadata: {name: x}\n")
    run = subprocess.run([str(allocate_binary), str(bad)], capture_output=True, text=True)
    assert run.returncode == 2
    assert 'unsupported kind "Gadget"' in run.stderr
