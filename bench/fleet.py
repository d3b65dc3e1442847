"""A kwok fleet through the real control plane (issue 40): N kwok nodes x 8 mock H100, their
devices published by `fgpu simulate-fleet` (the plugin's slice code, from the dgx-h100 profile),
then in one run: kube-scheduler alone allocating and binding P pods, each with a one-GPU claim from
a ResourceClaimTemplate; everything deleted; `fgpu controller` started against the fleet (time to
ready: its caches synced and the ledger built, from its log) and the same P pods, opted in. kwok
runs the pods (Running); nothing is prepared. Reported per path: pods bound per second, claim
created -> allocated p50/p99 (bench/controller.py's phase), CPU seconds of each component; and
the fleet's publish time, kube-apiserver's and the controller's memory.

The defaults are KAI-Scheduler's published scale test's shape (500 kwok nodes, 4,000 single-GPU
jobs placed: 6 m 38 s there). kwok renews each node's Lease every 150 s here (40 s in the tests).

  python -m bench.fleet                                  # 500 nodes, 4,000 pods
  python -m bench.fleet --nodes 5000 --pods 10000 --offer whole
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import kubernetes

from bench.allocator import classes
from bench.controller import UnthrottledCluster, memory_kib, run_phase, wait_until
from driver.fleet.machine_types import MachineType, machine_inventory
from driver.inventory.slices import build_slices
from testbed.cluster.harness import spawn, stop_process
from testbed.cluster.kwok_manager import Kwok

FLEET_LEASE_S = 600


def fleet_slices(resource: kubernetes.client.ResourceV1Api) -> int:
    listed = resource.list_resource_slice(label_selector="gpu.fgpu.dev/published-by", _preload_content=False)
    return len(json.loads(listed.data)["items"])


def reported(result: dict[str, Any]) -> dict[str, Any]:
    print(json.dumps(result), flush=True)
    return result


def start_fleet(kubeconfig: Path, log: Path, *flags: str) -> subprocess.Popen[bytes]:
    """`fgpu simulate-fleet` (with `flags`): the fleet's slices published for its kwok nodes."""
    argv = [sys.executable, "-m", "driver.cli", "--log-level=WARNING", "simulate-fleet", f"--kubeconfig={kubeconfig}"]
    return spawn([*argv, *flags], log)


def start_controller(kubeconfig: Path, log: Path, *flags: str) -> tuple[subprocess.Popen[bytes], float]:
    """The controller (with `flags` besides its own), and the seconds from its start to its caches
    synced and ledger built."""
    argv = [sys.executable, "-m", "driver.cli", "--log-level=INFO", "controller", f"--kubeconfig={kubeconfig}",
            "--lease-namespace=default", "--identity=bench", *flags]  # fmt: skip
    started = time.monotonic()
    process = spawn(argv, log)
    wait_until(lambda: "caches synced" in log.read_text(), 600, "controller caches synced")
    return process, time.monotonic() - started


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The results, each printed as it comes (a later failure keeps the earlier figures)."""
    requests = [{"deviceClassName": "gpu.fgpu.dev"}] * args.pods
    with tempfile.TemporaryDirectory() as workdir:
        cluster = UnthrottledCluster(Path(workdir) / "cluster").start()
        kwok = Kwok(cluster, Path(workdir) / "kwok", lease_s=FLEET_LEASE_S)
        processes: list[subprocess.Popen[bytes]] = []
        try:
            client = cluster.api_client()
            for document in classes():
                kubernetes.utils.create_from_dict(client, document)
            resource = kubernetes.client.ResourceV1Api(client)
            kwok.start()
            started = time.monotonic()
            names = [f"kwok-{i:05d}" for i in range(args.nodes)]
            kwok.add_nodes(names, "dgx-h100", tainted=False)
            nodes_ready_s = time.monotonic() - started
            processes.append(start_fleet(cluster.kubeconfig, Path(workdir) / "fleet.log", f"--offer={args.offer}"))
            published = time.monotonic()
            per_node = len(
                build_slices("gpu.fgpu.dev", "n", machine_inventory(MachineType("dgx-h100", args.offer)), 1, None)
            )
            wait_until(lambda: fleet_slices(resource) >= per_node * args.nodes, 1800, "the fleet's slices")
            fleet_publish_s = time.monotonic() - published
            fleet_memory = memory_kib(processes[0].pid)
            results: list[dict[str, Any]] = [{
                "nodes": args.nodes, "gpus": args.nodes * 8, "offer": args.offer, "slices": per_node * args.nodes,
                "kwok_nodes_ready_s": round(nodes_ready_s, 1), "fleet_publish_s": round(fleet_publish_s, 1),
                "fleet_publisher_rss_mib": round(fleet_memory["VmRSS"] / 1024),
            }]  # fmt: skip
            reported(results[0])
            results.append(reported(run_phase(cluster, "scheduler", requests, None)))
            controller, ready_s = start_controller(cluster.kubeconfig, Path(workdir) / "controller.log")
            processes.append(controller)
            results.append(reported({"controller_ready_s": round(ready_s, 1)}))
            results.append(reported(run_phase(cluster, "controller", requests, controller.pid)))
            results.append({
                "controller_rss_mib": round(memory_kib(controller.pid)["VmRSS"] / 1024),
                "controller_peak_rss_mib": round(memory_kib(controller.pid)["VmHWM"] / 1024),
                "kube_apiserver_rss_mib": round(memory_kib(cluster.processes["kube-apiserver"].pid)["VmRSS"] / 1024),
                "etcd_rss_mib": round(memory_kib(cluster.processes["etcd"].pid)["VmRSS"] / 1024),
                "cores": os.cpu_count(),
            })  # fmt: skip
            reported(results[-1])
        finally:
            for process in reversed(processes):
                stop_process(process, grace_s=60)
            kwok.stop()
            cluster.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--pods", type=int, default=4000)
    parser.add_argument("--offer", default="whole", help="what each GPU offers (fgpu simulate-fleet --offer)")
    args = parser.parse_args()
    # SIGTERM ends the run as Ctrl-C does: through the finally blocks that stop what it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = run(args)
    scheduler, controller = results[1], results[3]
    print(json.dumps({"ratio_pods_per_s": round(controller["pods_per_s"] / scheduler["pods_per_s"], 2)}))


if __name__ == "__main__":
    main()
