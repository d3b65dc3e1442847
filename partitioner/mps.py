"""MPS shares: one control daemon per GPU, run as a host service: started with the GPU's first share,
stopped with its last; each claim's containers get their own limits.

The daemon lives outside the plugin's process lifetime: `nvidia-cuda-mps-control -d` daemonizes
into a session of its own, so a plugin restart, SIGKILL or rolling update leaves it serving its
clients; a restarted plugin adopts it by the pid file it keeps in the pipe directory.

Clients reach it through two host directories under `<state-dir>/mps/<gpu-uuid>/`, which each
share's CDI spec mounts: `pipe` (its control and server sockets) at /tmp/nvidia-mps, and `shm`, a
tmpfs, at /dev/shm, since the MPS server and its clients exchange data through files in /dev/shm
(a container's own /dev/shm is its pod's). The daemon is started in a private mount namespace
where that tmpfs is bind-mounted on /dev/shm; the MPS servers it forks inherit it.

Limits (from the claim's consumedCapacity, lowered by its opaque config): the active thread
percentage (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) and the pinned device memory limit
(CUDA_MPS_PINNED_DEVICE_MEM_LIMIT) are set in the claim's CDI spec. MPS enforces them for clients
that keep them, but they are cooperative: a process that unsets the variables before creating its
CUDA context escapes them. Memory and fault isolation are not what MPS gives; MIG does.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pynvml

from driver.nvml.session import NvmlSession
from partitioner import tmpfs
from partitioner.runner import ToolError, ToolRunner

log = logging.getLogger(__name__)
MPS_CONTROL = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"  # the real daemon's, in its pipe directory
CONTAINER_PIPE_DIR = "/tmp/nvidia-mps"  # CUDA's default CUDA_MPS_PIPE_DIRECTORY
CONTAINER_SHM_DIR = "/dev/shm"
DEFAULT_SHM_BYTES = 2**30
QUIT_TIMEOUT_S = 10.0
MiB = 2**20
# Run by util-linux unshare in a new mount namespace, propagation private (nothing leaks back to
# the host): the GPU's tmpfs over /dev/shm, then the daemon, which forks away and keeps the namespace.
LAUNCH_SCRIPT = 'mount --bind "$1" /dev/shm && exec "$2" -d'
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

    def daemon_pid(self, gpu_uuid: str) -> int | None:
        """The running control daemon's pid, from its pid file; None when none runs (a stale file,
        or a pid reused by another process after a reboot)."""
        try:
            pid = int((self.pipe_dir(gpu_uuid) / PID_FILE).read_text())
        except (OSError, ValueError):
            return None
        return pid if _is_mps_control(pid) else None

    def running(self, gpu_uuid: str) -> bool:
        return self.daemon_pid(gpu_uuid) is not None

    def start(self, gpu_index: int, gpu_uuid: str, exclusive_gpu: bool = True) -> bool:
        """Start the control daemon of a GPU, or of a MIG device (`gpu_uuid` its MIG UUID), unless one
        runs (then it is adopted); True when started. `exclusive_gpu`: the GPU goes to EXCLUSIVE_PROCESS
        so that only the MPS server holds a context on it (not for a partition: the mode is the GPU's)."""
        if self.running(gpu_uuid):
            if exclusive_gpu and self._session.compute_mode(gpu_index) != pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS:
                # A GPU reset put the mode back to DEFAULT under a running daemon.
                self._session.set_compute_mode(gpu_index, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
            return False
        for directory in (self.pipe_dir(gpu_uuid), self.log_dir(gpu_uuid), self.shm_dir(gpu_uuid)):
            directory.mkdir(parents=True, exist_ok=True)
        shm = self.shm_dir(gpu_uuid)
        if not tmpfs.is_mounted(shm):  # after a crash between here and the launch it already is
            tmpfs.mount_tmpfs(self._runner, shm, self._shm_bytes, source=f"fgpu-mps-{gpu_uuid}")
        self._on_shm_mounted()
        if exclusive_gpu:
            self._session.set_compute_mode(gpu_index, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
        control = self._runner.locate(MPS_CONTROL)
        self._runner.run(
            "unshare", "--mount", "--propagation", "private", "--", *self._launcher(), str(shm), control,
            env=self._env(gpu_uuid), new_session=True,
        )  # fmt: skip
        log.debug("started the MPS control daemon of GPU %d (%s)", gpu_index, gpu_uuid)
        return True

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
        pid = self.daemon_pid(gpu_uuid)
        if pid is not None:
            self._runner.run(MPS_CONTROL, stdin="quit\n", env=self._env(gpu_uuid))
            _wait_for_exit(pid, gpu_uuid)
            log.debug("stopped the MPS control daemon of GPU %d (%s)", gpu_index, gpu_uuid)
        self._on_daemon_stopped()
        if exclusive_gpu:
            self._session.set_compute_mode(gpu_index, pynvml.NVML_COMPUTEMODE_DEFAULT)
        if tmpfs.is_mounted(self.shm_dir(gpu_uuid)):
            tmpfs.unmount(self._runner, self.shm_dir(gpu_uuid))
        shutil.rmtree(self._root / gpu_uuid, ignore_errors=True)
        return pid is not None

    def gpus_with_state(self) -> set[str]:
        """GPU UUIDs that have MPS directories (a daemon may run there, its tmpfs be mounted)."""
        return {p.name for p in self._root.iterdir()} if self._root.exists() else set()

    def mounts(self, gpu_uuid: str) -> tuple[tuple[str, str], ...]:
        return (
            (str(self.pipe_dir(gpu_uuid)), CONTAINER_PIPE_DIR),
            (str(self.shm_dir(gpu_uuid)), CONTAINER_SHM_DIR),
        )


def _cgroup_namespace(pid: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/cgroup")
    except OSError:
        return None


def _is_mps_control(pid: int) -> bool:
    """Whether the process runs nvidia-cuda-mps-control (the fake is a script: it is an argument).
    A zombie has an empty command line: it no longer runs."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(Path(part.decode(errors="replace")).name == MPS_CONTROL for part in command[:2])


def _wait_for_exit(pid: int, gpu_uuid: str) -> None:
    """`quit` returns before the daemon is gone; its pipe directory must outlive it."""
    deadline = time.monotonic() + QUIT_TIMEOUT_S
    while _is_mps_control(pid):
        if time.monotonic() > deadline:
            raise ToolError(f"the MPS control daemon of GPU {gpu_uuid} (pid {pid}) did not exit after quit")
        time.sleep(0.02)
