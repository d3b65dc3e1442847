"""A real node for the test control plane: containerd and kubelet built from upstream (build.sh),
runc and the CNI plugins from Debian, local images imported without a registry.

`RealNode(cluster).start()` brings it up (containerd, images, CNI bridge, kubelet registered under
its own node credentials, Ready and schedulable); `.stop()` removes its pods, stops everything and
puts the host back as it was (host_state.py). What this VM needs and why is in
../shared/reference/real-node.md: cgroup v1 (`failCgroupV1: false`, cgroupfs), no
CAP_SYS_RESOURCE (`restrict_oom_score_adj`), no swap check, loose eviction thresholds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes

from testbed.cluster.harness import Cluster, check_alive, free_port, poll_until, spawn, stop_process, write_kubeconfig
from testbed.cluster.host_state import (
    NODE_RECORD,
    TEMP_PREFIX,
    HostState,
    lock_host,
    mount_points,
    run_prefix,
    short_temp_dir,
    temp_dirs,
    unlock_host,
)
from testbed.cluster.images import PAUSE_IMAGE, pause_image, userland_image

log = logging.getLogger(__name__)

IMAGE_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fgpu" / "images"
CNI_BIN_DIR = "/usr/lib/cni"
RUNC = "/usr/sbin/runc"
BRIDGE = "fgpu-cni0"
POD_SUBNET = "10.244.250.0/24"  # on a bridge of this machine only; nothing routes it anywhere
READY_TIMEOUT_S = 120
KUBELET_FEATURE_GATES = {"DRAConsumableCapacity": True, "ResourceHealthStatus": True}


@dataclass
class RealNode:
    cluster: Cluster
    name: str = "fgpu-node"
    labels: dict[str, str] = field(default_factory=lambda: {"nvidia.com/gpu.present": "true"})
    workdir: Path = field(default_factory=lambda: short_temp_dir("node-"))
    outlive_parent: bool = False
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    host_before: HostState | None = None
    _host_lock: int | None = None

    # --- where things are ------------------------------------------------------------------------

    @property
    def binaries(self) -> Path:
        assert self.cluster.binaries is not None
        return self.cluster.binaries

    @property
    def containerd_socket(self) -> Path:
        return self.workdir / "containerd" / "containerd.sock"

    @property
    def kubelet_root(self) -> Path:
        return self.workdir / "kubelet"

    @property
    def registrar_dir(self) -> Path:
        """kubelet's plugin watcher directory: a DRA plugin puts its registration socket here."""
        return self.kubelet_root / "plugins_registry"

    def plugin_dir(self, driver: str) -> Path:
        return self.kubelet_root / "plugins" / driver

    @property
    def cdi_dir(self) -> Path:
        return self.workdir / "cdi"

    @property
    def logs(self) -> Path:
        return self.workdir / "logs"

    # --- start ------------------------------------------------------------------------------------

    def start(self) -> RealNode:
        self._lock_host()
        self.host_before = HostState.take()
        record = {"workdir": str(self.workdir), "temp_prefix": run_prefix(), "host": self.host_before.to_json()}
        NODE_RECORD.write_text(json.dumps(record))
        try:
            started = time.monotonic()
            self.logs.mkdir(parents=True, exist_ok=True)
            self.cdi_dir.mkdir(parents=True, exist_ok=True)
            self._start_containerd()
            self._import_images()
            self._start_kubelet()
            self._wait_ready()
            log.info("node %s Ready in %.1fs", self.name, time.monotonic() - started)
            return self
        except BaseException:
            self.stop()
            raise

    def _lock_host(self) -> None:
        self._host_lock = lock_host()

    def _unlock_host(self) -> None:
        if self._host_lock is not None:
            unlock_host(self._host_lock)
            self._host_lock = None

    def _start_containerd(self) -> None:
        config = self.workdir / "containerd" / "config.toml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(containerd_config(self.workdir, self.containerd_socket, self.cdi_dir))
        cni_conf = self.workdir / "cni" / "net.d"
        cni_conf.mkdir(parents=True, exist_ok=True)
        (cni_conf / "10-fgpu.conflist").write_text(json.dumps(cni_config(self.workdir), indent=2))
        env = {**os.environ, "PATH": f"{self.binaries}:{os.environ.get('PATH', '')}"}  # the shim is looked up on PATH
        self.processes["containerd"] = spawn(
            [str(self.binaries / "containerd"), "--config", str(config)],
            self.logs / "containerd.log",
            outlive_parent=self.outlive_parent,
            env=env,
        )
        poll_until("containerd", lambda: self.ctr("version").returncode == 0, 30, self._check_alive)

    def ctr(self, *args: str) -> subprocess.CompletedProcess[str]:
        argv = [str(self.binaries / "ctr"), "--address", str(self.containerd_socket), "-n", "k8s.io", *args]
        return subprocess.run(argv, capture_output=True, text=True, check=False)

    def _import_images(self) -> None:
        IMAGE_CACHE.mkdir(parents=True, exist_ok=True)
        for archive in (pause_image(self.binaries / "pause", IMAGE_CACHE), userland_image(IMAGE_CACHE)):
            self.import_image(archive)

    def import_image(self, archive: Path) -> None:
        done = self.ctr("images", "import", "--local", str(archive))
        if done.returncode != 0:
            raise RuntimeError(f"ctr images import {archive} failed: {done.stderr.strip()}")

    def _start_kubelet(self) -> None:
        pki = self.cluster.pki
        assert pki is not None and self.cluster.kubeconfig is not None
        node_user = f"node-{self.name}"
        pki.sign_client(node_user, f"system:node:{self.name}", "system:nodes")
        server = json.loads(self.cluster.kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
        kubeconfig = write_kubeconfig(self.workdir / "kubelet.kubeconfig", server, pki, node_user)
        config = self.workdir / "kubelet-config.json"
        config.write_text(json.dumps(kubelet_config(self, pki.path("ca.crt")), indent=2))
        labels = ",".join(f"{k}={v}" for k, v in self.labels.items())
        self.processes["kubelet"] = spawn(
            [
                str(self.binaries / "kubelet"),
                f"--config={config}",
                f"--kubeconfig={kubeconfig}",
                f"--root-dir={self.kubelet_root}",
                f"--hostname-override={self.name}",
                f"--node-labels={labels}",
                "--v=2",
            ],
            self.logs / "kubelet.log",
            outlive_parent=self.outlive_parent,
        )

    def restart_kubelet(self) -> None:
        """Stop kubelet (SIGTERM) and start it again, as an operator's restart or upgrade does;
        containers keep running under containerd meanwhile."""
        stop_process(self.processes.pop("kubelet"))
        self._start_kubelet()
        self._wait_ready()

    def power_cut(self) -> None:
        """What a power cut leaves of the node: every process gone at once (kubelet, containerd, the
        shims and the containers), every mount gone and containerd's state dir (under /run on a
        host, a tmpfs); the disks kept (kubelet's root dir with its checkpoints, containerd's root
        with the images). The GPUs and the plugin are testbed/reboot.py's."""
        for name in ("kubelet", "containerd"):
            process = self.processes.pop(name, None)
            if process is not None:
                process.kill()
                process.wait()
        kill_leftovers(self.workdir)
        unmount_all(self.workdir)
        shutil.rmtree(self.workdir / "containerd" / "state", ignore_errors=True)

    def boot(self) -> None:
        """containerd and kubelet started again after a power cut, as their units start at boot;
        kubelet then starts the pods bound to the node again."""
        self._start_containerd()
        self._start_kubelet()
        self._wait_ready()

    def _wait_ready(self) -> None:
        core = kubernetes.client.CoreV1Api(self.cluster.api_client())

        def ready() -> bool:
            node = core.read_node(self.name)
            return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])

        poll_until(f"node {self.name}", ready, READY_TIMEOUT_S, self._check_alive)
        # The test control plane runs no node-lifecycle controller (it would taint the fake nodes),
        # so the not-ready taint every new node gets is lifted here, as that controller would.
        core.patch_node(self.name, {"spec": {"taints": None}})

    def _check_alive(self) -> None:
        check_alive(self.processes, self.logs)

    # --- stop -------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Pods first (through kubelet, so CNI and volumes are undone its way), then kubelet and
        containerd, then whatever a crash left: tasks, shims, mounts, cgroups, host settings."""
        if "kubelet" in self.processes and self.processes["kubelet"].poll() is None:
            with contextlib.suppress(Exception):
                self._delete_pods()
        if "kubelet" in self.processes:
            stop_process(self.processes.pop("kubelet"))
        if "containerd" in self.processes and self.processes["containerd"].poll() is None:
            self._remove_containers()
        if "containerd" in self.processes:
            stop_process(self.processes.pop("containerd"))
        kill_leftovers(self.workdir)
        unmount_all(self.workdir)
        if self.host_before is not None:
            self.host_before.restore()
        shutil.rmtree(self.workdir, ignore_errors=True)
        NODE_RECORD.unlink(missing_ok=True)
        self._unlock_host()
        with contextlib.suppress(Exception):
            kubernetes.client.CoreV1Api(self.cluster.api_client()).delete_node(self.name)

    def _delete_pods(self, timeout_s: float = 60) -> None:
        core = kubernetes.client.CoreV1Api(self.cluster.api_client())
        selector = f"spec.nodeName={self.name}"
        for pod in core.list_pod_for_all_namespaces(field_selector=selector).items:
            with contextlib.suppress(kubernetes.client.ApiException):
                core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, grace_period_seconds=1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not core.list_pod_for_all_namespaces(field_selector=selector).items and not self._tasks():
                return
            time.sleep(0.5)
        log.warning("pods of node %s still there after %.0fs; removing them by force", self.name, timeout_s)

    def _tasks(self) -> list[str]:
        listing = self.ctr("tasks", "list", "-q")
        return listing.stdout.split() if listing.returncode == 0 else []

    def _remove_containers(self) -> None:
        for task in self._tasks():
            self.ctr("tasks", "kill", "-s", "SIGKILL", task)
        deadline = time.monotonic() + 10
        while self._tasks() and time.monotonic() < deadline:
            time.sleep(0.2)
        for task in self._tasks():
            self.ctr("tasks", "delete", "-f", task)
        for container in self.ctr("containers", "list", "-q").stdout.split():
            self.ctr("containers", "delete", container)


def kill_leftovers(workdir: Path, also_mentioning: str | None = None) -> None:
    """Shims and container processes of a node that outlived containerd (a crashed run); with
    `also_mentioning`, every process whose command line or environment names it (a killed run's
    plugin and MPS daemons, by the run's temp prefix)."""
    pids = _pids_mentioning(str(workdir)) | _pids_in_cgroups("kubepods")
    if also_mentioning:
        pids |= _pids_mentioning(also_mentioning, environment=True)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def unmount_all(workdir: Path, *more: str) -> None:
    prefixes = (str(workdir), "/run/containerd", "/run/netns", "/var/lib/kubelet", *more)
    ours = [m for m in mount_points() if m.startswith(prefixes)]
    for mount in sorted(ours, key=len, reverse=True):
        subprocess.run(["umount", "-l", mount], capture_output=True, check=False)


def _pids_mentioning(text: str, environment: bool = False) -> set[int]:
    found = set()
    spared = _ancestors()  # this process and those that started it (a test run calling cleanup)
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) not in spared:
            with contextlib.suppress(OSError):
                files = ("cmdline", "environ") if environment else ("cmdline",)
                if any(text.encode() in (proc / name).read_bytes() for name in files):
                    found.add(int(proc.name))
    return found


def _ancestors() -> set[int]:
    found, pid = set(), os.getpid()
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the parent's pid, after the command name
    return found


def cleanup() -> str:
    """Put the host back after a run that was killed with its real node up (the node's record
    says what it was before); waits while a live node holds the host."""
    descriptor = lock_host()
    try:
        if not NODE_RECORD.exists():
            return "no real node was left behind"
        record = json.loads(NODE_RECORD.read_text())
        workdir, prefix = Path(record["workdir"]), record["temp_prefix"]
        # Only a run-specific prefix: a bare one would name other runs' processes and directories too.
        run_specific = prefix != TEMP_PREFIX
        kill_leftovers(workdir, prefix if run_specific else None)
        time.sleep(0.5)  # killed processes release their mounts and cgroups
        unmount_all(workdir, *([prefix] if run_specific else []))
        HostState.from_json(record["host"]).restore()
        removed = {workdir, *(map(Path, temp_dirs(prefix)) if run_specific else ())}
        for path in removed:
            shutil.rmtree(path, ignore_errors=True)
        NODE_RECORD.unlink()
        return f"cleaned up after the real node in {workdir}"
    finally:
        unlock_host(descriptor)


def _pids_in_cgroups(name: str) -> set[int]:
    found = set()
    for procs in Path("/sys/fs/cgroup").glob(f"*/{name}/**/cgroup.procs"):
        with contextlib.suppress(OSError, ValueError):
            found.update(int(pid) for pid in procs.read_text().split())
    return found


def containerd_config(workdir: Path, socket: Path, cdi_dir: Path) -> str:
    state = workdir / "containerd" / "state"
    return f"""version = 3
root = "{workdir / "containerd" / "root"}"
state = "{state}"

[grpc]
  address = "{socket}"

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "{PAUSE_IMAGE}"

[plugins.'io.containerd.cri.v1.runtime']
  cdi_spec_dirs = ["{cdi_dir}"]
  # root here lacks CAP_SYS_RESOURCE: runc cannot lower a sandbox's oom_score_adj below ours.
  restrict_oom_score_adj = true
  # network namespaces under our state dir, not the host's /run/netns.
  netns_mounts_under_state_dir = true

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  BinaryName = "{RUNC}"
  Root = "{state / "runc"}"
  SystemdCgroup = false

[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = ["{CNI_BIN_DIR}"]
  conf_dir = "{workdir / "cni" / "net.d"}"
"""


def cni_config(workdir: Path) -> dict[str, Any]:
    """A bridge on this machine with host-local addresses; no masquerading, so pod traffic never
    leaves the machine."""
    return {
        "cniVersion": "1.0.0",
        "name": "fgpu-test",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_SUBNET}]],
                    "dataDir": str(workdir / "cni" / "ipam"),
                },
            },
            {"type": "loopback"},
        ],
    }


def kubelet_config(node: RealNode, client_ca: str) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "containerRuntimeEndpoint": f"unix://{node.containerd_socket}",
        # This VM runs cgroup v1, which kubelet >= 1.35 refuses unless told otherwise.
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "failSwapOn": False,
        "port": free_port(),
        "readOnlyPort": 0,
        "healthzPort": 0,
        # Only clients with a certificate of the test CA (the apiserver) reach the kubelet API.
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": client_ca},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "podLogsDir": str(node.workdir / "pod-logs"),
        # A busy build disk must not evict test pods.
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "featureGates": KUBELET_FEATURE_GATES,
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.cluster.node")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("cleanup", help="put the host back after a run killed while its real node was up")
    parser.parse_args()
    print(cleanup())
    return 0


if __name__ == "__main__":
    sys.exit(main())
