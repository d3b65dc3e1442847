import json
import subprocess
import sys
from pathlib import Path

from tests.support.cli import KUBECONFIG


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


def test_a_driver_root_that_is_not_a_mock_one_is_refused_with_mock_gpus(tmp_path: Path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG)
    host_like = tmp_path / "host"
    (host_like / "usr/bin").mkdir(parents=True)
    (host_like / "usr/bin/nvidia-smi").write_text("not ours")
    run = run_plugin(tmp_path, f"--kubeconfig={kubeconfig}", f"--driver-root={host_like}")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (
        f"fgpu: --driver-root {host_like} is not empty and not a mock driver root; with mock NVML, give an empty "
        "directory or leave --driver-root unset"
    )
    assert (host_like / "usr/bin/nvidia-smi").read_text() == "not ours"


def discover(*flags: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "driver.cli", *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_feature_gates_take_away_what_the_cluster_cannot_carry():
    base = ["discover", "--nvml=mock:dgx-h100", "--node-name=n1", "-o", "json"]
    no_counters = json.loads(discover(*base, "--feature-gates=PartitionableDevices=false", "--offer=mps").stdout)
    devices = [d for s in no_counters["items"] for d in s["spec"].get("devices", [])]
    assert [d["name"] for d in devices] == [f"gpu-{i}-mps" for i in range(8)]
    assert not [s for s in no_counters["items"] if "sharedCounters" in s["spec"]]
    assert not [d for d in devices if "consumesCounters" in d]

    no_shares = json.loads(discover(*base, "--feature-gates=ConsumableCapacity=false").stdout)
    names = [d["name"] for s in no_shares["items"] for d in s["spec"].get("devices", [])]
    assert "gpu-0" in names and "gpu-0-mig-1g10gb-0" in names
    assert not [n for n in names if n.endswith(("-mps", "-ts"))]

    for gates, error in [
        ("PartitionableDevices=false", "PartitionableDevices=false: every GPU offers mps, timeslice, whole;"),
        ("Shares=true", "--feature-gates: unknown gate 'Shares'; known: ConsumableCapacity, PartitionableDevices"),
        ("ConsumableCapacity", "--feature-gates: 'ConsumableCapacity' must be ConsumableCapacity=true or"),
    ]:
        run = discover(*base, f"--feature-gates={gates}")
        assert run.returncode == 2 and run.stderr.startswith(f"fgpu: {error}"), run.stderr
        assert len(run.stderr.strip().splitlines()) == 1


def test_mock_fault_and_health_clear_say_what_is_wrong_in_one_line(tmp_path: Path):
    env = {"PATH": "/usr/bin:/bin", "FGPU_NVML_MOCK_STATE": str(tmp_path / "gpus.json")}

    def fgpu(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "driver.cli", *args], capture_output=True, text=True, env=env)

    run = fgpu("mock", "fault", "--nvml=mock:l4x4", "--gpu=9", "ecc")
    assert (run.returncode, run.stderr.strip()) == (2, "fgpu: mock fault on GPU 9: Invalid Argument")
    run = fgpu("mock", "fault", "--gpu=0", "lost")
    assert run.returncode == 2 and "mock fault needs --nvml mock:<machine>" in run.stderr
    run = fgpu("health", "clear")
    assert (
        run.returncode == 2
        and run.stderr.strip() == "fgpu: --state-dir (or STATE_DIR) is required: the plugin's state directory"
    )
    run = fgpu("health", "clear", f"--state-dir={tmp_path}", "--gpu=GPU-x")
    assert (run.returncode, run.stdout.strip()) == (0, "cleared; 0 fault(s) of other GPUs left")
    run = fgpu("mock", "fault", "--nvml=mock:l4x4", "--gpu=0", "reset")
    assert run.returncode == 2 and "mock fault reset needs --state-dir" in run.stderr


def test_mock_fault_reset_clears_what_a_gpu_reset_clears(tmp_path: Path):
    from driver.nvml.machine import load_machine
    from driver.nvml.mock import MockNvml
    from driver.nvml.session import NvmlSession

    state, smi = tmp_path / "gpus.json", tmp_path / "state" / "mock-tools" / "nvidia-smi.json"
    session = NvmlSession(MockNvml(load_machine("dgx-h100"), state))
    for index in (1, 2):
        session.set_mig_mode(index, True)
        session.create_mig_instance(index, 19, 0, 1)
    smi.parent.mkdir(parents=True)
    uuids = [session.nvml.gpu_uuid(i) for i in (1, 2)]
    smi.write_text(json.dumps({uuid: {"timeslice": 3} for uuid in uuids}))
    env = {"PATH": "/usr/bin:/bin", "FGPU_NVML_MOCK_STATE": str(state)}
    argv = [sys.executable, "-m", "driver.cli", "mock", "fault", "--nvml=mock:dgx-h100", "--gpu=1", "reset"]
    run = subprocess.run([*argv, f"--state-dir={tmp_path / 'state'}"], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    assert session.gpu_instances(1) == [] and len(session.gpu_instances(2)) == 1  # that GPU only
    assert session.mig_enabled(1)  # MIG mode persists
    assert json.loads(smi.read_text()) == {uuids[1]: {"timeslice": 3}}


def test_values_from_the_environment_can_be_copied_and_pickled(monkeypatch):
    import copy
    import pickle

    from driver.cli.main import build_parser

    monkeypatch.setenv("NODE_NAME", "node-from-env")
    args = build_parser().parse_args(["kubelet-plugin"])
    # The node name ends up in checkpoint records, which are deep-copied (a prepare failed on it).
    assert copy.deepcopy(args.node_name) == "node-from-env" == pickle.loads(pickle.dumps(args.node_name))
    assert repr(copy.deepcopy(args.node_name)) == "NODE_NAME='node-from-env'"
