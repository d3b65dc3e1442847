"""The MPS control daemon as a host service: detached from whoever started it, with the GPU's tmpfs as
its /dev/shm, adopted by a later plugin instance, stopped and unmounted with the last share, and
swept at start-up when no share is left. Real processes, mounts and namespaces (tests run as root)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from driver.claims.refs import ClaimRef
from driver.node.recovery import recover
from partitioner import tmpfs
from partitioner.mps import DEFAULT_SHM_BYTES, PIPE_BYTES, MpsPartitioner
from partitioner.runner import ToolError, ToolRunner
from testbed.fakes import InMemoryKubeApi, allocated_claim, result
from testbed.node_env import NodeEnv, process_alive

pytestmark = pytest.mark.root  # real tmpfs mounts and cgroups

# Starts GPU 0's daemon the way the plugin does, then waits to be killed.
STARTER = """
import sys, time
from collections.abc import Iterator
from pathlib import Path
from driver.nvml.session import NvmlSession
from partitioner.mps import MpsPartitioner
from partitioner.runner import ToolRunner
driver_root, state_dir, uuid = sys.argv[1:]
MpsPartitioner(NvmlSession.open("mock:dgx-h100"), ToolRunner(Path(driver_root)), Path(state_dir)).start(0, uuid)
print("started", flush=True)
time.sleep(600)
"""


def marker(env: NodeEnv, uuid: str) -> Path:
    """The file the (fake) MPS daemon creates in the /dev/shm it sees."""
    return env.mps.shm_dir(uuid) / f"cuda.shm.fgpu-mps-{uuid}"


def tools_log(env: NodeEnv) -> list[dict]:
    return [json.loads(line) for line in (env.root / "fake-tools.log").read_text().splitlines()]


def test_the_daemon_runs_detached_with_the_gpu_tmpfs_as_its_dev_shm(node):
    _, env = node
    uuid = env.gpus[0].uuid
    assert env.mps.start(0, uuid) is True
    pid = env.mps.daemon_pid(uuid)
    assert pid is not None
    assert os.getsid(pid) != os.getsid(0)  # its own session: the plugin's process group is not its
    assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")  # a private mount namespace
    shm = env.mps.shm_dir(uuid)
    assert tmpfs.is_mounted(shm)
    stats = os.statvfs(shm)
    assert stats.f_blocks * stats.f_frsize == DEFAULT_SHM_BYTES
    assert json.loads(marker(env, uuid).read_text())["pid"] == pid  # written to its /dev/shm, seen in the tmpfs
    assert not Path(f"/dev/shm/cuda.shm.fgpu-mps-{uuid}").exists()  # and not in the host's /dev/shm
    assert env.session.compute_mode(0) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS


def test_the_daemon_outlives_a_killed_starter_and_a_new_instance_adopts_it(node):
    _, env = node
    uuid = env.gpus[0].uuid
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(env.root / "driver-root"), str(env.root / "state"), uuid],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert starter.stdout is not None and starter.stdout.readline() == "started\n"
    finally:
        starter.kill()
        starter.wait()
    pid = env.mps.daemon_pid(uuid)
    assert pid is not None and process_alive(pid)  # SIGKILL of the process that started it left it running
    assert env.mps.start(0, uuid) is False  # adopted, not started again
    assert env.mps.daemon_pid(uuid) == pid
    assert [e["argv"] for e in tools_log(env) if e["tool"] == "nvidia-cuda-mps-control"] == [["-f"]]


def test_stop_quits_the_daemon_unmounts_its_tmpfs_and_removes_its_directories(node):
    _, env = node
    uuid = env.gpus[1].uuid
    env.mps.start(1, uuid)
    pid = env.mps.daemon_pid(uuid)
    assert pid is not None and process_alive(pid)
    assert env.mps.stop(1, uuid) is True
    assert not process_alive(pid)
    assert not tmpfs.is_mounted(env.mps.shm_dir(uuid))
    assert not env.mps.pipe_dir(uuid).parent.exists()
    assert env.session.compute_mode(1) == pynvml.NVML_COMPUTEMODE_DEFAULT
    assert env.mps.stop(1, uuid) is False  # repeating it (recovery after a crash) is harmless


def test_a_refused_mount_is_one_clear_line_and_starts_nothing(node, tmp_path: Path):
    if shutil.which("setpriv") is None:
        pytest.skip("needs util-linux setpriv")
    _, env = node
    uuid = env.gpus[2].uuid
    no_sys_admin = tmp_path / "mount-without-cap-sys-admin"
    no_sys_admin.write_text(f'#!/bin/sh\nexec setpriv --bounding-set -sys_admin {shutil.which("mount")} "$@"\n')
    no_sys_admin.chmod(0o755)

    class Unprivileged(ToolRunner):
        def locate(self, tool: str) -> str:
            return str(no_sys_admin) if tool == "mount" else super().locate(tool)

    mps = MpsPartitioner(env.session, Unprivileged(tmp_path / "driver-root"), tmp_path / "state")
    with pytest.raises(ToolError) as refused:
        mps.start(2, uuid)
    message = str(refused.value)
    assert "\n" not in message
    assert f"cannot mount a tmpfs at {mps.pipe_dir(uuid)} (mount: " in message  # the first of its two
    assert "permission denied" in message and "CAP_SYS_ADMIN" in message
    assert not tmpfs.is_mounted(mps.pipe_dir(uuid)) and not tmpfs.is_mounted(mps.shm_dir(uuid))
    assert not mps.running(uuid)


def test_start_up_sweep_stops_daemons_and_unmounts_tmpfs_no_share_uses(node):
    api, env = node
    kept, orphan, bare = env.gpus[3].uuid, env.gpus[4].uuid, env.gpus[5].uuid
    api.claims[("default", "kept")] = allocated_claim(
        "default", "kept", "uid-kept", [{**result("gpu-3-mps"), "consumedCapacity": {"memory": "1Gi"}}]
    )
    assert env.preparer.prepare([ClaimRef("default", "kept", "uid-kept")])["uid-kept"].error == ""
    env.mps.start(4, orphan)  # a daemon and tmpfs whose share's record is gone
    env.mps.shm_dir(bare).mkdir(parents=True)
    tmpfs.mount_tmpfs(ToolRunner(), env.mps.shm_dir(bare), 2**20, "leftover")  # a tmpfs left without a daemon
    kept_pid = env.mps.daemon_pid(kept)
    recover(env.restart(InMemoryKubeApi()).preparer)
    assert env.mps.daemon_pid(kept) == kept_pid and tmpfs.is_mounted(env.mps.shm_dir(kept))
    for uuid in (orphan, bare):
        assert not env.mps.running(uuid)
        assert not tmpfs.is_mounted(env.mps.shm_dir(uuid))
        assert not env.mps.shm_dir(uuid).parent.exists()


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def cgroups_of(pid: int) -> dict[str, str]:
    """hierarchy (its controllers) -> path, as /proc/<pid>/cgroup says."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    return {controllers: path for _, controllers, path in (line.split(":", 2) for line in lines)}


@pytest.fixture
def in_a_child_pids_cgroup() -> Iterator[Path]:
    """This test process moved into a child cgroup of the pids hierarchy (as the plugin sits in
    its container's), and back afterwards."""
    parent = Path("/sys/fs/cgroup/pids") / cgroups_of(os.getpid())["pids"].lstrip("/")
    child = parent / f"fgpu-test-{os.getpid()}"
    child.mkdir()
    (child / "cgroup.procs").write_text(str(os.getpid()))
    try:
        yield child
    finally:
        (parent / "cgroup.procs").write_text(str(os.getpid()))
        child.rmdir()


@pytest.mark.parametrize("join", [True, False])
def test_the_daemon_joins_the_cgroups_of_the_given_process(node, in_a_child_pids_cgroup, join: bool):
    """A plugin in a DaemonSet pod starts daemons in the host init's cgroups (a stopping container's
    processes are killed by cgroup); without that they stay in the plugin's."""
    _, env = node
    outside = subprocess.Popen(["sleep", "60"])
    try:
        (in_a_child_pids_cgroup.parent / "cgroup.procs").write_text(str(outside.pid))
        mps = MpsPartitioner(env.session, ToolRunner(env.root / "driver-root"), env.root / "state",
                             daemon_cgroups_of=outside.pid if join else None)  # fmt: skip
        uuid = env.gpus[0].uuid
        mps.start(0, uuid)
        daemon = mps.daemon_pid(uuid)
        assert daemon is not None
        if join:
            assert cgroups_of(daemon) == cgroups_of(outside.pid)
        else:
            assert cgroups_of(daemon)["pids"].endswith(in_a_child_pids_cgroup.name)
        mps.stop(0, uuid)
    finally:
        outside.kill()
        outside.wait()


def test_the_pipe_directory_is_a_small_tmpfs_and_goes_with_the_daemon(node):
    """Finding 3: the pipe directory was on the host's disk, outside any pod's ephemeral-storage
    accounting; now a tmpfs of PIPE_BYTES, unmounted with the last share."""
    _, env = node
    uuid = env.gpus[2].uuid
    env.mps.start(2, uuid)
    pipe = env.mps.pipe_dir(uuid)
    assert tmpfs.is_mounted(pipe)
    stats = os.statvfs(pipe)
    assert stats.f_blocks * stats.f_frsize == PIPE_BYTES
    assert stat.S_ISSOCK((pipe / "control").lstat().st_mode)  # the daemon listens there, as the real one does
    env.mps.stop(2, uuid)
    assert not tmpfs.is_mounted(pipe) and not pipe.parent.exists()


def test_the_daemon_is_known_by_what_the_plugin_started_not_by_its_pid_file(node):
    """Finding 2: a tenant's FIFO (or garbage) for the daemon's pid file blocked the plugin's read,
    start-up recovery included, or orphaned the daemon. The plugin now knows the daemon it spawned
    (its child, recorded beside the pipe directory), also after a restart."""
    api, env = node
    api.claims[("default", "kept")] = allocated_claim(
        "default", "kept", "uid-kept", [{**result("gpu-3-mps"), "consumedCapacity": {"memory": "1Gi"}}]
    )
    assert env.preparer.prepare([ClaimRef("default", "kept", "uid-kept")])["uid-kept"].error == ""
    uuid = env.gpus[3].uuid
    pid = env.mps.daemon_pid(uuid)
    assert pid is not None and parent_of(pid) == os.getpid()  # the preparer's own child
    pid_file = env.mps.pipe_dir(uuid) / "nvidia-cuda-mps-control.pid"
    pid_file.unlink()
    os.mkfifo(pid_file)  # what a tenant with a writable pipe directory could do
    restarted = env.restart(api)
    recover(restarted.preparer)  # returns: nothing read the FIFO
    assert restarted.mps.daemon_pid(uuid) == pid
    pid_file.unlink()
    pid_file.write_text("garbage")
    assert restarted.preparer.unprepare([ClaimRef("default", "kept", "uid-kept")]) == {"uid-kept": ""}
    assert not process_alive(pid)  # stopped, not orphaned
    assert not env.mps.pipe_dir(uuid).parent.exists()


def test_a_daemon_started_but_not_recorded_is_adopted_not_started_twice(node):
    """A plugin killed between the daemon's start and its record (or an older version's daemon,
    which has no record) leaves a daemon only its environment names: found and recorded."""
    _, env = node
    uuid = env.gpus[4].uuid
    env.mps.start(4, uuid)
    pid = env.mps.daemon_pid(uuid)
    (env.mps.pipe_dir(uuid).parent / "daemon").unlink()
    restarted = env.restart(InMemoryKubeApi())
    assert restarted.mps.start(4, uuid) is False and restarted.mps.daemon_pid(uuid) == pid
    assert (env.mps.pipe_dir(uuid).parent / "daemon").exists()
    assert restarted.mps.stop(4, uuid) is True and not process_alive(pid)
