"""`fgpu kubelet-plugin` on mock GPUs as a real process: its MPS daemon is a host service that
outlives a SIGKILL of the plugin, the next plugin adopts it, and the last share's unprepare stops it
and unmounts its tmpfs; the CDI specs point only at host files that exist (mock driver root,
/dev/null for device nodes), as a real container runtime needs."""

from __future__ import annotations

import json
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.nvml.session import MOCK_STATE_ENV
from partitioner import tmpfs
from testbed.claims_api import create_allocated_claim
from testbed.node_env import process_alive, stop_fake_daemons
from testbed.plugin_process import PluginUnderTest

pytestmark = [pytest.mark.cluster, pytest.mark.root]

SHARE = [{"request": "mps", "device": "gpu-2-mps", "consumedCapacity": {"memory": "8Gi", "compute": "20"}}]


@pytest.fixture
def plugin(cluster) -> Iterator[PluginUnderTest]:
    plugin = PluginUnderTest(node="node-a", kubeconfig=str(cluster.kubeconfig))
    plugin.extra_env = {MOCK_STATE_ENV: str(plugin.root / "gpus.json")}
    try:
        yield plugin
    finally:
        plugin.stop()
        stop_fake_daemons(plugin.root)
        shutil.rmtree(plugin.root, ignore_errors=True)


def spec(plugin: PluginUnderTest, claim: dict[str, str]) -> dict:
    return json.loads((plugin.cdi_dir / f"k8s.gpu.fgpu.dev-claim_{claim['uid']}.json").read_text())


def test_the_daemon_outlives_a_killed_plugin_and_the_last_unprepare_stops_it(plugin, resource_api):
    first, second = (create_allocated_claim(resource_api, SHARE) for _ in range(2))
    plugin.start()
    assert plugin.prepare([first])[first["uid"]].error == ""
    edits = spec(plugin, first)["devices"][0]["containerEdits"]
    pipe, shm = (Path(m["hostPath"]) for m in edits["mounts"])
    assert [m["containerPath"] for m in edits["mounts"]] == ["/tmp/nvidia-mps", "/dev/shm"]
    uuid = shm.parent.name
    assert pipe == plugin.plugin_dir / "mps" / uuid / "pipe" and tmpfs.is_mounted(shm)
    assert json.loads((shm / f"cuda.shm.fgpu-mps-{uuid}").read_text())["pipe"] == str(pipe)
    pid = int((pipe / "nvidia-cuda-mps-control.pid").read_text())

    assert plugin.stop(signal.SIGKILL) == -signal.SIGKILL
    assert process_alive(pid) and tmpfs.is_mounted(shm)  # clients keep their MPS server through a plugin restart

    plugin.start()  # start-up recovery adopts the running daemon
    assert plugin.prepare([second])[second["uid"]].error == ""
    assert int((pipe / "nvidia-cuda-mps-control.pid").read_text()) == pid
    tools_log = plugin.plugin_dir / "mock-tools" / "tools.log"  # the fakes' default, under the state dir
    started = [e for e in map(json.loads, tools_log.read_text().splitlines()) if e["argv"] == ["-f"]]
    assert len(started) == 1

    assert plugin.unprepare([first]) == {first["uid"]: ""}
    assert process_alive(pid)  # the second share still uses it
    assert plugin.unprepare([second]) == {second["uid"]: ""}
    assert not process_alive(pid)
    assert not tmpfs.is_mounted(shm) and not shm.parent.exists()


def test_mock_specs_name_only_host_files_that_exist(plugin, resource_api):
    claim = create_allocated_claim(resource_api, [{"request": "gpu", "device": "gpu-1-mig-1g10gb-0"}, *SHARE])
    plugin.start()
    assert plugin.prepare([claim])[claim["uid"]].error == ""
    document = spec(plugin, claim)
    edits = [document["containerEdits"], *(d["containerEdits"] for d in document["devices"])]
    nodes = [n for e in edits for n in e.get("deviceNodes", [])]
    assert {n["hostPath"] for n in nodes} == {"/dev/null"}
    assert any(n["path"].startswith("/dev/nvidia-caps/") for n in nodes)  # the container still sees the real paths
    mounts = [Path(m["hostPath"]) for e in edits for m in e.get("mounts", [])]
    assert all(path.exists() for path in mounts), mounts
    driver_root = plugin.plugin_dir / "mock-driver-root"
    tools = {p.name for p in mounts if driver_root in p.parents}
    assert "nvidia-smi" in tools and "nvidia-cuda-mps-control" not in tools  # a daemon's commands are the plugin's
    assert plugin.unprepare([claim]) == {claim["uid"]: ""}
