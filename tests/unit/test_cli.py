import subprocess
import sys
from pathlib import Path


def run_plugin(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "driver.cli", "kubelet-plugin", "--node-name=n1", "--nvml=mock:l4x4",
        f"--plugin-dir={tmp_path / 'p'}", f"--registrar-dir={tmp_path / 'r'}", f"--cdi-dir={tmp_path / 'c'}", *flags,
    ]  # fmt: skip
    env = {"PATH": "/usr/bin:/bin"}  # no KUBECONFIG, no in-cluster service account
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)


def test_missing_client_configuration_is_a_clear_error(tmp_path: Path):
    run = run_plugin(tmp_path)
    assert run.returncode == 2
    assert "cannot load the Kubernetes client configuration from the in-cluster service account" in run.stderr
    run = run_plugin(tmp_path, f"--kubeconfig={tmp_path / 'missing'}")
    assert run.returncode == 2 and str(tmp_path / "missing") in run.stderr


def test_bad_sharing_config_names_the_problem(tmp_path: Path):
    run = run_plugin(tmp_path, "--offer=whole,vgpu")
    assert run.returncode == 2
    assert "unknown kind(s) ['vgpu']" in run.stderr
