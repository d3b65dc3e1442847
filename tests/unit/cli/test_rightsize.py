"""`fgpu rightsize`: history files in, a table or patches out, one-line errors; and the plugin's
`fgpu` parser does not import the sizing code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest

from driver.cli.main import main
from driver.sizing.history import DAY_S, ClaimRecord, Sample, UsageHistory, Workload, record, to_json
from driver.sizing.sizes import Size
from tests.support import ROOT

H100 = "NVIDIA H100 80GB HBM3"


def history_file(tmp_path: Path, uid: str, node: str) -> Path:
    claim = ClaimRecord(
        uid, "ml", uid, Workload("Deployment", "inference"), "share", "gpu", 0, H100, Size("mps", 10240, 25)
    )
    samples = [Sample(uid, t, 2048, 8.0) for t in range(0, 2 * DAY_S, 60)]
    path = tmp_path / f"{node}.json"
    path.write_text(to_json(record(UsageHistory(60), [claim], samples)))
    return path


def test_the_table_merges_the_histories_of_several_nodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    files = [str(history_file(tmp_path, "a", "n1")), str(history_file(tmp_path, "b", "n2"))]
    assert main(["rightsize", "--history", *files, f"--now={2 * DAY_S}"]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split()[:4] == ["NAMESPACE", "WORKLOAD", "TEMPLATE/REQUEST", "CURRENT"]
    assert row.split()[:7] == ["ml", "Deployment/inference", "share/gpu", "mps", "10Gi", "25%", "mps"]
    assert "2560Mi 9%" in row and "7.68" in row and "100%" in row  # two replicas' claim-hours


def test_patch_output_is_a_json_patch_per_template(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert (
        main(["rightsize", "--history", str(history_file(tmp_path, "a", "n1")), f"--now={2 * DAY_S}", "-o", "patch"])
        == 0
    )
    (patch,) = json.loads(capsys.readouterr().out)
    assert patch["resourceClaimTemplate"] == "share" and patch["patch"][0]["op"] == "test"


def test_a_bad_history_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["rightsize", "--history", str(bad)]) == 2
    assert (
        capsys.readouterr().err
        == "fgpu rightsize: usage history: expected apiVersion gpu.fgpu.dev/v1alpha1, kind UsageHistory\n"
    )


def test_the_parser_does_not_import_the_sizing_code():
    code = "import sys; from driver.cli.main import build_parser; build_parser(); print(sorted(sys.modules))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "driver.sizing" not in run.stdout and "driver.cli.rightsize'" not in run.stdout


class ConfigMapsApi:
    """What `fgpu rightsize --kubeconfig` asks of the API server: the namespace's usage ConfigMaps."""

    asked: ClassVar[list[tuple[str, str]]] = []

    def __init__(self, kubeconfig: str | None) -> None:
        self.kubeconfig = kubeconfig

    def list_configmaps(self, namespace: str, label_selector: str = "") -> list[dict]:
        from driver.sizing import store
        from driver.sizing.history import from_json

        self.asked.append((namespace, label_selector))
        return [store.configmap(node, namespace, from_json(history_file(self.tmp, uid, node).read_text()))
                for uid, node in (("a", "n1"), ("b", "n2"))]  # fmt: skip

    def close(self) -> None:
        pass


def test_kubeconfig_reads_and_merges_every_nodes_configmap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    from driver.kube import client

    monkeypatch.setattr(ConfigMapsApi, "tmp", tmp_path, raising=False)
    monkeypatch.setattr(client, "ClientKubeApi", ConfigMapsApi)
    args = ["rightsize", "--kubeconfig=kc", "--namespace=gpus", f"--now={2 * DAY_S}"]
    assert main(args) == 0
    assert ConfigMapsApi.asked[-1] == ("gpus", "app.kubernetes.io/component=usage-history")
    _, row = capsys.readouterr().out.splitlines()
    assert "2560Mi 9%" in row and "7.68" in row  # both nodes' replicas, as from the two files
    with pytest.raises(SystemExit) as both:  # one source or the other
        main(["rightsize", "--kubeconfig=kc", "--history", "f.json"])
    assert both.value.code == 2
