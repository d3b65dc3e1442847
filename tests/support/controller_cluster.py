"""The controller in-process on an in-memory API server (testbed/controller_api.py): one dgx-h100's
slices per node, opt-in claims and gated pods, and what the tests read back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from driver.controller.controller import Controller
from driver.controller.ledger import entries_of, ledger_name
from testbed.controller_api import InMemoryControllerApi
from tests.support import ROOT


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


def fake_cluster(template: str, nodes: int = 1) -> InMemoryControllerApi:
    """One dgx-h100 node's slices per node (n1, n2, ...), the device classes, the nodes."""
    api = InMemoryControllerApi()
    for i in range(1, nodes + 1):
        for obj in json.loads(template.replace('"n1', f'"n{i}'))["items"]:
            api.put("slices", obj)
        api.put("nodes", {"metadata": {"name": f"n{i}", "labels": {}}})
    for obj in yaml.safe_load_all((ROOT / "daemonset" / "deviceclasses.yaml").read_text()):
        if obj:
            api.put("classes", obj)
    return api


def sync(controller: Controller, *kinds: str) -> None:
    for kind in kinds or controller.informers:
        controller.informers[kind].relist()


def opt_in_claim(name: str, count: int, **labels: str) -> dict[str, Any]:
    meta = {"name": name, "namespace": "ml", "labels": {"gpu.fgpu.dev/allocator": "fgpu", **labels}}
    request = {"name": "r", "exactly": {"deviceClassName": "gpu.fgpu.dev", "count": count}}
    return {"metadata": meta, "spec": {"devices": {"requests": [request]}}}


def gated_pod(name: str, claim: str) -> dict[str, Any]:
    spec = {"schedulingGates": [{"name": "gpu.fgpu.dev/allocation"}]}
    spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
    return {"metadata": {"name": name, "namespace": "ml"}, "spec": spec}


def devices_of(claim: dict[str, Any]) -> list[tuple[str, str]]:
    allocation = (claim.get("status") or {}).get("allocation") or {}
    return [(r["pool"], r["device"]) for r in allocation.get("devices", {}).get("results", [])]


def claims_in(api: InMemoryControllerApi) -> dict[str, dict[str, Any]]:
    return {c["metadata"]["name"]: c for c in api.store["claims"].values()}


def assert_no_device_given_twice(api: InMemoryControllerApi) -> None:
    held = [d for c in api.store["claims"].values() for d in devices_of(c)]
    assert len(held) == len(set(held)), held


def gates(api: InMemoryControllerApi, pod: str) -> list[str]:
    return [g["name"] for g in api.store["pods"][f"ml/{pod}"]["spec"]["schedulingGates"]]


def ledger_entries(api: InMemoryControllerApi, pool: str = "n1") -> dict[str, Any]:
    ledger = api.store["ledgers"].get(f"fgpu/{ledger_name(('gpu.fgpu.dev', pool))}")
    return entries_of(ledger) if ledger else {}
