"""A DaemonSet rolling update with maxSurge 1: two `fgpu kubelet-plugin` processes on one node,
each with its pod UID, sharing the registrar dir, the plugin dir and the state in it. Kubelet may
call either: they must both register, hand claims over, share a GPU, leave each other's sockets
alone and agree on the ResourceSlices."""

from __future__ import annotations

import json
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from driver.nvml.session import MOCK_STATE_ENV
from testbed.claims_api import create_allocated_claim
from testbed.cluster.host_state import short_temp_dir
from testbed.node_env import process_alive, stop_fake_daemons
from testbed.plugin_process import DRIVER, PluginUnderTest
from testbed.workloads import wait_for
from tests.support.pools import complete_pool

pytestmark = pytest.mark.cluster

SHARE = [{"request": "mps", "device": "gpu-2-mps", "consumedCapacity": {"memory": "8Gi", "compute": "10"}}]
WHOLE = [{"request": "gpu", "device": "gpu-1"}]


@pytest.fixture
def pair(cluster) -> Iterator[tuple[PluginUnderTest, PluginUnderTest]]:
    """Old and new pod; the old gets its UID by flag, the new one from POD_UID (the downward API)."""
    root = short_temp_dir("rolling")
    shared_gpus = {MOCK_STATE_ENV: str(root / "gpus.json")}  # one node: both see the same mock GPUs
    old_uid, new_uid = str(uuid.uuid4()), str(uuid.uuid4())
    old = PluginUnderTest(
        node="node-a", kubeconfig=str(cluster.kubeconfig), root=root, uid=old_uid, extra_env=shared_gpus,
        extra_args=[f"--rolling-update-uid={old_uid}"],
    )  # fmt: skip
    new = PluginUnderTest(
        node="node-a", kubeconfig=str(cluster.kubeconfig), root=root, uid=new_uid,
        extra_env={**shared_gpus, "POD_UID": new_uid},
    )  # fmt: skip
    try:
        yield old.start(), new.start()
    finally:
        for instance in (old, new):
            instance.stop()
        stop_fake_daemons(root)
        shutil.rmtree(root, ignore_errors=True)


def checkpoint(instance: PluginUnderTest) -> dict:
    return json.loads((instance.plugin_dir / "checkpoint.json").read_text())


def spec_path(instance: PluginUnderTest, claim: dict[str, str]) -> Path:
    return instance.cdi_dir / f"k8s.gpu.fgpu.dev-claim_{claim['uid']}.json"


def daemon_pid_file(instance: PluginUnderTest) -> Path:
    return next((instance.plugin_dir / "mps").glob("*/pipe/nvidia-cuda-mps-control.pid"))


def daemon_starts(instance: PluginUnderTest) -> int:
    tools_log = instance.plugin_dir / "mock-tools" / "tools.log"
    return sum(1 for e in map(json.loads, tools_log.read_text().splitlines()) if e["argv"] == ["-f"])


def test_both_register_with_their_own_sockets(pair):
    old, new = pair
    old_info, new_info = old.register(), new.register()
    assert old_info.endpoint == str(old.dra_socket) and new_info.endpoint == str(new.dra_socket)
    assert old.registration_socket.name == f"{DRIVER}-{old.uid}-reg.sock"
    assert sorted(p.name for p in old.registrar_dir.iterdir()) == sorted(
        [old.registration_socket.name, new.registration_socket.name]
    )
    assert not (old.plugin_dir / "dra.sock").exists()  # the name without a UID is not used
    assert old.health() == new.health() == health_pb2.HealthCheckResponse.SERVING


def test_a_claim_prepared_through_one_is_unprepared_through_the_other(pair, resource_api):
    old, new = pair
    whole, share = create_allocated_claim(resource_api, WHOLE), create_allocated_claim(resource_api, SHARE)
    results = old.prepare([whole, share])
    assert [results[c["uid"]].error for c in (whole, share)] == ["", ""]
    pid = int(daemon_pid_file(old).read_text())

    assert new.prepare([share])[share["uid"]] == results[share["uid"]]  # the other's claim, answered the same
    assert new.unprepare([whole, share]) == {whole["uid"]: "", share["uid"]: ""}
    assert not spec_path(new, whole).exists() and not spec_path(new, share).exists()
    assert not process_alive(pid)  # the daemon the old instance started, stopped by the new one
    assert checkpoint(new)["claims"] == {}
    assert old.unprepare([whole, share]) == {whole["uid"]: "", share["uid"]: ""}  # nothing left to do


def test_concurrent_prepares_through_both_share_one_gpu(pair, resource_api):
    old, new = pair
    claims = [create_allocated_claim(resource_api, SHARE) for _ in range(6)]
    via = [old, new] * 3
    with ThreadPoolExecutor(len(claims)) as pool:
        results = list(pool.map(lambda job: job[0].prepare([job[1]])[job[1]["uid"]], zip(via, claims, strict=True)))
    assert [r.error for r in results] == [""] * len(claims)
    recorded = checkpoint(old)["claims"]
    assert set(recorded) == {c["uid"] for c in claims}
    assert {r["state"] for r in recorded.values()} == {"PrepareCompleted"}
    assert all(spec_path(old, c).exists() for c in claims)
    assert daemon_starts(old) == 1  # one daemon for the GPU, whichever instance came first
    pid = int(daemon_pid_file(old).read_text())

    with ThreadPoolExecutor(len(claims)) as pool:
        errors = list(pool.map(lambda job: job[0].unprepare([job[1]]), zip(reversed(via), claims, strict=True)))
    assert errors == [{c["uid"]: ""} for c in claims]
    assert checkpoint(old)["claims"] == {}
    assert not process_alive(pid)  # the last share's unprepare, in either instance, stopped it


def test_sigterm_of_one_leaves_the_other_serving(pair, resource_api):
    old, new = pair
    old.register()
    new.register()
    claim = create_allocated_claim(resource_api, WHOLE)
    assert old.prepare([claim])[claim["uid"]].error == ""

    assert old.stop(signal.SIGTERM) == 0
    assert not old.registration_socket.exists() and not old.dra_socket.exists()
    assert new.registration_socket.exists() and new.dra_socket.exists()
    assert new.health() == health_pb2.HealthCheckResponse.SERVING
    assert new.unprepare([claim]) == {claim["uid"]: ""}
    assert new.prepare([claim])[claim["uid"]].error == ""
    assert "stopped; sockets removed" in old.logs()


def test_sigterm_withdraws_the_registration_and_serves_a_while(pair, resource_api):
    old, _ = pair
    claim = create_allocated_claim(resource_api, WHOLE)
    assert old.process is not None
    old.process.send_signal(signal.SIGTERM)
    wait_for(lambda: not old.registration_socket.exists())
    assert old.dra_socket.exists()
    assert old.prepare([claim])[claim["uid"]].error == ""  # a call kubelet sent before it noticed
    assert old.stop() == 0
    assert not old.dra_socket.exists()
    assert (
        "registration withdrawn: its socket removed" in old.logs() and "serving DRA calls for 3.0s more" in old.logs()
    )


def test_a_killed_instances_sockets_are_removed_by_the_next(pair, cluster):
    old, new = pair
    assert old.stop(signal.SIGKILL) == -signal.SIGKILL
    assert old.registration_socket.exists() and old.dra_socket.exists()  # kubelet would keep it registered

    newest_uid = str(uuid.uuid4())
    newest = PluginUnderTest(
        node="node-a", kubeconfig=str(cluster.kubeconfig), root=old.root, uid=newest_uid,
        extra_env={**old.extra_env, "POD_UID": newest_uid},
    )  # fmt: skip
    try:
        newest.start()
        assert not old.registration_socket.exists() and not old.dra_socket.exists()
        assert f"removed socket {old.registration_socket} of stopped instance" in newest.logs()
        assert new.health() == newest.health() == health_pb2.HealthCheckResponse.SERVING
    finally:
        newest.stop()


def test_a_restarted_container_keeps_the_sockets_it_bound_again(pair):
    old, _ = pair
    old.stop(signal.SIGKILL)
    old.start()  # the same pod UID: the same socket paths, bound again
    assert old.register().endpoint == str(old.dra_socket)
    assert old.health() == health_pb2.HealthCheckResponse.SERVING


def test_the_pool_generation_settles_while_both_publish(pair, resource_api):
    slices = wait_for(lambda: complete_pool(resource_api, "node-a"))
    resource_api.delete_resource_slice(slices[0].metadata.name)  # as kubelet does at its start
    wait_for(lambda: len(complete_pool(resource_api, "node-a")) == len(slices))
    # Both instances saw the deletion and republished; now neither may write again.
    time.sleep(2)
    settled = {s.metadata.name: s.metadata.resource_version for s in complete_pool(resource_api, "node-a")}
    time.sleep(3)
    later = {s.metadata.name: s.metadata.resource_version for s in complete_pool(resource_api, "node-a")}
    assert later == settled
    assert len(settled) == len(slices)
