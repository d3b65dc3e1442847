"""MPS shares: one control daemon per GPU (or MIG partition), run as a host service: started with
its first share, stopped with its last; each claim's containers get their own limits. Whose shares
may meet under one daemon is the tenancy rule's (driver/node/tenancy.py): one namespace's, or one
claim's, at a time.

The daemon lives outside the plugin's process lifetime: it runs in the foreground
(`nvidia-cuda-mps-control -f`) as the plugin's own child, in a session of its own, so a plugin
restart, SIGKILL or rolling update leaves it serving its clients. Its identity (pid and start
time) is what the plugin spawned, recorded in `<state-dir>/mps/<uuid>/daemon`, which no container
mounts; a restarted plugin adopts it by that record, checked against /proc. Nothing in the pipe
directory (the daemon's pid file, its sockets) is read to know it: containers see that directory.

Clients reach it through two tmpfs mounts under `<state-dir>/mps/<uuid>/`, which each share's CDI
spec mounts: `pipe` (its control and server sockets, a small tmpfs: bounded, not the host's disk)
read-only at /tmp/nvidia-mps, so that no client can replace a socket or plant files the plugin
or another client trusts (connect(2) to a socket needs no writable mount); and `shm` at /dev/shm,
since the MPS server and its clients exchange data through files in /dev/shm (a container's own
/dev/shm is its pod's). The daemon is started in a private mount namespace where that tmpfs is
bind-mounted on /dev/shm; the MPS servers it forks inherit it. Both are unmounted with the last
share, so the next tenant of the GPU starts on empty ones.

Limits (from the claim's consumedCapacity, lowered by its opaque config): the active thread
percentage (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) and the pinned device memory limit
(CUDA_MPS_PINNED_DEVICE_MEM_LIMIT) are set in the claim's CDI spec. MPS enforces them for clients
that keep them, but they are cooperative: a process that unsets the variables before creating its
CUDA context escapes them. Memory and fault isolation are not what MPS gives; MIG does
(docs/security.md).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pynvml

from driver.common.files import atomic_write
from driver.nvml.session import NvmlSession
from partitioner import tmpfs
from partitioner.runner import ToolError, ToolRunner

log = logging.getLogger(__name__)
MPS_CONTROL = "nvidia-cuda-mps-control"
CONTROL_SOCKET = "control"  # the daemon's, in its pipe directory: there once it serves
IDENTITY_FILE = "daemon"  # the plugin's record of the daemon it started, beside the pipe directory
LAUNCH_LOG = "daemon.out"  # the daemon's stdout and stderr, in its log directory
CONTAINER_PIPE_DIR = "/tmp/nvidia-mps"  # CUDA's default CUDA_MPS_PIPE_DIRECTORY
CONTAINER_SHM_DIR = "/dev/shm"
DEFAULT_SHM_BYTES = 2**30
# The pipe directory holds a few sockets, lock and pid files; bounded so that nothing fills the host.
PIPE_BYTES = 2**22
PIPE_MODE = "0755"  # as the plain directory it was: the daemon (root) writes there, clients only connect
START_TIMEOUT_S = 10.0
QUIT_TIMEOUT_S = 10.0
MiB = 2**20
# Run by util-linux unshare in a new mount namespace, propagation private (nothing leaks back to
# the host): the GPU's tmpfs over /dev/shm, then the daemon in the foreground, in the same process
# (unshare, nsenter without a PID namespace and sh's exec fork nothing): the pid the plugin spawned
# is the daemon's.
LAUNCH_SCRIPT = 'mount --bind "$1" /dev/shm && exec "$2" -f'
# With a pid in $1, first into that process's cgroups, hierarchy by hierarchy (cgroup v1 has one per
# controller, v2 one; each mounted afresh here, as a container sees only its own part of them). A
# container's processes are killed by cgroup when it stops, also with hostPID, so a plugin in a
# DaemonSet pod starts the daemon in the cgroups of the host's PID 1 to let it outlive the pod.
JOIN_CGROUPS_SCRIPT = """
set -e
hierarchy=$(mktemp -d)
while IFS=: read -r _ controllers path; do
  case "$controllers" in
    "") mount -t cgroup2 none "$hierarchy" ;;
    name=*) mount -t cgroup -o "none,$controllers" none "$hierarchy" ;;
    *) mount -t cgroup -o "$controllers" none "$hierarchy" ;;
  esac
  echo $$ > "$hierarchy$path/cgroup.procs"
  umount "$hierarchy"
done < "/proc/$1/cgroup"
rmdir "$hierarchy"
shift
"""


@dataclass(frozen=True)
class DaemonIdentity:
    """A process as the kernel knows it: its pid and its start time (clock ticks after boot), which
    a process that reuses the pid does not have."""

    pid: int
    started: int

    @classmethod
    def of(cls, pid: int) -> DaemonIdentity | None:
        """The process's identity; None when it is gone or a zombie (it runs no more)."""
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        # After the command: state (field 3), ..., starttime (field 22).
        return None if fields[0] == "Z" else cls(pid, int(fields[19]))

    @classmethod
    def parse(cls, text: str) -> DaemonIdentity | None:
        match text.split():
            case [pid, started] if pid.isdigit() and started.isdigit():
                return cls(int(pid), int(started))
        return None

    def __str__(self) -> str:
        return f"{self.pid} {self.started}"

    def alive(self) -> bool:
        """Still this process (not one that reuses its pid), and still the control daemon."""
        return DaemonIdentity.of(self.pid) == self and _is_mps_control(self.pid)


@dataclass(frozen=True)
class MpsLimits:
    memory_bytes: int
    thread_percentage: int

    def env(self) -> tuple[str, ...]:
        return (
            f"CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIR}",
            f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={self.thread_percentage}",
            f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={self.memory_bytes // MiB}M",
        )

    def __str__(self) -> str:
        return f"{self.thread_percentage}% threads, {self.memory_bytes // MiB}Mi pinned memory"


class MpsPartitioner:
    def __init__(
        self,
        session: NvmlSession,
        runner: ToolRunner,
        state_dir: Path,
        shm_bytes: int = DEFAULT_SHM_BYTES,
        daemon_cgroups_of: int | None = None,
        on_shm_mounted: Callable[[], None] = lambda: None,
        on_daemon_stopped: Callable[[], None] = lambda: None,
    ) -> None:
        """`daemon_cgroups_of`: a pid whose cgroups the daemons join (1, the host's init, for a plugin
        in a container); None: they stay in the plugin's. `on_shm_mounted`, `on_daemon_stopped`:
        called at those points of start and stop, between two side effects (where the node plugin's
        crash-safety tests kill it)."""
        self._session = session
        self._runner = runner
        self._root = state_dir / "mps"
        self._shm_bytes = shm_bytes
        self._daemon_cgroups_of = daemon_cgroups_of
        self._on_shm_mounted = on_shm_mounted
        self._on_daemon_stopped = on_daemon_stopped
        # The daemons this process started, by GPU or MIG UUID: reaped when they exit.
        self._children: dict[str, subprocess.Popen[bytes]] = {}

    def pipe_dir(self, gpu_uuid: str) -> Path:
        return self._root / gpu_uuid / "pipe"

    def log_dir(self, gpu_uuid: str) -> Path:
        return self._root / gpu_uuid / "log"

    def shm_dir(self, gpu_uuid: str) -> Path:
        return self._root / gpu_uuid / "shm"

    def _env(self, gpu_uuid: str) -> dict[str, str]:
        return {
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir(gpu_uuid)),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir(gpu_uuid)),
            "CUDA_VISIBLE_DEVICES": gpu_uuid,
        }

    def _identity_file(self, gpu_uuid: str) -> Path:
        return self._root / gpu_uuid / IDENTITY_FILE

    def daemon_pid(self, gpu_uuid: str) -> int | None:
        """The running control daemon's pid; None when none runs."""
        identity = self._daemon(gpu_uuid)
        return identity.pid if identity is not None else None

    def running(self, gpu_uuid: str) -> bool:
        return self._daemon(gpu_uuid) is not None

    def _daemon(self, gpu_uuid: str) -> DaemonIdentity | None:
        """The daemon this plugin started (its record), or one it started but did not record."""
        child = self._children.get(gpu_uuid)
        if child is not None and child.poll() is not None:  # exited (a client's quit): reaped
            del self._children[gpu_uuid]
        try:
            recorded = DaemonIdentity.parse(self._identity_file(gpu_uuid).read_text())
        except FileNotFoundError:
            return self._unrecorded(gpu_uuid)
        return recorded if recorded is not None and recorded.alive() else None

    def _unrecorded(self, gpu_uuid: str) -> DaemonIdentity | None:
        """A daemon with no record: the plugin died between its start and the record, or an older
        version started it (and kept only the daemon's own pid file). Found by what only the
        plugin gave it: its pipe directory in its environment, and the plugin's PID namespace (a
        container's processes are in their pod's)."""
        pipe = self.pipe_dir(gpu_uuid)
        if not pipe.is_dir():
            return None
        wanted = f"CUDA_MPS_PIPE_DIRECTORY={pipe}".encode()
        ours = _pid_namespace("self")
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and _is_mps_control(int(entry.name)) and _pid_namespace(entry.name) == ours:
                try:
                    environment = (entry / "environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if wanted in environment:
                    return DaemonIdentity.of(int(entry.name))
        return None

    def start(self, gpu_index: int, gpu_uuid: str, exclusive_gpu: bool = True) -> bool:
        """Start the control daemon of a GPU, or of a MIG device (`gpu_uuid` its MIG UUID), unless one
        runs (then it is adopted); True when started. `exclusive_gpu`: the GPU goes to EXCLUSIVE_PROCESS
        so that only the MPS server holds a context on it (not for a partition: the mode is the GPU's)."""
        running = self._daemon(gpu_uuid)
        if running is not None:
            self._record(gpu_uuid, running)  # one found unrecorded is recorded from now on
            if exclusive_gpu and self._session.compute_mode(gpu_index) != pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS:
                # A GPU reset put the mode back to DEFAULT under a running daemon.
                self._session.set_compute_mode(gpu_index, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
            return False
        pipe, shm = self.pipe_dir(gpu_uuid), self.shm_dir(gpu_uuid)
        for directory in (pipe, self.log_dir(gpu_uuid), shm):
            directory.mkdir(parents=True, exist_ok=True)
        # After a crash between here and the launch they already are.
        if not tmpfs.is_mounted(pipe):
            tmpfs.mount_tmpfs(self._runner, pipe, PIPE_BYTES, f"fgpu-mps-pipe-{gpu_uuid}", mode=PIPE_MODE)
        if not tmpfs.is_mounted(shm):
            tmpfs.mount_tmpfs(self._runner, shm, self._shm_bytes, source=f"fgpu-mps-{gpu_uuid}")
        self._on_shm_mounted()
        _empty(pipe)  # what a daemon that died left (its socket would pass for the new one's)
        if exclusive_gpu:
            self._session.set_compute_mode(gpu_index, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
        control = self._runner.locate(MPS_CONTROL)
        child = self._runner.spawn(
            "unshare", "--mount", "--propagation", "private", "--", *self._launcher(), str(shm), control,
            env=self._env(gpu_uuid), output=self.log_dir(gpu_uuid) / LAUNCH_LOG,
        )  # fmt: skip
        self._children[gpu_uuid] = child
        # Unreaped, the child keeps its pid: this is its identity, whatever it has exec'd by now.
        identity = DaemonIdentity.of(child.pid)
        if identity is not None:
            self._record(gpu_uuid, identity)
        self._wait_until_serving(gpu_uuid, child)
        log.debug("started the MPS control daemon of GPU %d (%s), pid %d", gpu_index, gpu_uuid, child.pid)
        return True

    def _record(self, gpu_uuid: str, identity: DaemonIdentity) -> None:
        # Not durable: a reboot takes the daemon with it.
        atomic_write(self._identity_file(gpu_uuid), str(identity).encode(), durable=False, mode=0o600)

    def _wait_until_serving(self, gpu_uuid: str, child: subprocess.Popen[bytes]) -> None:
        """Until the daemon's control socket is there; a daemon that exits first is a ToolError
        with what it printed."""
        socket = self.pipe_dir(gpu_uuid) / CONTROL_SOCKET
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _is_socket(socket):
            code = child.poll()
            if code is not None:
                output = _last_line(self.log_dir(gpu_uuid) / LAUNCH_LOG)
                raise ToolError(f"the MPS control daemon of {gpu_uuid} exited with code {code}: {output}", output)
            if time.monotonic() > deadline:
                raise ToolError(f"the MPS control daemon of {gpu_uuid} did not serve within {START_TIMEOUT_S:.0f}s")
            time.sleep(0.01)

    def _launcher(self) -> tuple[str, ...]:
        if self._daemon_cgroups_of is None:
            return ("sh", "-c", LAUNCH_SCRIPT, "fgpu-mps-launch")
        pid = str(self._daemon_cgroups_of)
        join = ("sh", "-c", JOIN_CGROUPS_SCRIPT + LAUNCH_SCRIPT, "fgpu-mps-launch", pid)
        if _cgroup_namespace(pid) in (None, _cgroup_namespace("self")):
            # The same namespace (containers on cgroup v1 share the host's), or one we may not read
            # (PID 1 of a sandboxed VM): its /proc/<pid>/cgroup paths are ours.
            return join
        # In the target's cgroup namespace, so that its /proc/<pid>/cgroup paths and a fresh mount of
        # each hierarchy agree (a container on cgroup v2 has a namespace of its own).
        return ("nsenter", f"--target={pid}", "--cgroup", "--", *join)

    def stop(self, gpu_index: int, gpu_uuid: str, exclusive_gpu: bool = True) -> bool:
        """Stop the daemon (if it runs), put the GPU back to DEFAULT (`exclusive_gpu`: start set it),
        unmount its tmpfs and remove its directories; True when a daemon was stopped. Safe to repeat
        after a crash."""
        identity = self._daemon(gpu_uuid)
        if identity is not None:
            self._runner.run(MPS_CONTROL, stdin="quit\n", env=self._env(gpu_uuid))
            self._wait_for_exit(gpu_uuid, identity)
            log.debug("stopped the MPS control daemon of GPU %d (%s)", gpu_index, gpu_uuid)
        self._on_daemon_stopped()
        if exclusive_gpu:
            self._session.set_compute_mode(gpu_index, pynvml.NVML_COMPUTEMODE_DEFAULT)
        for directory in (self.shm_dir(gpu_uuid), self.pipe_dir(gpu_uuid)):
            if tmpfs.is_mounted(directory):
                tmpfs.unmount(self._runner, directory)
        shutil.rmtree(self._root / gpu_uuid, ignore_errors=True)
        return identity is not None

    def _wait_for_exit(self, gpu_uuid: str, identity: DaemonIdentity) -> None:
        """`quit` returns before the daemon is gone; its pipe directory must outlive it."""
        child = self._children.pop(gpu_uuid, None)
        deadline = time.monotonic() + QUIT_TIMEOUT_S
        try:
            if child is not None and child.pid == identity.pid:
                child.wait(QUIT_TIMEOUT_S)  # this process's child: reaped
                return
            while identity.alive():
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(MPS_CONTROL, QUIT_TIMEOUT_S)
                time.sleep(0.02)
        except subprocess.TimeoutExpired as err:
            raise ToolError(
                f"the MPS control daemon of {gpu_uuid} (pid {identity.pid}) did not exit after quit"
            ) from err

    def gpus_with_state(self) -> set[str]:
        """GPU UUIDs that have MPS directories (a daemon may run there, its tmpfs be mounted)."""
        return {p.name for p in self._root.iterdir()} if self._root.exists() else set()

    def mounts(self, gpu_uuid: str) -> tuple[tuple[str, str, str], ...]:
        """(host path, container path, access) of what a client container mounts: the pipe
        directory read-only (a client connects to its sockets, never writes there)."""
        return (
            (str(self.pipe_dir(gpu_uuid)), CONTAINER_PIPE_DIR, "ro"),
            (str(self.shm_dir(gpu_uuid)), CONTAINER_SHM_DIR, "rw"),
        )


def _cgroup_namespace(pid: str) -> str | None:
    return _namespace(pid, "cgroup")


def _pid_namespace(pid: str) -> str | None:
    return _namespace(pid, "pid")


def _namespace(pid: str, kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.lstat().st_mode)
    except OSError:
        return False


def _empty(directory: Path) -> None:
    for entry in directory.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""


def _is_mps_control(pid: int) -> bool:
    """Whether the process runs nvidia-cuda-mps-control (the fake is a script: it is an argument).
    A zombie has an empty command line: it no longer runs."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(Path(part.decode(errors="replace")).name == MPS_CONTROL for part in command[:2])
