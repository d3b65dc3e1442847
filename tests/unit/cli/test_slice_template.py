"""`fgpu slice-template` as users run it: the template of a node type is exactly what `fgpu discover`
prints for a node of that machine and offer, less the node (slice names, nodeName, the pool's name)
and the GPUs' serial facts; Karpenter's form holds the same slices, and binds the devices that will
share a serial fact; bad input is one line and exit 2; a mock state file does not leak in."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pynvml
import pytest
import yaml

from driver.cli.main import main
from driver.inventory.templates import KARPENTER_DEVICE_FIELDS, NODE_FACT_ATTRIBUTES
from driver.nvml.machine import MACHINES_DIR, bundled_machines, load_machine
from driver.nvml.mock import MockNvml
from driver.nvml.session import MOCK_STATE_ENV
from tests.support import ROOT

ALL = ["--offer", "whole,mig,mps,timeslice,mig-mps,mig-timeslice"]


@pytest.fixture(autouse=True)
def _no_mock_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MOCK_STATE_ENV, raising=False)


def fgpu(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "driver.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> Any:
    assert main(list(args)) == 0
    return json.loads(capsys.readouterr().out)


def discovered(capsys: pytest.CaptureFixture[str], machine: str, flags: list[str]) -> list[Any]:
    return run_main(capsys, "discover", "--nvml", f"mock:{machine}", "--node-name", "n1", "-o", "json", *flags)["items"]


def node_free(slices: list[Any], pool: str) -> list[Any]:
    """`fgpu discover`'s slices with the node-specific fields removed: metadata (the slice names and
    the spec hash over them), nodeName; the pool named as the template names it; no serial facts."""
    specs = []
    for item in slices:
        spec = copy.deepcopy(item["spec"])
        del spec["nodeName"]
        spec["pool"]["name"] = pool
        for device in spec.get("devices", []):
            device["attributes"] = {k: v for k, v in device["attributes"].items() if k not in NODE_FACT_ATTRIBUTES}
        specs.append(spec)
    return specs


@pytest.mark.parametrize("flags", [[], ALL], ids=["default", "all"])
@pytest.mark.parametrize("machine", bundled_machines())
def test_resourceslices_are_what_discover_prints_without_the_node(
    machine: str, flags: list[str], capsys: pytest.CaptureFixture[str]
):
    template = run_main(
        capsys, "slice-template", "--machine", machine, "--format", "resourceslices", "-o", "json", *flags
    )
    assert template["kind"] == "List"
    assert {(i["apiVersion"], i["kind"]) for i in template["items"]} == {("resource.k8s.io/v1", "ResourceSlice")}
    assert all(set(i) == {"apiVersion", "kind", "spec"} for i in template["items"])
    assert [i["spec"] for i in template["items"]] == node_free(discovered(capsys, machine, flags), machine)


@pytest.mark.parametrize("flags", [[], ALL], ids=["default", "all"])
@pytest.mark.parametrize("machine", ["dgx-h100", "dgx-a100-40gb", "l4x4"])
def test_karpenter_templates_hold_the_same_slices_and_bind_each_gpus_devices(
    machine: str, flags: list[str], capsys: pytest.CaptureFixture[str]
):
    dynamic = run_main(capsys, "slice-template", "--machine", machine, "-o", "json", *flags)
    published = discovered(capsys, machine, flags)
    expected = []
    for spec in node_free(published, machine):
        entry = {"driver": "gpu.fgpu.dev", "pool": {"name": machine}}
        if "sharedCounters" in spec:
            entry["sharedCounters"] = spec["sharedCounters"]
        else:
            entry["devices"] = [{k: d[k] for k in KARPENTER_DEVICE_FIELDS if k in d} for d in spec["devices"]]
        expected.append(entry)
    assert dynamic["resourceSliceTemplates"] == expected
    # Each serial fact's devices, GPU by GPU, as a node publishes them: the devices a binding names
    # share the value on the node, and every device that shares one with another is bound.
    values = {
        (name, d["name"]): d["attributes"][name]["string"]
        for s in published
        for d in s["spec"].get("devices", [])
        for name in NODE_FACT_ATTRIBUTES & d["attributes"].keys()
    }
    groups: dict[tuple[str, str], set[str]] = {}
    for (name, device), value in values.items():
        groups.setdefault((name, value), set()).add(device)
    bound = set()
    for binding in dynamic["attributeBindings"]:
        attribute = binding["attribute"].removeprefix("gpu.fgpu.dev/")
        devices = {ref["device"] for ref in binding["devices"]}
        assert {(ref["driver"], ref["pool"]) for ref in binding["devices"]} == {("gpu.fgpu.dev", machine)}
        assert len(devices) >= 2 and len({values[(attribute, d)] for d in devices}) == 1
        bound.add((attribute, frozenset(devices)))
    assert bound == {(name, frozenset(devices)) for (name, _), devices in groups.items() if len(devices) > 1}


def test_the_command_prints_yaml_for_either_format_and_the_offer_shapes_it():
    run = fgpu("slice-template", "--machine", "dgx-h100", *ALL)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    dynamic = yaml.safe_load(run.stdout)
    templates = dynamic["resourceSliceTemplates"]
    assert all(("devices" in t) != ("sharedCounters" in t) for t in templates)  # never both (Karpenter's rule)
    devices = [d for t in templates for d in t.get("devices", [])]
    assert {d["attributes"]["type"]["string"] for d in devices} == {
        "gpu", "mig", "mps", "timeslice", "mig-mps", "mig-timeslice"
    }  # fmt: skip
    assert not any(NODE_FACT_ATTRIBUTES & d["attributes"].keys() for d in devices)
    whole = fgpu("slice-template", "--machine", "dgx-h100", "--offer", "whole", "--format", "resourceslices")
    assert whole.returncode == 0, whole.stderr
    slices = yaml.safe_load(whole.stdout)["items"]
    assert [d["name"] for s in slices for d in s["spec"].get("devices", [])] == [f"gpu-{i}" for i in range(8)]
    assert all("nodeName" not in s["spec"] and s["spec"]["pool"]["name"] == "dgx-h100" for s in slices)


def test_a_profile_file_is_a_machine_type_and_names_the_pool(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    raw = yaml.safe_load((MACHINES_DIR / "l4x4.yaml").read_text())
    profile = tmp_path / "l4-box.yaml"
    profile.write_text(yaml.safe_dump({**raw, "name": "l4-box", "gpuCount": 2}))
    dynamic = run_main(capsys, "slice-template", "--machine", str(profile), "--offer", "whole,mps", "-o", "json")
    (devices,) = [t["devices"] for t in dynamic["resourceSliceTemplates"] if "devices" in t]
    assert [d["name"] for d in devices] == ["gpu-0", "gpu-0-mps", "gpu-1", "gpu-1-mps"]
    assert {t["pool"]["name"] for t in dynamic["resourceSliceTemplates"]} == {"l4-box"}
    assert [[ref["device"] for ref in b["devices"]] for b in dynamic["attributeBindings"]] == [
        ["gpu-0", "gpu-0-mps"],
        ["gpu-1", "gpu-1-mps"],
    ]


def test_a_held_back_kind_is_said_on_stderr_as_discover_says_it(capsys: pytest.CaptureFixture[str]):
    assert main(["slice-template", "--machine", "dgx-a100-40gb", "-o", "json"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 8 and err[0].startswith("GPU 0 (NVIDIA A100-SXM4-40GB) offers no mig: MIG mode is off")


def test_a_mock_state_file_does_not_change_the_template(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A shell that ran a mock node (FGPU_NVML_MOCK_STATE) has GPUs in whatever state it left them:
    here an A100 switched to MIG mode. A node type's template is a freshly started node's."""
    state = tmp_path / "state.json"
    mock = MockNvml(load_machine("dgx-a100-40gb"), state)
    mock.nvmlInit()
    mock.nvmlDeviceSetMigMode(mock.nvmlDeviceGetHandleByIndex(0), pynvml.NVML_DEVICE_MIG_ENABLE)
    mock.reset_gpu(0)
    args = ["slice-template", "--machine", "dgx-a100-40gb", "-o", "json"]
    fresh = fgpu(*args)
    with_state = fgpu(*args, env={**os.environ, MOCK_STATE_ENV: str(state)})
    assert fresh.returncode == with_state.returncode == 0
    assert with_state.stdout == fresh.stdout


@pytest.mark.parametrize("machine", ["dgx-a100-40gb", "dgx-h100"])
def test_mig_mode_on_is_what_a_node_whose_gpus_were_switched_publishes(
    machine: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    """An Ampere node pool run in MIG mode is a node type of its own: its template is what such a
    node publishes (MIG devices only); on Hopper the mode changes nothing."""
    state = tmp_path / "state.json"
    mock = MockNvml(load_machine(machine), state)
    mock.nvmlInit()
    for index in range(mock.nvmlDeviceGetCount()):
        mock.nvmlDeviceSetMigMode(mock.nvmlDeviceGetHandleByIndex(index), pynvml.NVML_DEVICE_MIG_ENABLE)
        mock.reset_gpu(index)
    template = ["slice-template", "--machine", machine, "--format", "resourceslices", "-o", "json"]
    mig_on = run_main(capsys, *template, "--mig-mode", "on")["items"]
    mig_off = run_main(capsys, *template)["items"]
    monkeypatch.setenv(MOCK_STATE_ENV, str(state))
    assert [i["spec"] for i in mig_on] == node_free(discovered(capsys, machine, []), machine)
    assert (mig_on == mig_off) == (machine == "dgx-h100")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--machine", "dgx-z999"], "fgpu: unknown mock machine 'dgx-z999'; bundled: "),
        (["--machine", "l4x4", "--offer", "mig"], "fgpu: GPU(s) 0, 1, 2, 3 would offer no device: "),
        (["--machine", "dgx-h100", "--offer", "whole,bogus"], "fgpu: --offer: unknown kind(s) ['bogus']"),
        (["--machine", "dgx-h100", "--driver-name", "Not_A_Name"], "fgpu: --driver-name 'Not_A_Name' is not"),
        (["--machine", "l4x4", "--mig-mode", "on"], "fgpu: --mig-mode on: NVIDIA L4 (l4x4) has no MIG"),
        (["--machine", "dgx-h100", "--format", "csv"], "fgpu slice-template: argument --format: invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str):
    run = fgpu("slice-template", *args)
    assert (run.returncode, run.stdout) == (2, "")
    assert run.stderr.startswith(message) and run.stderr.count("\n") == 1, run.stderr
