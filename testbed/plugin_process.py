"""Runs `fgpu kubelet-plugin` as a real subprocess on real Unix sockets, and talks to it the way
kubelet does, with clients generated from the protos."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from driver.node.kubelet.api import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from driver.node.kubelet.api import pluginregistration_v1_pb2 as reg_pb
from driver.node.kubelet.api import pluginregistration_v1_pb2_grpc as reg_grpc
from driver.node.sockets import (
    accepts_connections,
    rolling_update_dra_socket_file,
    rolling_update_registrar_socket_file,
)
from testbed.cluster.harness import die_with_parent
from testbed.cluster.host_state import short_temp_dir

DRIVER = "gpu.fgpu.dev"
VERSIONS = {"v1": (dra_v1_pb2, dra_v1_pb2_grpc), "v1beta1": (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc)}


@dataclass
class PluginUnderTest:
    node: str
    kubeconfig: str
    root: Path = field(default_factory=short_temp_dir)
    nvml: str = "mock:dgx-h100"
    extra_env: dict[str, str] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    uid: str = ""  # a DaemonSet pod's UID (--rolling-update-uid or POD_UID): sockets named after it
    process: subprocess.Popen[bytes] | None = None
    _channel: grpc.Channel | None = field(default=None, repr=False)

    @property
    def registrar_dir(self) -> Path:
        return self.root / "registry"

    @property
    def state_dir(self) -> Path:
        """Where the checkpoint and MPS directories are: the plugin dir unless --state-dir says."""
        return self.plugin_dir

    @property
    def plugin_dir(self) -> Path:
        return self.root / "plugin"

    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi"

    @property
    def registration_socket(self) -> Path:
        if self.uid:
            return self.registrar_dir / rolling_update_registrar_socket_file(self.registrar_dir, DRIVER, self.uid)
        return self.registrar_dir / f"{DRIVER}-reg.sock"

    @property
    def dra_socket(self) -> Path:
        return self.plugin_dir / (rolling_update_dra_socket_file(self.plugin_dir, self.uid) if self.uid else "dra.sock")

    @property
    def log_path(self) -> Path:
        return self.root / (f"plugin-{self.uid}.log" if self.uid else "plugin.log")

    def health(self) -> int:
        """The gRPC health status the plugin reports (what a liveness probe sees)."""
        with grpc.insecure_channel(f"unix://{self.dra_socket}") as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status

    def start(self, wait: bool = True) -> PluginUnderTest:
        argv = [
            sys.executable, "-m", "driver.cli", "kubelet-plugin",
            f"--node-name={self.node}", f"--nvml={self.nvml}", f"--kubeconfig={self.kubeconfig}",
            f"--registrar-dir={self.registrar_dir}", f"--plugin-dir={self.plugin_dir}", f"--cdi-dir={self.cdi_dir}",
            *self.extra_args,
        ]  # fmt: skip
        env = {**os.environ, **self.extra_env}
        env.pop("KUBECONFIG", None)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent
            )
        if wait:
            self.wait_for_sockets()
        return self

    def wait_for_sockets(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"plugin exited with {self.process.returncode}:\n{self.logs()}")
            if accepts_connections(self.registration_socket) and accepts_connections(self.dra_socket):
                return
            time.sleep(0.05)
        raise AssertionError(f"plugin sockets did not appear:\n{self.logs()}")

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    # --- kubelet's side of the wire -------------------------------------------------------------

    def register(self) -> reg_pb.PluginInfo:
        with grpc.insecure_channel(f"unix://{self.registration_socket}") as channel:
            stub = reg_grpc.RegistrationStub(channel)
            info = stub.GetInfo(reg_pb.InfoRequest(), timeout=5)
            stub.NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=True), timeout=5)
        return info

    def _dra_stub(self, version: str) -> Any:
        """One long-lived connection, as kubelet keeps; it reconnects after a plugin restart."""
        if self._channel is None:
            self._channel = grpc.insecure_channel(f"unix://{self.dra_socket}")
        return VERSIONS[version][1].DRAPluginStub(self._channel)

    def prepare(self, claims: list[dict[str, str]], version: str = "v1") -> dict[str, Any]:
        messages = VERSIONS[version][0]
        request = messages.NodePrepareResourcesRequest(claims=[messages.Claim(**c) for c in claims])
        return dict(self._dra_stub(version).NodePrepareResources(request, timeout=45, wait_for_ready=True).claims)

    def unprepare(self, claims: list[dict[str, str]], version: str = "v1") -> dict[str, str]:
        messages = VERSIONS[version][0]
        request = messages.NodeUnprepareResourcesRequest(claims=[messages.Claim(**c) for c in claims])
        response = self._dra_stub(version).NodeUnprepareResources(request, timeout=45, wait_for_ready=True)
        return {uid: result.error for uid, result in response.claims.items()}
