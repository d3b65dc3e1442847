import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import KUBECONFIG


def discover(*flags: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "driver.cli", *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


@pytest.mark.root  # mounts an MPS tmpfs / uses kubelet's directories
def test_json_logs_are_one_object_a_line(tmp_path: Path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG)
    root = tmp_path / "root"
    (root / "usr").mkdir(parents=True)  # not a mock driver root: the plugin stops after discovery
    run = discover("--log-format=json", "kubelet-plugin", "--node-name=n1", "--nvml=mock:l4x4",
                   f"--plugin-dir={tmp_path}", f"--kubeconfig={kubeconfig}", f"--driver-root={root}")  # fmt: skip
    logged = [json.loads(line) for line in run.stderr.splitlines() if line.startswith("{")]
    assert {"ts", "level", "logger", "msg"} <= logged[0].keys()
    assert next(e["msg"] for e in logged if e["logger"] == "driver.node.server").startswith("discovered 4 GPU(s)")


@pytest.mark.root  # root writes past file permissions: only a read-only mount refuses it
def test_an_unwritable_state_dir_is_refused(tmp_path: Path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG)
    locked = tmp_path / "out"
    locked.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "fgpu-test-ro", str(locked)], check=True)
    try:
        run = discover("kubelet-plugin", "--node-name=n1", "--nvml=mock:l4x4", f"--kubeconfig={kubeconfig}",
                       f"--plugin-dir={locked}/plugin", f"--registrar-dir={locked}/registrar",
                       f"--cdi-dir={locked}/cdi", f"--state-dir={locked}/state")  # fmt: skip
    finally:
        subprocess.run(["umount", str(locked)], check=True)
    assert run.returncode == 2
    assert (
        run.stderr.strip()
        == f"fgpu: --registrar-dir {locked}/registrar: {locked} is not writable; give a directory this user can write"
    )
