"""What a reboot does to a node with mock GPUs, for tests: the volatile state goes, the state dirs
stay. A reboot keeps the disks (/var/lib/kubelet, the plugin's state dir with its checkpoint) and
loses what lives in memory: MIG GPU and compute instances (MIG mode itself persists), compute
modes and time-slice intervals (driver settings, Default again), every process (MPS daemons) and
every mount (their tmpfs), and /var/run (a tmpfs: the CDI specs). The real node's processes
(containers, kubelet, containerd, the plugin) are stopped by testbed/cluster/node.py."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from driver.nvml.mock import MockNvml
from driver.nvml.mock_driver_root import forget_timeslices
from testbed.node_env import stop_fake_daemons


def clear_volatile_state(nvml: MockNvml, smi_state: Path, cdi_dir: Path, run_roots: Iterable[Path]) -> None:
    """`run_roots`: where MPS daemons were started and their tmpfs mounted (the plugin's state dir)."""
    for root in run_roots:
        stop_fake_daemons(root)
    nvml.reboot()
    forget_timeslices(smi_state)
    for spec in cdi_dir.glob("*.json"):
        spec.unlink()
