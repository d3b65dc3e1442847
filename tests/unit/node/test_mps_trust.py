"""What an MPS client container gets, and what the plugin believes (issue 38, findings 1 and 2): no
control tool and a read-only pipe directory in the container; the daemon known by what the plugin
started, never by the files in the pipe directory, which containers see."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

from driver.node.cdi import CdiDevice
from testbed.node_env import NodeEnv


def test_an_mps_share_gets_no_control_tool_and_a_read_only_pipe_directory(node: tuple[object, NodeEnv]):
    _, env = node
    uuid = env.gpus[0].uuid
    spec = env.cdi.spec("uid-a", [CdiDevice("gpu-0-mps", ("/dev/nvidia0",), mounts=env.mps.mounts(uuid))])
    common = [m["containerPath"] for m in spec["containerEdits"]["mounts"]]
    assert "/usr/bin/nvidia-smi" in common and not [p for p in common if "mps" in p]
    mounts = {m["containerPath"]: m for m in spec["devices"][0]["containerEdits"]["mounts"]}
    assert mounts["/tmp/nvidia-mps"]["hostPath"] == str(env.mps.pipe_dir(uuid))
    assert mounts["/tmp/nvidia-mps"]["options"][0] == "ro"  # no socket replaced, no file planted
    assert mounts["/dev/shm"]["options"][0] == "rw"
    assert {"nosuid", "nodev"} <= set(mounts["/dev/shm"]["options"])


def test_a_fifo_or_garbage_for_the_daemons_pid_file_blocks_and_misleads_nothing(node: tuple[object, NodeEnv]):
    """A tenant's FIFO where the daemon keeps its pid file blocked every read of it (start-up
    recovery included: a node-wide crash loop); the plugin reads nothing there any more."""
    _, env = node
    uuid = env.gpus[1].uuid
    pipe = env.mps.pipe_dir(uuid)
    pipe.mkdir(parents=True)
    os.mkfifo(pipe / "nvidia-cuda-mps-control.pid")
    answers: list[bool] = []
    asking = threading.Thread(target=lambda: answers.append(env.mps.running(uuid)), daemon=True)
    asking.start()
    asking.join(timeout=5)
    blocked = asking.is_alive()
    if blocked:  # unblock the reader, so that the test process can end
        with open(pipe / "nvidia-cuda-mps-control.pid", "w"):
            pass
    assert not blocked and answers == [False]
    (pipe / "nvidia-cuda-mps-control.pid").unlink()
    bystander = subprocess.Popen(["sleep", "60"])  # a live process, not a daemon
    try:
        (pipe / "nvidia-cuda-mps-control.pid").write_text(str(bystander.pid))
        assert not env.mps.running(uuid) and env.mps.daemon_pid(uuid) is None
    finally:
        bystander.kill()
        bystander.wait()


def test_the_daemons_record_is_checked_against_the_process_it_names(node: tuple[object, NodeEnv], tmp_path: Path):
    """A record whose pid now belongs to another process (a reboot, pid reuse) is no daemon."""
    _, env = node
    uuid = env.gpus[2].uuid
    record = env.mps.pipe_dir(uuid).parent / "daemon"
    record.parent.mkdir(parents=True)
    record.write_text(f"{os.getpid()} 1")  # this process, but not its start time
    assert env.mps.daemon_pid(uuid) is None
    record.write_text("garbage")
    assert env.mps.daemon_pid(uuid) is None
