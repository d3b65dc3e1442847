"""A node's claim preparer wired in-process for unit tests: mock NVML, the mock driver root with the fake
system tools, a temporary state dir. Integration tests run the same code as a real
`fgpu kubelet-plugin`."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from driver.inventory.devices import node_targets
from driver.inventory.discovery import GpuInfo, discover_gpus
from driver.inventory.sharing import ALL_KINDS, SharingConfig
from driver.kube.client import KubeApi
from driver.node.cdi import CdiWriter, DriverFiles
from driver.node.checkpoint import Checkpoint
from driver.node.instance_lock import InstanceLock
from driver.node.partition_use import Partitioners
from driver.node.prepare import ClaimPreparer
from driver.node.state import PreparedClaims
from driver.nvml import mock_driver_root
from driver.nvml.session import NvmlSession
from partitioner.mig import MigPartitioner
from partitioner.mps import MpsPartitioner
from partitioner.runner import ToolRunner
from partitioner.timeslice import TimeSlicer


def fake_tools_env(root: Path) -> dict[str, str]:
    """Environment that keeps the fake nvidia-smi's state and the fake tools' log under root
    (where tests read them)."""
    return {
        mock_driver_root.SMI_STATE_ENV: str(root / "fake-smi.json"),
        mock_driver_root.TOOLS_LOG_ENV: str(root / "fake-tools.log"),
    }


def mount_points_under(root: Path) -> list[Path]:
    """Mounts at or below root, deepest first (the order to unmount them in)."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4]))
        if point == root.resolve() or root.resolve() in point.parents:
            found.append(point)
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def process_alive(pid: int) -> bool:
    """Running, not a zombie (a daemon's exit is seen before its reaper collects it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def stop_fake_daemons(root: Path) -> None:
    """Kill MPS control daemons the fakes started under root and unmount the MPS tmpfs mounts
    there: the daemons outlive the plugin by design, and a test leaves nothing behind."""
    for pid_file in root.rglob("nvidia-cuda-mps-control.pid"):
        if not pid_file.is_file():  # a FIFO a test planted there would block the read
            continue
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
    for point in mount_points_under(root):
        subprocess.run(["umount", str(point)], check=True)


@dataclass
class NodeEnv:
    root: Path
    session: NvmlSession
    gpus: list[GpuInfo]
    claims: PreparedClaims
    cdi: CdiWriter
    mps: MpsPartitioner
    preparer: ClaimPreparer

    def restart(self, api: KubeApi) -> NodeEnv:
        """A new preparer over the same state, NVML and disks, as after a plugin restart."""
        return build_node(self.root, api, session=self.session)


def build_node(root: Path, api: KubeApi, machine: str = "dgx-h100", session: NvmlSession | None = None) -> NodeEnv:
    state_dir = root / "state"
    session = session or NvmlSession.open(f"mock:{machine}")
    gpus = discover_gpus(session)
    claims = PreparedClaims(Checkpoint(state_dir / "checkpoint.json", boot_id="boot"))
    driver_root = root / "driver-root"
    mock_driver_root.lay_out(driver_root, session.driver_versions()[0])
    cdi = CdiWriter(root / "cdi", "gpu.fgpu.dev", DriverFiles.discover(driver_root), mock_device_nodes=True)
    runner = ToolRunner(driver_root)
    mps = MpsPartitioner(session, runner, state_dir)
    preparer = ClaimPreparer(
        driver_name="gpu.fgpu.dev",
        node_name="node-a",
        targets=node_targets(gpus, SharingConfig(default=ALL_KINDS, mig_share_profiles=frozenset({"3g.40gb"}))),
        api=api,
        claims=claims,
        cdi=cdi,
        partitioners=Partitioners(mig=MigPartitioner(session), mps=mps, timeslice=TimeSlicer(runner)),
        instance=InstanceLock(state_dir),
        driver_missing=session.driver_missing,  # the plugin asks its health monitor, which asks NVML
    )
    return NodeEnv(root, session, gpus, claims, cdi, mps, preparer)
