"""Two plugin instances on one node (a DaemonSet rolling update): socket names per pod UID as
upstream's helper names them, sockets told apart by the file we bound, claim operations
serialised across processes, and a checkpoint cache that sees another process's write."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.claims.refs import ClaimRef
from driver.cli.main import build_parser
from driver.common.flags import SettingsError
from driver.node.checkpoint import Checkpoint
from driver.node.claim_locks import NodeClaimLock
from driver.node.instance_lock import InstanceLock
from driver.node.server import PluginProcess
from driver.node.settings import PluginSettings, plugin_settings
from driver.node.sockets import (
    BoundSocket,
    rolling_update_dra_socket_file,
    rolling_update_registrar_socket_file,
)
from testbed.fakes import InMemoryKubeApi, allocated_claim, node_object, result

UID = "0b7c4c1e-9a52-4c8e-8f54-6a3f1d2e5b77"
LONG_DRIVER = "gpu." + "x" * 55 + ".dev"  # 63 characters, the longest driver name
# Expected names computed apart from the code under test, with openssl:
#   printf '%s' "$UID" | openssl dgst -sha256 -binary | head -c 8 | base64 | tr '+/' '-_' | tr -d '='
#   printf '%s\0%s' "$DRIVER" "$UID" | openssl dgst -sha256 -binary | head -c 16 | base64 | tr '+/' '-_' | tr -d '='
UID_HASH = "n_NhxlDjuIM"
LONG_DRIVER_UID_HASH = "pVky7H70Rd-PvBKurZJVzQ"


def directory(length: int) -> Path:
    return Path("/" + "d" * (length - 1))


@pytest.mark.parametrize(
    ("driver", "dir_length", "expected"),
    [
        ("gpu.fgpu.dev", 20, f"gpu.fgpu.dev-{UID}-reg.sock"),
        ("gpu.fgpu.dev", 46, f"gpu.fgpu.dev-{UID}-reg.sock"),  # 46 + 1 + 58 = 105: fits exactly
        ("gpu.fgpu.dev", 47, f"gpu.fgpu.dev-{UID_HASH}-reg.sock"),
        (LONG_DRIVER, 20, f"{LONG_DRIVER}-{UID_HASH}-reg.sock"),
        (LONG_DRIVER, 30, f"dra-{LONG_DRIVER_UID_HASH}-reg.sock"),
        (LONG_DRIVER, 90, f"dra-{LONG_DRIVER_UID_HASH}-reg.sock"),  # nothing fits: upstream's last resort
    ],
)
def test_registration_socket_names_follow_upstream(driver: str, dir_length: int, expected: str):
    assert rolling_update_registrar_socket_file(directory(dir_length), driver, UID) == expected


def settings(tmp_path: Path, *flags: str) -> PluginSettings:
    paths = [f"--{name}-dir={tmp_path / name}" for name in ("plugin", "cdi", "registrar")]  # a later flag wins
    argv = ["kubelet-plugin", "--node-name=node-a", "--nvml=mock:dgx-h100", *paths, *flags]
    return plugin_settings(build_parser().parse_args(argv))


def listen(path: Path) -> socket.socket:
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(1)
    return server


def test_a_bound_socket_knows_its_file(tmp_path: Path):
    path = tmp_path / "dra.sock"
    with listen(path):
        ours = BoundSocket.at(path)
        assert ours.problem() == ""
        path.unlink()
        assert ours.problem() == f"socket {path} was deleted"
        with listen(path):  # another instance took the path
            assert ours.problem() == f"socket {path} was replaced by another file"
            ours.remove()
            assert path.exists()  # theirs stays
            BoundSocket.at(path).remove()
            assert not path.exists()


DIES_HOLDING_SOCKETS = """
import os, socket, sys
from pathlib import Path
from driver.node.instance_lock import InstanceLock
from driver.node.sockets import BoundSocket
instance = InstanceLock(Path(sys.argv[1]))
bound = []
for path in sys.argv[2:]:
    socket.socket(socket.AF_UNIX).bind(path)
    bound.append(BoundSocket.at(Path(path)))
instance.record_sockets(bound)
os._exit(0)  # killed: no release, the socket files stay
"""


def test_a_dead_instances_sockets_are_removed_unless_the_path_was_bound_again(tmp_path: Path):
    state, stale, rebound = tmp_path / "state", tmp_path / "old-reg.sock", tmp_path / "dra-old.sock"
    subprocess.run([sys.executable, "-c", DIES_HOLDING_SOCKETS, state, stale, rebound], check=True)
    assert stale.exists() and rebound.exists()
    rebound.unlink()
    with listen(rebound):  # the same pod's next container took this path
        survivor = InstanceLock(state)
        survivor.record_sockets([BoundSocket.at(rebound)])
        assert survivor.remove_dead_instances_sockets() == [stale]
        assert not stale.exists() and rebound.exists()
        assert [p.name for p in (state / "instances").iterdir() if p.suffix == ".sockets"] == [f"{survivor.id}.sockets"]
        assert survivor.remove_dead_instances_sockets() == []  # its own, alive, stay
        assert rebound.exists()
        survivor.release()
    assert sorted(p.name for p in (state / "instances").iterdir()) == []


LOCKER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR)
if sys.argv[2] == "try":
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("busy")
    else:
        print("free")
else:
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    sys.stdin.read()
"""


def another_process_finds(path: Path) -> str:
    return subprocess.run(
        [sys.executable, "-c", LOCKER, str(path), "try"], capture_output=True, text=True
    ).stdout.strip()


@contextlib.contextmanager
def held_by_another_process(path: Path) -> Iterator[None]:
    locker = subprocess.Popen(
        [sys.executable, "-c", LOCKER, str(path), "hold"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert locker.stdout is not None and locker.stdout.readline().strip() == "held"
        yield
    finally:
        locker.communicate("")


def test_the_node_lock_excludes_other_processes_and_is_shared_by_this_ones_threads(tmp_path: Path):
    lock = NodeClaimLock(tmp_path)
    inside, leave = threading.Event(), threading.Event()

    def second_thread() -> None:
        with lock.held():
            inside.set()
            leave.wait()

    with lock.held():
        assert another_process_finds(lock.path) == "busy"
        thread = threading.Thread(target=second_thread)
        thread.start()
        assert inside.wait(10)  # entered while the first thread holds the lock
    assert another_process_finds(lock.path) == "busy"  # the second thread still holds it
    leave.set()
    thread.join()
    assert another_process_finds(lock.path) == "free"


def run_in_thread(action) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(action()))
    thread.start()
    return thread, out


def test_claim_operations_wait_for_the_other_instance_and_empty_calls_do_not(tmp_path: Path):
    api = InMemoryKubeApi()
    api.nodes["node-a"] = node_object("node-a")
    api.claims[("default", "c")] = allocated_claim("default", "c", "uid-c", [result("gpu-0")])
    process = PluginProcess(settings(tmp_path), api=api)
    try:
        with held_by_another_process(tmp_path / "plugin" / "claims.lock"):
            probe, probe_out = run_in_thread(lambda: process.preparer.prepare([]))
            probe.join(10)
            assert probe_out == [{}]  # the liveness self-probe's call: no claim, no wait
            prepare, prepare_out = run_in_thread(lambda: process.preparer.prepare([ClaimRef("default", "c", "uid-c")]))
            prepare.join(0.5)
            assert prepare.is_alive() and not (tmp_path / "plugin" / "checkpoint.json").exists()
        prepare.join(10)
        assert prepare_out[0]["uid-c"].error == ""
    finally:
        process.stop()


def test_the_checkpoint_cache_sees_a_write_that_keeps_inode_size_and_time(tmp_path: Path):
    """Another instance's write can get the old file's inode back within one timestamp tick; a
    stat-keyed cache would then return the old claims."""
    path = tmp_path / "checkpoint.json"
    ours, theirs = Checkpoint(path, boot_id="b"), Checkpoint(path, boot_id="b")
    theirs.apply(lambda data: data.claims.update({"uid-1": {"n": 1}}))
    assert set(ours.read().claims) == {"uid-1"}  # parsed and cached
    before = path.stat()
    keep = tmp_path / "same-inode"
    os.link(path, keep)
    theirs.apply(lambda data: data.claims.update({"uid-2": data.claims.pop("uid-1")}))
    written = path.read_bytes()
    assert len(written) == before.st_size
    keep.write_bytes(written)  # the new content in the old inode, with the old times
    os.utime(keep, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.replace(keep, path)
    assert (path.stat().st_ino, path.stat().st_size, path.stat().st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )
    assert set(ours.read().claims) == {"uid-2"}


@pytest.mark.parametrize(
    ("dir_length", "expected"),
    [(59, f"dra-{UID}.sock"), (60, f"dra-{UID_HASH}.sock")],  # 59 + 1 + 45 = 105: fits exactly
)
def test_dra_socket_names_fall_back_to_a_hash_where_the_uid_does_not_fit(dir_length: int, expected: str):
    assert rolling_update_dra_socket_file(directory(dir_length), UID) == expected


def test_a_socket_path_grpc_cannot_bind_is_a_one_line_settings_error(tmp_path: Path):
    deep = tmp_path / ("d" * 100)
    with pytest.raises(SettingsError, match=r"gRPC allows at most 105: use a shorter --registrar-dir or --plugin-dir$"):
        settings(tmp_path, f"--plugin-dir={deep}")
