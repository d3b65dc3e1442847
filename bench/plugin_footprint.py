"""Benchmark: the node plugin's footprint, idle on a mock DGX H100 (8 GPUs, 224 devices published).

Each run starts `python -m driver.cli kubelet-plugin --nvml=mock:dgx-h100` as a real process, its
state, CDI and registrar directories in a temp dir, its health and metrics ports on (as the chart
has them), and measures:
- start: exec -> the registration socket accepting a connection (what kubelet waits for; the DRA
  socket is bound before it), and the CPU time the plugin used until then (less load-dependent);
- idle: after registering it as kubelet does and seeing its ResourceSlices published, `--idle-s`
  seconds later, VmRSS, VmHWM (the peak) and Threads from /proc/<pid>/status.

The API server (`--api`):
- `stub` (default): an HTTP server in this process speaking the few requests the plugin makes at
  start and idle (Node GET, ResourceSlice list/watch/create/replace/delete, the claim list, Events)
  over testbed's in-memory API: the real `kubernetes` client in the plugin, no control plane;
- `cluster`: the test bed's real kube-apiserver (etcd, controller-manager, scheduler: heavier).

With `--imports`, what each import costs instead: a fresh interpreter imports the plugin's heavy
dependencies one after the other (each row the RSS it adds to those above it), then what the
plugin used to hold besides (the client's generated API classes, the allocator).

  python -m bench.plugin_footprint --runs 5 --idle-s 10
  python -m bench.plugin_footprint --api cluster --runs 3
  python -m bench.plugin_footprint --imports
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from driver.kube.errors import KubeError, NotFoundError
from driver.node.sockets import accepts_connections
from testbed.cluster.harness import free_port
from testbed.fakes import InMemoryKubeApi, node_object
from testbed.plugin_process import DRIVER, PluginUnderTest

NODE = "node-a"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
EXPECTED_SLICES = 5  # mock dgx-h100 with every kind offered (tests/integration/test_plugin_process.py)


def _selector(query: dict[str, list[str]]) -> tuple[str, str]:
    """(driver, node) of the plugin's `spec.driver=D,spec.nodeName=N` field selector."""
    fields = dict(part.split("=", 1) for part in query.get("fieldSelector", [""])[0].split(",") if "=" in part)
    return fields.get("spec.driver", ""), fields.get("spec.nodeName", "")


class StubApiHandler(BaseHTTPRequestHandler):
    """The API server's JSON answers to the plugin's requests, over `server.api`; a watch's events
    in chunks, as the API server sends them (the client reads a watch chunk by chunk)."""

    protocol_version = "HTTP/1.1"
    server: StubApiServer

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the benchmark prints figures only."""

    def _send(self, body: Any, status: HTTPStatus = HTTPStatus.OK) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        return json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"null")

    def _answer(self, compute: Any) -> None:
        try:
            self._send(compute())
        except NotFoundError as err:
            self._send({"kind": "Status", "message": str(err), "code": 404}, HTTPStatus.NOT_FOUND)
        except (KubeError, ValueError) as err:
            self._send({"kind": "Status", "message": str(err), "code": 409}, HTTPStatus.CONFLICT)

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        api = self.server.api
        if url.path.startswith("/api/v1/nodes/"):
            self._answer(lambda: api.get_node(url.path.rsplit("/", 1)[1]))
        elif url.path == SLICES and query.get("watch") == ["true"]:
            self._watch(query)
        elif url.path == SLICES:
            items, version = api.list_slices(*_selector(query))
            self._send({"items": items, "metadata": {"resourceVersion": version}})
        elif url.path == "/apis/resource.k8s.io/v1/resourceclaims":
            self._send({"items": api.list_all_claims(), "metadata": {}})
        else:
            self._send({"kind": "Status", "code": 404}, HTTPStatus.NOT_FOUND)

    def _watch(self, query: dict[str, list[str]]) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.close_connection = True
        timeout_s = int(query.get("timeoutSeconds", ["60"])[0])
        events = self.server.api.watch_slices(*_selector(query), query.get("resourceVersion", [""])[0], timeout_s)
        with contextlib.suppress(OSError):  # the plugin closed the watch: it stopped
            for event, obj in events:
                line = json.dumps({"type": event, "object": obj}).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

    def do_POST(self) -> None:
        body = self._body()
        if self.path.startswith(SLICES):
            self._answer(lambda: self.server.api.create_slice(body))
        else:  # an Event
            self._send(body, HTTPStatus.CREATED)

    def do_PUT(self) -> None:
        body = self._body()
        self._answer(lambda: self.server.api.replace_slice(self.path.rsplit("/", 1)[1], body))

    def do_DELETE(self) -> None:
        self._answer(lambda: self.server.api.delete_slice(urlsplit(self.path).path.rsplit("/", 1)[1]))


class StubApiServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), StubApiHandler)
        self.api = InMemoryKubeApi()
        self.api.nodes[NODE] = node_object(NODE)

    def kubeconfig(self, path: Path) -> Path:
        server = f"http://127.0.0.1:{self.server_address[1]}"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "stub", "cluster": {"server": server}}],
            "users": [{"name": "stub", "user": {"token": "stub"}}],
            "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub"}}],
            "current-context": "stub",
        }
        path.write_text(json.dumps(config))  # JSON is YAML
        return path

    def slice_count(self) -> int:
        return len(self.api.list_slices(DRIVER, NODE)[0])

    def delete_slices(self) -> None:
        for name in [s["metadata"]["name"] for s in self.api.list_slices(DRIVER, NODE)[0]]:
            self.api.delete_slice(name)


@dataclass(frozen=True)
class ApiUnderTest:
    """Where the plugin publishes: its kubeconfig, and the node's slices there (counted; deleted
    before each start, as kubelet does, so that every run publishes them)."""

    kubeconfig: str
    slice_count: Callable[[], int]
    delete_slices: Callable[[], None]


@contextlib.contextmanager
def stub_api(root: Path) -> Iterator[ApiUnderTest]:
    server = StubApiServer()
    threading.Thread(target=server.serve_forever, name="stub-api", daemon=True).start()
    try:
        yield ApiUnderTest(str(server.kubeconfig(root / "stub.kubeconfig")), server.slice_count, server.delete_slices)
    finally:
        server.api.close()  # ends the plugin's watch
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def cluster_api(root: Path) -> Iterator[ApiUnderTest]:
    import kubernetes

    from testbed.cluster.harness import Cluster

    cluster = Cluster(root / "cluster").start()
    try:
        cluster.add_node(NODE)
        resource = kubernetes.client.ResourceV1Api(cluster.api_client())
        selector = f"spec.driver={DRIVER},spec.nodeName={NODE}"
        yield ApiUnderTest(
            str(cluster.kubeconfig),
            lambda: len(resource.list_resource_slice(field_selector=selector).items),
            lambda: resource.delete_collection_resource_slice(field_selector=selector),
        )
    finally:
        cluster.stop()


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM in kB, Threads, from /proc/<pid>/status."""
    figures = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "Threads"):
            figures[key] = int(value.split()[0])
    return figures


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) the process has used: its start's cost, whatever the machine's load."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_until(what: str, done: Callable[[], bool], plugin: PluginUnderTest, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert plugin.process is not None
        if plugin.process.poll() is not None:
            raise RuntimeError(f"plugin exited with {plugin.process.returncode}:\n{plugin.logs()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s}s:\n{plugin.logs()}")
        time.sleep(0.005)


def measure(api: ApiUnderTest, idle_s: float) -> dict[str, float | int]:
    """One plugin's start times (s) and idle footprint (RSS in MB of 10^6 bytes, as the issue's
    figure is); its temp dir removed after."""
    api.delete_slices()
    # As the chart runs it: its gRPC health port (the probes) and its metrics port, each a server.
    ports = [f"--healthcheck-port={free_port()}", f"--metrics-port={free_port()}"]
    plugin = PluginUnderTest(node=NODE, kubeconfig=api.kubeconfig, extra_args=ports)
    try:
        started = time.perf_counter()
        plugin.start(wait=False)
        wait_until("registration socket", lambda: accepts_connections(plugin.registration_socket), plugin)
        registration_s = time.perf_counter() - started
        assert plugin.process is not None
        registration_cpu_s = cpu_seconds(plugin.process.pid)
        plugin.register()
        wait_until("slices published", lambda: api.slice_count() == EXPECTED_SLICES, plugin)
        time.sleep(idle_s)
        status = proc_status(plugin.process.pid)
        return {
            "start_to_registration_s": round(registration_s, 3),
            "cpu_to_registration_s": round(registration_cpu_s, 2),
            "idle_rss_mb": round(status["VmRSS"] * 1024 / 1e6, 1),
            "peak_rss_mb": round(status["VmHWM"] * 1024 / 1e6, 1),
            "threads": status["Threads"],
        }
    finally:
        plugin.stop()
        shutil.rmtree(plugin.root, ignore_errors=True)


# In the plugin's order: what it needs, then what it no longer imports (tests/unit/node/test_lean_start.py).
IMPORTS = (
    "grpc", "google.protobuf.descriptor_pb2", "urllib3", "yaml", "prometheus_client", "kubernetes",
    "driver.node.server", "driver.cli.main",
    "kubernetes.client.api.resource_v1_api", "kubernetes.client.api.core_v1_api", "driver.allocator.scoring",
)  # fmt: skip
RSS_PER_IMPORT = """
import importlib, json, sys
def rss_kib():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS"))
before = rss_kib()
print(json.dumps({"module": "(interpreter)", "rss_mib": round(before / 1024, 1)}))
for name in sys.argv[1:]:
    importlib.import_module(name)
    now = rss_kib()
    print(json.dumps({"module": name, "adds_mib": round((now - before) / 1024, 1), "rss_mib": round(now / 1024, 1)}))
    before = now
"""


def import_costs() -> None:
    subprocess.run([sys.executable, "-c", RSS_PER_IMPORT, *IMPORTS], check=True)


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (the machine is shared)."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--api", choices=["stub", "cluster"], default="stub")
    parser.add_argument("--runs", type=int, default=5, help="plugin starts; figures are their medians")
    parser.add_argument("--idle-s", type=float, default=10.0, help="idle this long after publishing, then measure")
    parser.add_argument("--imports", action="store_true", help="the RSS each heavy import adds, and nothing else")
    args = parser.parse_args()
    if args.imports:
        import_costs()
        return
    root = Path(tempfile.mkdtemp(prefix="fgpu-bench-", dir="/tmp"))
    try:
        with (stub_api if args.api == "stub" else cluster_api)(root) as api:
            runs = []
            for _ in range(args.runs):
                runs.append(measure(api, args.idle_s))
                print(json.dumps({"run": len(runs), "load": load_average(), **runs[-1]}), flush=True)
        medians = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        print(json.dumps({"api": args.api, "runs": args.runs, "idle_s": args.idle_s, "median": medians}), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
