"""Mock GPUs on a real container runtime: the plugin lays out a mock driver root (the fake tools,
placeholder libraries) whose files the CDI specs mount, runs the tools from there, and keeps the
fakes' state under its state dir."""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

import pytest

from driver.claims.refs import ClaimRef
from driver.cli.main import build_parser
from driver.common.flags import SettingsError
from driver.node.server import PluginProcess
from driver.node.settings import PluginSettings, plugin_settings
from driver.nvml import mock_driver_root
from driver.nvml.mock_driver_root import MockDriverRootError
from partitioner.mps import DEFAULT_SHM_BYTES
from testbed.fakes import InMemoryKubeApi, allocated_claim, result

DRIVER_VERSION = "580.95.05"  # the bundled machines'
LIBRARY_DIR = mock_driver_root.library_dir()


@pytest.fixture(autouse=True)
def no_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("NVML", "DRIVER_ROOT", "STATE_DIR", "MPS_SHM_SIZE", *mock_driver_root.fake_tools_env(Path()).keys()):
        monkeypatch.delenv(name, raising=False)


def settings(tmp_path: Path, *flags: str) -> PluginSettings:
    paths = [f"--{name}-dir={tmp_path / name}" for name in ("plugin", "cdi", "registrar")]
    return plugin_settings(build_parser().parse_args(["kubelet-plugin", "--node-name=node-a", *paths, *flags]))


def test_the_driver_root_and_device_nodes_follow_the_nvml_mode(tmp_path: Path):
    mock = settings(tmp_path, "--nvml=mock:dgx-h100")
    assert mock.mock_gpus and mock.driver_root == tmp_path / "plugin" / "mock-driver-root"
    real = settings(tmp_path, "--nvml=real")
    assert not real.mock_gpus and real.driver_root == Path("/")
    assert settings(tmp_path, "--nvml=mock:l4x4", "--driver-root=/srv/mock").driver_root == Path("/srv/mock")
    assert mock.mps_shm_bytes == DEFAULT_SHM_BYTES
    assert settings(tmp_path, "--mps-shm-size=256Mi").mps_shm_bytes == 256 * 2**20
    with pytest.raises(SettingsError, match="--mps-shm-size 'lots' is not a size"):
        settings(tmp_path, "--mps-shm-size=lots")


def test_a_mock_plugin_lays_out_the_files_its_specs_mount(tmp_path: Path):
    process = PluginProcess(settings(tmp_path, "--nvml=mock:dgx-h100"), api=InMemoryKubeApi())
    try:
        root = tmp_path / "plugin" / "mock-driver-root"
        fakebin = resources.files("driver.nvml").joinpath("fakebin")
        for tool in ("nvidia-smi", "nvidia-cuda-mps-control"):
            assert (root / "usr/bin" / tool).read_bytes() == fakebin.joinpath(tool).read_bytes()
            assert os.access(root / "usr/bin" / tool, os.X_OK)
        for library in ("libnvidia-ml.so", "libcuda.so"):
            assert "placeholder" in (root / LIBRARY_DIR / f"{library}.{DRIVER_VERSION}").read_text()
        spec = process.cdi.spec("u", [])
        mounted = {m["containerPath"]: Path(m["hostPath"]) for m in spec["containerEdits"]["mounts"]}
        assert set(mounted) == {
            f"/{LIBRARY_DIR}/libnvidia-ml.so.{DRIVER_VERSION}",
            f"/{LIBRARY_DIR}/libcuda.so.{DRIVER_VERSION}",
            "/usr/bin/nvidia-smi",  # not nvidia-cuda-mps-control: a daemon's commands are the plugin's alone
        }
        assert all(path.is_file() and root in path.parents for path in mounted.values())
        assert {n.get("hostPath") for n in spec["containerEdits"]["deviceNodes"]} == {"/dev/null"}
    finally:
        process.stop()


def test_the_tools_run_from_the_driver_root_with_their_state_under_the_state_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    impostor = tmp_path / "bin" / "nvidia-smi"  # on PATH, but not the driver root's: never run
    impostor.parent.mkdir()
    impostor.write_text("#!/bin/sh\nexit 99\n")
    impostor.chmod(0o755)
    monkeypatch.setenv("PATH", f"{impostor.parent}:{os.environ['PATH']}")
    api = InMemoryKubeApi()
    process = PluginProcess(settings(tmp_path, "--nvml=mock:dgx-h100"), api=api)
    try:
        api.claims[("default", "ts")] = allocated_claim("default", "ts", "uid-ts", [result("gpu-4-ts")])
        assert process.preparer.prepare([ClaimRef("default", "ts", "uid-ts")])["uid-ts"].error == ""
    finally:
        process.stop()
    state = tmp_path / "plugin" / "mock-tools"
    assert json.loads((state / "nvidia-smi.json").read_text())[process.gpus[4].uuid] == {"timeslice": 0}
    logged = [json.loads(line) for line in (state / "tools.log").read_text().splitlines()]
    assert logged == [
        {"tool": "nvidia-smi", "argv": ["compute-policy", "-i", process.gpus[4].uuid, "--set-timeslice", "0"]}
    ]


def test_laying_out_refuses_a_directory_it_did_not_make_and_refreshes_its_own(tmp_path: Path):
    real = tmp_path / "real"
    (real / "usr/bin").mkdir(parents=True)
    (real / "usr/bin/nvidia-smi").write_text("the real one")
    with pytest.raises(MockDriverRootError, match="is not empty and not a mock driver root"):
        mock_driver_root.lay_out(real, DRIVER_VERSION)
    assert (real / "usr/bin/nvidia-smi").read_text() == "the real one"
    mock = tmp_path / "mock"
    mock_driver_root.lay_out(mock, DRIVER_VERSION)
    (mock / "usr/bin/nvidia-smi").write_text("stale")
    mock_driver_root.lay_out(mock, DRIVER_VERSION)
    assert (mock / "usr/bin/nvidia-smi").read_bytes() == (
        resources.files("driver.nvml").joinpath("fakebin", "nvidia-smi").read_bytes()
    )
