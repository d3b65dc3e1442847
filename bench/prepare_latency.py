"""Benchmark: prepare+unprepare of claims over the plugin's real DRA socket, per kind of device.

Two set-ups, both with the durable checkpoint (fsync per batch) and mock dgx-h100 GPUs:
- `--api memory`: the plugin process reads claims from an in-memory API, so the figures exclude
  the claim GET;
- `--api cluster`: the real `fgpu kubelet-plugin` process against the real kube-apiserver of the
  test bed, so every first prepare includes the GET.
Callers are separate processes (no shared GIL with the plugin or each other), each looping
prepare(claim) -> unprepare(claim) over its own claims.

With `--kind mig|mps|timeslice|mig-mps` (in-memory API) each caller cycles one MIG placement or
share on its own GPU; for shares a resident share per GPU keeps the MPS daemon (the timeslice
setting, the 3g.40gb partition and its daemon) up, so the figures are the steady-state cost of one
more share. `--kind mig-mps-first` has no resident share: each cycle is a partition's first share
(partition and daemon made) and last (both gone).

  python -m bench.prepare_latency --api memory --callers 1 8 32 --seconds 10
  python -m bench.prepare_latency --api memory --kind mps --callers 1 8 --seconds 10

With `--metrics-port P` (in-memory API) the plugin serves its Prometheus metrics there and this
process scrapes them every second during the run (15-60 s is usual): the cost of the metrics.
`--no-health-monitor` runs the plugin without its health monitor: the cost of the monitor.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

from driver.nvml.session import MOCK_STATE_ENV
from testbed.node_env import fake_tools_env, stop_fake_daemons
from testbed.plugin_process import PluginUnderTest

NODE = "node-a"


KIND_DEVICE = {
    "whole": lambda caller: f"gpu-{caller % 8}",
    "mig": lambda caller: f"gpu-{caller % 8}-mig-1g10gb-{caller // 8 % 7}",
    "mps": lambda caller: f"gpu-{caller % 8}-mps",
    "timeslice": lambda caller: f"gpu-{caller % 8}-ts",
    # An MPS share inside a 3g.40gb partition: with a resident share (a later share joining the
    # partition and its daemon), and without (the first share: partition and daemon made and gone).
    "mig-mps": lambda caller: f"gpu-{caller % 8}-mig-3g40gb-4-mps",
    "mig-mps-first": lambda caller: f"gpu-{caller % 8}-mig-3g40gb-4-mps",
}
SHARED_KINDS = ("mps", "timeslice", "mig-mps")  # a resident share keeps the daemon (setting, partition) up
MPS_KINDS = ("mps", "mig-mps", "mig-mps-first")


def claim_refs(count: int) -> list[dict[str, str]]:
    return [
        {"namespace": "bench", "name": f"claim-{uuid.uuid4().hex[:12]}", "uid": str(uuid.uuid4())} for _ in range(count)
    ]


def device_result(kind: str, caller: int) -> dict:
    result = {"request": "gpu", "driver": "gpu.fgpu.dev", "pool": NODE, "device": KIND_DEVICE[kind](caller)}
    if kind in (*SHARED_KINDS, *MPS_KINDS):
        result["shareID"] = str(uuid.uuid4())
        result["consumedCapacity"] = {"memory": "4Gi", "compute": "10"} if kind in MPS_KINDS else {"memory": "4Gi"}
    return result


def serve_in_memory(root: str, claims_json: str, metrics_port: int, health_monitor: bool) -> None:
    """Child process: the real plugin services over real sockets, with an in-memory API."""
    from driver.inventory.sharing import ALL_KINDS, SharingConfig
    from driver.node.server import run_plugin
    from driver.node.settings import PluginSettings, default_driver_root
    from testbed.fakes import InMemoryKubeApi, allocated_claim, node_object

    api = InMemoryKubeApi()
    api.nodes[NODE] = node_object(NODE)
    for ref in json.loads(claims_json):
        api.claims[(ref["namespace"], ref["name"])] = allocated_claim(
            ref["namespace"], ref["name"], ref["uid"], [ref["result"]]
        )
    base = Path(root)
    settings = PluginSettings(
        driver_name="gpu.fgpu.dev", node_name=NODE, registrar_dir=base / "registry", plugin_dir=base / "plugin",
        cdi_dir=base / "cdi", state_dir=base / "plugin", nvml="mock:dgx-h100", kubeconfig=None,
        driver_root=default_driver_root("mock:dgx-h100", base / "plugin"), healthcheck_port=-1,
        sharing=SharingConfig(default=ALL_KINDS, mig_share_profiles=frozenset({"3g.40gb"})),
        metrics_port=metrics_port,
        health_monitor=health_monitor,
    )  # fmt: skip
    run_plugin(settings, api)


def caller(socket_root: str, claims: list[dict[str, str]], seconds: float, out: multiprocessing.Queue) -> None:
    plugin = PluginUnderTest(node=NODE, kubeconfig="", root=Path(socket_root))
    prepare_ms: list[float] = []
    unprepare_ms: list[float] = []
    pairs = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        claim = claims[pairs % len(claims)]
        start = time.perf_counter()
        result = plugin.prepare([claim])[claim["uid"]]
        middle = time.perf_counter()
        errors = plugin.unprepare([claim])
        end = time.perf_counter()
        if result.error or errors[claim["uid"]]:
            raise RuntimeError(result.error or errors[claim["uid"]])
        prepare_ms.append((middle - start) * 1000)
        unprepare_ms.append((end - middle) * 1000)
        pairs += 1
    out.put({"prepare": prepare_ms, "unprepare": unprepare_ms, "pairs": pairs})


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * pct / 100))]


def run(callers: int, seconds: float, socket_root: str, claims: list[list[dict[str, str]]]) -> dict[str, float | int]:
    context = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue = context.Queue()
    workers = [context.Process(target=caller, args=(socket_root, claims[i], seconds, out)) for i in range(callers)]
    for worker in workers:
        worker.start()
    reports = [out.get(timeout=seconds + 120) for _ in workers]
    for worker in workers:
        worker.join()
    prepare = [v for r in reports for v in r["prepare"]]
    unprepare = [v for r in reports for v in r["unprepare"]]
    return {
        "callers": callers,
        "claims_per_s": round(sum(r["pairs"] for r in reports) / seconds, 1),
        "prepare_p50_ms": round(statistics.median(prepare), 2),
        "prepare_p99_ms": round(percentile(prepare, 99), 2),
        "unprepare_p50_ms": round(statistics.median(unprepare), 2),
        "unprepare_p99_ms": round(percentile(unprepare, 99), 2),
    }


def serve_memory_api(
    root: str, kind: str, callers: int, per_caller: int, metrics_port: int, health_monitor: bool
) -> tuple[list[list[dict]], object]:
    """Start the plugin with an in-memory API holding every caller's claims (and a resident
    share per GPU for share kinds); returns the callers' claims and the server process."""
    os.environ.update(fake_tools_env(Path(root)))
    os.environ[MOCK_STATE_ENV] = str(Path(root) / "gpus.json")
    per_caller_claims = [
        [{**ref, "result": device_result(kind, c)} for ref in claim_refs(per_caller)] for c in range(callers)
    ]
    resident = [{**ref, "result": device_result(kind, c)} for c, ref in enumerate(claim_refs(8))]
    everything = [r for claims in per_caller_claims for r in claims] + resident
    server = multiprocessing.get_context("spawn").Process(
        target=serve_in_memory, args=(root, json.dumps(everything), metrics_port, health_monitor)
    )
    server.start()
    plugin = PluginUnderTest(node=NODE, kubeconfig="", root=Path(root))
    deadline = time.monotonic() + 30
    while not plugin.dra_socket.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if kind in SHARED_KINDS:
        strip = [{k: v for k, v in r.items() if k != "result"} for r in resident]
        errors = [r.error for r in plugin.prepare(strip).values() if r.error]
        if errors:
            raise RuntimeError(errors)
    plugin.stop()
    return [[{k: v for k, v in r.items() if k != "result"} for r in claims] for claims in per_caller_claims], server


class Scraper(threading.Thread):
    """Scrapes the plugin's metrics every second, as Prometheus would (more often)."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.durations_ms: list[float] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(1.0):
            start = time.perf_counter()
            try:
                urllib.request.urlopen(self.url, timeout=10).read()
            except OSError:
                continue  # not serving yet
            self.durations_ms.append((time.perf_counter() - start) * 1000)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--api", choices=["memory", "cluster"], default="memory")
    parser.add_argument("--kind", choices=sorted(KIND_DEVICE), default="whole")
    parser.add_argument("--callers", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--claims-per-caller", type=int, default=16)
    parser.add_argument("--metrics-port", type=int, default=-1, help="serve metrics there, scraped every second")
    parser.add_argument(
        "--health-monitor", action=argparse.BooleanOptionalAction, default=True, help="the plugin's health monitor"
    )
    args = parser.parse_args()
    callers = max(args.callers)

    root = tempfile.mkdtemp(prefix="fgpu-bench-", dir="/tmp")
    cluster = None
    try:
        if args.api == "memory":
            claims, server = serve_memory_api(
                root, args.kind, callers, args.claims_per_caller, args.metrics_port, args.health_monitor
            )
        else:
            import kubernetes

            from testbed.claims_api import create_claim
            from testbed.cluster.harness import Cluster

            if args.kind != "whole":
                raise SystemExit("--api cluster measures whole GPUs")
            cluster = Cluster(Path(root) / "cluster").start()
            cluster.add_node(NODE)
            resource = kubernetes.client.ResourceV1Api(cluster.api_client())
            kubernetes.client.CoreV1Api(cluster.api_client()).create_namespace({"metadata": {"name": "bench"}})
            claims = [
                [
                    create_claim(resource, devices=[("gpu", f"gpu-{c % 8}")], namespace="bench")
                    for _ in range(args.claims_per_caller)
                ]
                for c in range(callers)
            ]
            server = PluginUnderTest(node=NODE, kubeconfig=str(cluster.kubeconfig), root=Path(root)).start()
        for count in args.callers:
            scraper = Scraper(args.metrics_port)
            if args.metrics_port > 0:
                scraper.start()
            figures = run(count, args.seconds, root, claims)
            scraper.done.set()
            if scraper.durations_ms:
                figures["scrapes"] = len(scraper.durations_ms)
                figures["scrape_p50_ms"] = round(statistics.median(scraper.durations_ms), 2)
            print(
                json.dumps({"api": args.api, "kind": args.kind, "monitor": args.health_monitor, **figures}), flush=True
            )
    finally:
        if cluster is not None:
            server.stop()
            cluster.stop()
        else:
            server.terminate()
            server.join()
        stop_fake_daemons(Path(root))
        shutil.rmtree(root, ignore_errors=True)  # the machine as it was: no temp dir left


if __name__ == "__main__":
    sys.exit(main())
