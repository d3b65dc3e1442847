"""The test control plane: etcd, kube-apiserver, kube-controller-manager and kube-scheduler built
from upstream (build.sh), started on loopback with generated certificates, RBAC and the DRA
feature gates, plus fake Node objects.

As a pytest session fixture: `Cluster(workdir).start()` ... `.stop()`. By hand:
  python -m testbed.cluster.harness up [--nodes N]   # prints the kubeconfig path
  python -m testbed.cluster.harness down
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
FEATURE_GATES = ",".join(
    f"{gate}=true"
    for gate in (
        "DRAConsumableCapacity",
        "DRAPartitionableDevices",
        "DRADeviceBindingConditions",
        # Workload and PodGroup (scheduling.k8s.io/v1beta1) and kube-scheduler's GangScheduling:
        # upstream gangs, which fgpu's controller places as gangs (driver/controller/groups.py).
        "GenericWorkload",
    )
)
# A beta API group version is served only when asked for (GenericWorkload is beta in 1.37).
RUNTIME_CONFIG = "scheduling.k8s.io/v1beta1=true"
RUN_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fgpu" / "cluster-run"
START_TIMEOUT_S = 60


NO_BUILDS_ENV = "FGPU_NO_BUILDS"  # set: use what build.sh built before, never build (no Go needed)
BUILT = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "etcd", "allocate", "pause", "helm")


def build_binaries() -> Path:
    """Build (or find cached) control-plane binaries; returns their directory."""
    if os.environ.get(NO_BUILDS_ENV):
        built = built_binaries()
        if built is None:
            raise RuntimeError(f"{NO_BUILDS_ENV} is set and nothing is built: run make cluster")
        return built
    run = subprocess.run([str(HERE / "build.sh")], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"building the control plane failed:\n{run.stderr[-4000:]}")
    return Path(run.stdout.strip().splitlines()[-1])


def built_binaries() -> Path | None:
    """The directory an earlier build.sh filled (FGPU_CLUSTER_BIN, else the newest cached
    Kubernetes version), or None; found without Go and without building."""
    if explicit := os.environ.get("FGPU_CLUSTER_BIN"):
        candidates = [Path(explicit)]
    else:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fgpu"
        candidates = sorted(cache.glob("k8s-*"), reverse=True)
    for directory in candidates:
        if all((directory / name).is_file() for name in BUILT):
            return directory
    return None


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the process that started it dies, so a killed test
    run leaves no control plane behind (Linux PR_SET_PDEATHSIG)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def spawn(
    argv: list[str], log_file: Path, outlive_parent: bool = False, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """A test-bed daemon in its own process group (stopped as a group), output to log_file."""
    with open(log_file, "ab") as output:
        return subprocess.Popen(
            argv,
            stdout=output,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=None if outlive_parent else die_with_parent,
        )


def stop_process(process: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM to the process group, SIGKILL after grace_s."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def check_alive(processes: dict[str, subprocess.Popen[bytes]], logs: Path) -> None:
    """Raise with the tail of its log if one of the daemons has exited."""
    for name, process in processes.items():
        if process.poll() is not None:
            tail = (logs / f"{name}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{tail}")


def poll_until(
    what: str, probe: Callable[[], Any], timeout_s: float, alive: Callable[[], None], interval_s: float = 0.2
) -> None:
    """Poll probe until it is true, failing early when alive() raises (a daemon exited)."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        alive()
        try:
            if probe():
                return
        except Exception as err:  # not up yet: connection refused, 403 during bootstrap ...
            last = err
        time.sleep(interval_s)
    raise TimeoutError(f"{what} not ready after {timeout_s:.0f}s: {last}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@dataclass
class Pki:
    """A throw-away CA, the apiserver's serving certificate, client certificates and SA keys."""

    directory: Path

    def path(self, name: str) -> str:
        return str(self.directory / name)

    def generate(self, clients: dict[str, tuple[str, str]]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=fgpu-test-ca",
                 "-keyout", self.path("ca.key"), "-out", self.path("ca.crt"))  # fmt: skip
        san = "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default.svc"
        self._sign("apiserver", "/CN=kube-apiserver", extension=san)
        for name, (common_name, organization) in clients.items():
            self.sign_client(name, common_name, organization)
        _openssl("genrsa", "-out", self.path("sa.key"), "2048")
        _openssl("rsa", "-in", self.path("sa.key"), "-pubout", "-out", self.path("sa.pub"))

    def sign_client(self, name: str, common_name: str, organization: str = "") -> None:
        """A client certificate `<name>.crt` signed by the CA (e.g. a node's credentials)."""
        subject = f"/CN={common_name}" + (f"/O={organization}" if organization else "")
        self._sign(name, subject, extension="extendedKeyUsage=clientAuth")

    def sign_server(self, name: str, common_name: str, addresses: str) -> None:
        """A serving certificate `<name>.crt` for `addresses` (a subjectAltName list, e.g. IP:127.0.0.1)."""
        self._sign(name, f"/CN={common_name}", extension=f"subjectAltName={addresses}")

    def _sign(self, name: str, subject: str, extension: str) -> None:
        extfile = self.directory / f"{name}.ext"
        extfile.write_text(extension + "\n")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subject,
                 "-keyout", self.path(f"{name}.key"), "-out", self.path(f"{name}.csr"))  # fmt: skip
        _openssl("x509", "-req", "-in", self.path(f"{name}.csr"), "-CA", self.path("ca.crt"),
                 "-CAkey", self.path("ca.key"), "-CAcreateserial", "-days", "2",
                 "-extfile", str(extfile), "-out", self.path(f"{name}.crt"))  # fmt: skip


def write_kubeconfig(path: Path, server: str, pki: Pki, user: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fgpu-test", "cluster": {"server": server, "certificate-authority": pki.path("ca.crt")}}],
        "users": [
            {
                "name": user,
                "user": {"client-certificate": pki.path(f"{user}.crt"), "client-key": pki.path(f"{user}.key")},
            }
        ],
        "contexts": [{"name": "fgpu-test", "context": {"cluster": "fgpu-test", "user": user}}],
        "current-context": "fgpu-test",
    }
    path.write_text(json.dumps(config, indent=2))
    return path


def node_object(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    capacity = {"cpu": "64", "memory": "512Gi", "pods": "110", "ephemeral-storage": "1Ti"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", **(labels or {})},
        },
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "fake node"}],
        },
    }


@dataclass
class Cluster:
    workdir: Path
    binaries: Path | None = None
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    kubeconfig: Path | None = None
    pki: Pki | None = None
    outlive_parent: bool = False  # `harness up` leaves the control plane running after it exits

    def start(self) -> Cluster:
        try:
            return self._start()
        except BaseException:
            self.stop()  # no leftover processes from a failed start
            raise

    def _start(self) -> Cluster:
        started = time.monotonic()
        binaries = self.binaries or build_binaries()
        self.workdir.mkdir(parents=True, exist_ok=True)
        logs = self.workdir / "logs"
        logs.mkdir(exist_ok=True)
        self.binaries = binaries
        pki = self.pki = Pki(self.workdir / "pki")
        pki.generate(
            {
                "admin": ("fgpu-admin", "system:masters"),
                "controller-manager": ("system:kube-controller-manager", ""),
                "scheduler": ("system:kube-scheduler", ""),
                "kubelet-client": ("kube-apiserver-kubelet-client", ""),
            }
        )
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        server = f"https://127.0.0.1:{api_port}"
        self.kubeconfig = write_kubeconfig(self.workdir / "admin.kubeconfig", server, pki, "admin")
        kcm_config = write_kubeconfig(self.workdir / "controller-manager.kubeconfig", server, pki, "controller-manager")
        scheduler_config = write_kubeconfig(self.workdir / "scheduler.kubeconfig", server, pki, "scheduler")

        self._spawn("etcd", [str(binaries / "etcd"), f"--data-dir={self.workdir / 'etcd'}",
                             f"--listen-client-url=http://127.0.0.1:{etcd_port}",
                             f"--listen-peer-url=http://127.0.0.1:{peer_port}"], logs)  # fmt: skip
        self._spawn("kube-apiserver", [
            str(binaries / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={api_port}",
            f"--tls-cert-file={pki.path('apiserver.crt')}", f"--tls-private-key-file={pki.path('apiserver.key')}",
            f"--client-ca-file={pki.path('ca.crt')}",
            f"--service-account-key-file={pki.path('sa.pub')}",
            f"--service-account-signing-key-file={pki.path('sa.key')}",
            "--service-account-issuer=https://kubernetes.default.svc",
            "--authorization-mode=Node,RBAC",
            # kubectl logs/exec: the apiserver reaches a real node's kubelet at its InternalIP.
            f"--kubelet-client-certificate={pki.path('kubelet-client.crt')}",
            f"--kubelet-client-key={pki.path('kubelet-client.key')}",
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            "--service-cluster-ip-range=10.96.0.0/24",
            # No kube-proxy here: webhooks (fgpu's admission webhook) are called at their Service's
            # endpoint addresses, the pods' own, which the host reaches through the node's bridge.
            "--enable-aggregator-routing=true",
            f"--feature-gates={FEATURE_GATES}", f"--runtime-config={RUNTIME_CONFIG}",
            # As kubeadm and managed clusters do: DRA drivers (fgpu's DaemonSet) run privileged.
            "--allow-privileged=true",
            "--enable-priority-and-fairness=false", "--profiling=false", "--endpoint-reconciler-type=none",
        ], logs)  # fmt: skip
        self._wait_for_apiserver()
        self._spawn("kube-controller-manager", [
            str(binaries / "kube-controller-manager"),
            f"--kubeconfig={kcm_config}", "--leader-elect=false", "--secure-port=0",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki.path('sa.key')}", f"--root-ca-file={pki.path('ca.crt')}",
            # No kubelet heartbeats here: the node lifecycle controller would taint the fake nodes.
            "--controllers=*,-node-lifecycle-controller,-node-ipam-controller",
            f"--feature-gates={FEATURE_GATES}",
        ], logs)  # fmt: skip
        self._spawn("kube-scheduler", [
            str(binaries / "kube-scheduler"),
            f"--kubeconfig={scheduler_config}", "--leader-elect=false", "--secure-port=0",
            f"--feature-gates={FEATURE_GATES}",
        ], logs)  # fmt: skip
        self._wait_for_default_service_account()
        log.info("control plane up in %.1fs: %s", time.monotonic() - started, self.kubeconfig)
        return self

    def _spawn(self, name: str, argv: list[str], logs: Path) -> None:
        self.processes[name] = spawn(argv, logs / f"{name}.log", outlive_parent=self.outlive_parent)

    def _check_alive(self) -> None:
        check_alive(self.processes, self.workdir / "logs")

    @property
    def discovery_cache(self) -> str:
        """Where a DynamicClient of this cluster keeps its discovery cache: by default it writes
        /tmp/osrcp-<hash of the server's URL>.json, leaves it behind, and a later cluster on the
        same port would read this one's."""
        return str(self.workdir / "discovery-cache.json")

    def api_client(self) -> kubernetes.client.ApiClient:
        configuration = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=str(self.kubeconfig), client_configuration=configuration)
        configuration.retries = False
        return kubernetes.client.ApiClient(configuration)

    def _poll(self, what: str, probe: Any) -> None:
        poll_until(what, probe, START_TIMEOUT_S, self._check_alive)

    def _wait_for_apiserver(self) -> None:
        client = self.api_client()

        def ready() -> bool:
            response = client.call_api("GET", f"{client.configuration.host}/readyz", _request_timeout=2)
            return response.status == 200

        self._poll("kube-apiserver", ready)

    def _wait_for_default_service_account(self) -> None:
        core = kubernetes.client.CoreV1Api(self.api_client())
        self._poll("default service account", lambda: core.read_namespaced_service_account("default", "default"))

    def add_node(self, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
        core = kubernetes.client.CoreV1Api(self.api_client())
        created = core.create_node(node_object(name, labels))
        core.patch_node_status(name, {"status": node_object(name)["status"]})
        # The TaintNodesByCondition admission plugin taints new nodes not-ready; the node lifecycle
        # controller would lift it on the first heartbeat, but fake nodes have no kubelet.
        core.patch_node(name, {"spec": {"taints": None}})
        return created.to_dict()

    def stop(self) -> None:
        # One at a time, in reverse start order: the apiserver shuts down slowly once etcd is gone.
        for name in reversed(list(self.processes)):
            stop_process(self.processes.pop(name))


def _cmd_up(args: argparse.Namespace) -> int:
    if (RUN_DIR / "pids.json").exists():
        print(f"a cluster seems to be running ({RUN_DIR}); run 'down' first", file=sys.stderr)
        return 1
    cluster = Cluster(RUN_DIR, outlive_parent=True).start()
    for i in range(args.nodes):
        cluster.add_node(f"node-{i}")
    (RUN_DIR / "pids.json").write_text(json.dumps({n: p.pid for n, p in cluster.processes.items()}))
    print(cluster.kubeconfig)
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _terminate(pid: int, grace_s: float = 15.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _cmd_down(_: argparse.Namespace) -> int:
    pids_file = RUN_DIR / "pids.json"
    if not pids_file.exists():
        print("no cluster running", file=sys.stderr)
        return 0
    pids = json.loads(pids_file.read_text())
    for pid in reversed(list(pids.values())):
        _terminate(pid)
    subprocess.run(["rm", "-rf", str(RUN_DIR)], check=True)
    print("cluster stopped")
    return 0


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(prog="python -m testbed.cluster.harness")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start a control plane with fake nodes; prints the kubeconfig")
    up.add_argument("--nodes", type=int, default=2)
    up.set_defaults(func=_cmd_up)
    commands.add_parser("down", help="stop the control plane started by 'up'").set_defaults(func=_cmd_down)
    args = parser.parse_args()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
