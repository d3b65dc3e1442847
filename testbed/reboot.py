"""What a reboot does to a node with mock GPUs, for tests: the volatile state goes, the state dirs
stay. A reboot keeps the disks (/var/lib/kubelet, the plugin's state dir with its checkpoint) and
loses what lives in memory: MIG GPU and compute instances (MIG mode itself persists), compute
modes and time-slice intervals (driver settings, Default again), every process (MPS daemons) and
every mount (their tmpfs), and /var/run (a tmpfs: the CDI specs). `reboot` does it to the test
bed's real node: a power cut (RealNode.power_cut: containers, kubelet, containerd), the plugin
killed, the GPUs' volatile state cleared, then the node booted and the plugin started again, as a
DaemonSet's pod would be (maybe late: kubelet has tried its pods' claims by then)."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable
from pathlib import Path

from driver.nvml.mock import MockNvml
from driver.nvml.mock_driver_root import SMI_STATE_ENV, fake_tools_env, forget_timeslices
from testbed.cluster.node import RealNode
from testbed.node_env import stop_fake_daemons
from testbed.node_plugin import NodePlugin


def clear_volatile_state(nvml: MockNvml, smi_state: Path, cdi_dir: Path, run_roots: Iterable[Path]) -> None:
    """`run_roots`: where MPS daemons were started and their tmpfs mounted (the plugin's state dir)."""
    for root in run_roots:
        stop_fake_daemons(root)
    nvml.reboot()
    forget_timeslices(smi_state)
    for spec in cdi_dir.glob("*.json"):
        spec.unlink()


def reboot(node: RealNode, plugin: NodePlugin, before_plugin: Callable[[], object] = lambda: None) -> None:
    """`before_plugin`: run once the node is up, before the plugin starts (a DaemonSet's pod late)."""
    plugin.stop(signal.SIGKILL)
    node.power_cut()
    gpus = plugin.gpus()
    try:
        smi_state = Path(fake_tools_env(plugin.state_dir)[SMI_STATE_ENV])
        clear_volatile_state(gpus.nvml, smi_state, node.cdi_dir, [plugin.state_dir])
    finally:
        gpus.close()
    node.boot()
    before_plugin()
    plugin.start_registered()
