"""`make run` as a person uses it: the example pods really run and it says what their containers
see; Ctrl-C leaves the machine as it was (no process, mount, network device, iptables chain,
changed sysctl, cgroup or temporary directory of ours)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from examples import local_node
from testbed.cluster.harness import die_with_parent
from testbed.cluster.host_state import NODE_RECORD, HostState

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]
ROOT = Path(__file__).resolve().parents[2]
SERVING_TIMEOUT_S = 240


def serve_make_run(
    output: Path, stop: Callable[[subprocess.Popen[bytes]], None], **popen: Any
) -> subprocess.Popen[bytes]:
    """`make run` until it serves; `stop` ends it if it never does."""
    with open(output, "wb") as sink:
        run = subprocess.Popen([sys.executable, "-m", "examples.local_node"], cwd=ROOT, stdout=sink,
                               stderr=subprocess.STDOUT, **popen)  # fmt: skip
    try:
        deadline = time.monotonic() + SERVING_TIMEOUT_S
        while "serving; Ctrl-C to stop" not in output.read_text() and run.poll() is None:
            assert time.monotonic() < deadline, output.read_text()[-4000:]
            time.sleep(0.5)
        assert run.poll() is None, output.read_text()[-4000:]
    except BaseException:
        stop(run)
        raise
    return run


def from_a_terminal() -> None:
    """preexec_fn: Ctrl-C reaches it as in a terminal, also where this test run ignores SIGINT (a
    shell's background job does, and Python then installs no KeyboardInterrupt handler); it dies
    with the test run."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    die_with_parent()


def interrupt(run: subprocess.Popen[bytes]) -> None:
    run.send_signal(signal.SIGINT)
    run.wait(timeout=120)


def kill_session(run: subprocess.Popen[bytes]) -> None:
    os.killpg(run.pid, signal.SIGKILL)  # the run and everything in its session, at once
    run.wait(timeout=30)


def test_make_run_then_ctrl_c_leaves_the_host_as_it_was(tmp_path):
    before = HostState.take_quiet()
    output = tmp_path / "run.log"
    run = serve_make_run(output, interrupt, preexec_fn=from_a_terminal)
    interrupt(run)
    assert run.returncode == 0
    printed = output.read_text()
    for pod in ("whole-gpu", "mig-1g", "mps-share", "timeslice-share"):
        assert f"pod {pod}: Running" in printed, printed[-4000:]
    assert "env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25" in printed
    assert "export KUBECONFIG=" in printed
    assert before.differences(HostState.take_quiet()) == []


def test_a_killed_make_run_is_undone_by_the_cleanup_command(tmp_path):
    """SIGKILL leaves what only an orderly stop removes (containers under their shims, MPS daemons,
    mounts, iptables chains, sysctls, cgroups, temp dirs); the node's record lets cleanup undo it."""
    before = HostState.take_quiet()
    kill_session(serve_make_run(tmp_path / "run.log", kill_session, start_new_session=True))
    assert NODE_RECORD.exists()
    assert before.differences(HostState.take_quiet()), "a killed run left nothing behind: the test proves nothing"
    cleanup = subprocess.run([sys.executable, "-m", "testbed.cluster.node", "cleanup"], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert cleanup.returncode == 0 and "cleaned up after the real node in /tmp/fgpu-" in cleanup.stdout, cleanup
    assert before.differences(HostState.take_quiet()) == []
    again = subprocess.run([sys.executable, "-m", "testbed.cluster.node", "cleanup"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert again.stdout.strip() == "no real node was left behind"


def test_make_run_refuses_a_non_root_user(monkeypatch, capsys):
    # Python itself lives under /root here, so a real non-root process could not even start it.
    monkeypatch.setattr(local_node.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(sys, "argv", ["local_node"])
    assert local_node.main() == 1
    assert capsys.readouterr().err.splitlines() == [local_node.NEEDS_ROOT]
