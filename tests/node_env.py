"""A node's driver wired in-process for unit tests: mock NVML, fake system tools on PATH, a
temporary state dir. Integration tests run the same code as a real `fgpu kubelet-plugin`."""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from driver.cdi import CdiWriter, DriverFiles
from driver.checkpoint import Checkpoint
from driver.devices import node_targets
from driver.discovery import GpuInfo, discover_gpus
from driver.driver import Driver, Partitioners
from driver.kube import KubeApi
from driver.nvml.session import NvmlSession
from driver.ownership import InstanceLock
from driver.sharing import SharingConfig
from driver.state import PreparedClaims
from partitioner.mig import MigPartitioner
from partitioner.mps import MpsPartitioner
from partitioner.runner import ToolRunner
from partitioner.timeslice import TimeSlicer

FAKEBIN = Path(__file__).resolve().parent / "fakebin"


def fake_tools_env(root: Path) -> dict[str, str]:
    """Environment that puts the fake nvidia-smi and nvidia-cuda-mps-control first on PATH."""
    return {
        "PATH": f"{FAKEBIN}:{os.environ.get('PATH', '')}",
        "FGPU_FAKE_SMI_STATE": str(root / "fake-smi.json"),
        "FGPU_FAKE_TOOLS_LOG": str(root / "fake-tools.log"),
    }


def stop_fake_daemons(root: Path) -> None:
    """Kill MPS control daemons the fakes started under root (a crashed test leaves none behind)."""
    for pid_file in root.rglob("nvidia-cuda-mps-control.pid"):
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


@dataclass
class NodeEnv:
    root: Path
    session: NvmlSession
    gpus: list[GpuInfo]
    claims: PreparedClaims
    cdi: CdiWriter
    mps: MpsPartitioner
    driver: Driver

    def restart(self, api: KubeApi) -> NodeEnv:
        """A new driver over the same state, NVML and disks, as after a plugin restart."""
        return build_node(self.root, api, session=self.session)


def build_node(root: Path, api: KubeApi, machine: str = "dgx-h100", session: NvmlSession | None = None) -> NodeEnv:
    state_dir = root / "state"
    session = session or NvmlSession.open(f"mock:{machine}")
    gpus = discover_gpus(session)
    claims = PreparedClaims(Checkpoint(state_dir / "checkpoint.json", boot_id="boot"))
    cdi = CdiWriter(root / "cdi", "gpu.fgpu.dev", DriverFiles(root=Path("/")))
    runner = ToolRunner()
    mps = MpsPartitioner(session, runner, state_dir)
    driver = Driver(
        "gpu.fgpu.dev",
        "node-a",
        node_targets(gpus, SharingConfig()),
        api,
        claims,
        cdi,
        Partitioners(mig=MigPartitioner(session), mps=mps, timeslice=TimeSlicer(runner)),
        InstanceLock(state_dir),
    )
    return NodeEnv(root, session, gpus, claims, cdi, mps, driver)
