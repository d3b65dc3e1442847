"""Benchmark: prepare+unprepare of whole-GPU claims over the plugin's real DRA socket.

Two set-ups, both with the durable checkpoint (fsync per batch) and mock dgx-h100 GPUs:
- `--api memory`: the plugin process reads claims from an in-memory API, so the figures exclude
  the claim GET;
- `--api cluster`: the real `fgpu kubelet-plugin` process against the real kube-apiserver of the
  test bed, so every first prepare includes the GET.
Callers are separate processes (no shared GIL with the plugin or each other), each looping
prepare(claim) -> unprepare(claim) over its own claims.

  python -m bench.prepare_latency --api memory --callers 1 8 32 --seconds 10
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tests.plugin_process import PluginUnderTest

NODE = "node-a"


def claim_refs(count: int) -> list[dict[str, str]]:
    return [{"namespace": "bench", "name": f"claim-{i}", "uid": str(uuid.uuid4())} for i in range(count)]


def serve_in_memory(root: str, claims_json: str) -> None:
    """Child process: the real plugin services over real sockets, with an in-memory API."""
    from driver.plugin.server import PluginProcess
    from driver.settings import PluginSettings
    from driver.sharing import SharingConfig
    from tests.fakes import InMemoryKubeApi, allocated_claim, node_object, result

    api = InMemoryKubeApi()
    api.nodes[NODE] = node_object(NODE)
    for i, ref in enumerate(json.loads(claims_json)):
        api.claims[(ref["namespace"], ref["name"])] = allocated_claim(
            ref["namespace"], ref["name"], ref["uid"], [result(f"gpu-{i % 8}", pool=NODE)]
        )
    base = Path(root)
    settings = PluginSettings(
        driver_name="gpu.fgpu.dev", node_name=NODE, registrar_dir=base / "registry", plugin_dir=base / "plugin",
        cdi_dir=base / "cdi", state_dir=base / "plugin", nvml="mock:dgx-h100", kubeconfig=None,
        driver_root=Path("/nonexistent"), healthcheck_port=-1, sharing=SharingConfig(),
    )  # fmt: skip
    PluginProcess(settings, api=api).serve_until_signal()


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


def run(callers: int, seconds: float, socket_root: str, claims: list[dict[str, str]]) -> dict[str, float]:
    context = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue = context.Queue()
    share = len(claims) // callers
    workers = [
        context.Process(target=caller, args=(socket_root, claims[i * share : (i + 1) * share], seconds, out))
        for i in range(callers)
    ]
    for worker in workers:
        worker.start()
    reports = [out.get(timeout=seconds + 120) for _ in workers]
    for worker in workers:
        worker.join()
    prepare = [v for r in reports for v in r["prepare"]]
    unprepare = [v for r in reports for v in r["unprepare"]]
    return {
        "callers": callers,
        "claims_per_s": sum(r["pairs"] for r in reports) / seconds,
        "prepare_p50_ms": statistics.median(prepare),
        "prepare_p99_ms": percentile(prepare, 99),
        "unprepare_p50_ms": statistics.median(unprepare),
        "unprepare_p99_ms": percentile(unprepare, 99),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--api", choices=["memory", "cluster"], default="memory")
    parser.add_argument("--callers", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--claims-per-caller", type=int, default=16)
    args = parser.parse_args()
    total = max(args.callers) * args.claims_per_caller

    root = tempfile.mkdtemp(prefix="fgpu-bench-", dir="/tmp")
    cluster = None
    if args.api == "memory":
        claims = claim_refs(total)
        server = multiprocessing.get_context("spawn").Process(target=serve_in_memory, args=(root, json.dumps(claims)))
        server.start()
        plugin = PluginUnderTest(node=NODE, kubeconfig="", root=Path(root))
        plugin.process = None
        deadline = time.monotonic() + 20
        while not plugin.dra_socket.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        import kubernetes

        from tests.claims_api import create_claim
        from tests.cluster.harness import Cluster

        cluster = Cluster(Path(root) / "cluster").start()
        cluster.add_node(NODE)
        resource = kubernetes.client.ResourceV1Api(cluster.api_client())
        kubernetes.client.CoreV1Api(cluster.api_client()).create_namespace({"metadata": {"name": "bench"}})
        claims = [create_claim(resource, devices=[("gpu", f"gpu-{i % 8}")], namespace="bench") for i in range(total)]
        plugin = PluginUnderTest(node=NODE, kubeconfig=str(cluster.kubeconfig), root=Path(root)).start()
    try:
        for callers in args.callers:
            print(json.dumps({"api": args.api, **run(callers, args.seconds, root, claims)}), flush=True)
    finally:
        if args.api == "memory":
            server.terminate()
            server.join()
        else:
            plugin.stop()
            cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
