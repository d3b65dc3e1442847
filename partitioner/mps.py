"""MPS shares: one control daemon per GPU, started with the GPU's first share and stopped with its
last; each claim's containers get their own limits.

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
from dataclasses import dataclass
from pathlib import Path

import pynvml

from driver.nvml.session import NvmlSession
from partitioner.runner import ToolRunner

log = logging.getLogger(__name__)
MPS_CONTROL = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"
CONTAINER_PIPE_DIR = "/tmp/nvidia-mps"  # CUDA's default CUDA_MPS_PIPE_DIRECTORY
MiB = 2**20


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


class MpsPartitioner:
    def __init__(self, session: NvmlSession, runner: ToolRunner, state_dir: Path) -> None:
        self._session = session
        self._runner = runner
        self._root = state_dir / "mps"

    def pipe_dir(self, gpu_uuid: str) -> Path:
        return self._root / gpu_uuid / "pipe"

    def log_dir(self, gpu_uuid: str) -> Path:
        return self._root / gpu_uuid / "log"

    def _env(self, gpu_uuid: str) -> dict[str, str]:
        return {
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir(gpu_uuid)),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir(gpu_uuid)),
            "CUDA_VISIBLE_DEVICES": gpu_uuid,
        }

    def running(self, gpu_uuid: str) -> bool:
        """The control daemon writes its pid to the pipe directory; alive pid, running daemon."""
        try:
            pid = int((self.pipe_dir(gpu_uuid) / PID_FILE).read_text())
            os.kill(pid, 0)
        except (OSError, ValueError):
            return False
        return True

    def start(self, gpu_index: int, gpu_uuid: str) -> None:
        """Start the GPU's control daemon unless it runs; the GPU goes to EXCLUSIVE_PROCESS so that
        only the MPS server holds a context on it."""
        if self.running(gpu_uuid):
            return
        self.pipe_dir(gpu_uuid).mkdir(parents=True, exist_ok=True)
        self.log_dir(gpu_uuid).mkdir(parents=True, exist_ok=True)
        self._session.set_compute_mode(gpu_index, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
        self._runner.run(MPS_CONTROL, "-d", env=self._env(gpu_uuid))
        log.info("started the MPS control daemon of GPU %d (%s)", gpu_index, gpu_uuid)

    def stop(self, gpu_index: int, gpu_uuid: str) -> None:
        """Stop the daemon (if it runs), put the GPU back to DEFAULT and remove its directories."""
        if self.running(gpu_uuid):
            self._runner.run(MPS_CONTROL, stdin="quit\n", env=self._env(gpu_uuid))
            log.info("stopped the MPS control daemon of GPU %d (%s)", gpu_index, gpu_uuid)
        self._session.set_compute_mode(gpu_index, pynvml.NVML_COMPUTEMODE_DEFAULT)
        shutil.rmtree(self._root / gpu_uuid, ignore_errors=True)

    def gpus_with_state(self) -> set[str]:
        """GPU UUIDs that have MPS directories (a daemon may run there)."""
        return {p.name for p in self._root.iterdir()} if self._root.exists() else set()

    def mounts(self, gpu_uuid: str) -> tuple[tuple[str, str], ...]:
        return ((str(self.pipe_dir(gpu_uuid)), CONTAINER_PIPE_DIR),)
