"""`fgpu kubelet-plugin` as a real process on the real node: its sockets in kubelet's own plugin
directories (kubelet's plugin watcher registers it), its CDI specs where containerd reads them,
mock GPUs whose state a test can read."""

from __future__ import annotations

import shutil
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from driver.nvml.machine import load_machine
from driver.nvml.mock import MockNvml
from driver.nvml.session import MOCK_STATE_ENV, NvmlSession
from testbed.cluster.node import RealNode
from testbed.node_env import stop_fake_daemons
from testbed.plugin_process import DRIVER, PluginUnderTest
from testbed.workloads import wait_until


@dataclass
class NodePlugin(PluginUnderTest):
    real_node: RealNode | None = None
    state_root: Path | None = None  # another instance's root: a DaemonSet's pods share the node's state

    @property
    def _node(self) -> RealNode:
        assert self.real_node is not None
        return self.real_node

    @property
    def registrar_dir(self) -> Path:
        return self._node.registrar_dir

    @property
    def plugin_dir(self) -> Path:
        return self._node.plugin_dir(DRIVER)

    @property
    def cdi_dir(self) -> Path:
        return self._node.cdi_dir

    @property
    def state_dir(self) -> Path:
        return (self.state_root or self.root) / "state"

    @property
    def mock_state(self) -> Path:
        return (self.state_root or self.root) / "gpus.json"

    @classmethod
    def on(
        cls, node: RealNode, nvml: str = "mock:dgx-h100", uid: str = "", sharing_state_of: NodePlugin | None = None
    ) -> NodePlugin:
        """A plugin on the node; with a pod UID, as one pod of a rolling update that shares the
        state of another instance."""
        assert node.cluster.kubeconfig is not None
        plugin = cls(node=node.name, kubeconfig=str(node.cluster.kubeconfig), nvml=nvml, real_node=node, uid=uid)
        # The root whose state the other instance uses: a rollout's third instance shares the first's.
        plugin.state_root = (sharing_state_of.state_root or sharing_state_of.root) if sharing_state_of else None
        plugin.extra_env = {MOCK_STATE_ENV: str(plugin.mock_state)}
        plugin.extra_args = [f"--state-dir={plugin.state_dir}", *([f"--rolling-update-uid={uid}"] if uid else [])]
        return plugin

    def registrations(self) -> int:
        """How often kubelet has completed the registration handshake with this plugin."""
        return self.logs().count("registered with kubelet")

    def registered_after(self, action: Callable[[], object]) -> None:
        """Run action (a plugin or kubelet restart) and wait until kubelet has registered the plugin
        again: kubelet retries a pod that met an unregistered driver only at its next periodic sync
        (a minute or more), so a test's next pod should come after that."""
        before = self.registrations()
        action()
        wait_until("kubelet registered the plugin again", lambda: self.registrations() > before)

    def start_registered(self) -> NodePlugin:
        self.registered_after(self.start)
        return self

    def restart(self, sig: int = signal.SIGTERM) -> None:
        def stop_and_start() -> None:
            self.stop(sig)
            self.start()

        self.registered_after(stop_and_start)

    def remove(self) -> None:
        """Stop the plugin and remove what it leaves by design (MPS daemons outlive it, their
        tmpfs stays mounted) and its directory."""
        self.stop()
        stop_fake_daemons(self.root)
        shutil.rmtree(self.root, ignore_errors=True)

    def gpus(self) -> NvmlSession:
        """The mock GPUs as the plugin left them (MIG instances, compute modes)."""
        return NvmlSession(MockNvml(load_machine(self.nvml.removeprefix("mock:")), self.mock_state))
