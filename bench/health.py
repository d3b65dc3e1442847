"""Benchmark: from a fault injected into a mock GPU to its taint visible in the API server.

The real `fgpu kubelet-plugin` process against the test bed's kube-apiserver; each round injects an
XID 79 on the next GPU (as `fgpu mock fault` does), polls the slices until that GPU's device is
tainted, then clears the fault (as `fgpu health clear` does) and waits until the taints are gone.

  python -m bench.health --injections 20
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import kubernetes

from driver.node.health.record import HealthRecord
from driver.nvml.machine import load_machine
from driver.nvml.mock import MockNvml
from driver.nvml.session import MOCK_STATE_ENV
from testbed.cluster.harness import Cluster
from testbed.plugin_process import PluginUnderTest

NODE = "node-a"
POLL_S = 0.01


def tainted(resource: kubernetes.client.ResourceV1Api) -> set[str]:
    slices = resource.list_resource_slice(field_selector=f"spec.nodeName={NODE}").items
    return {d.name for s in slices for d in s.spec.devices or [] if d.taints}


def wait(condition, timeout_s: float = 30.0) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError("condition not met in time")
        time.sleep(POLL_S)
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--injections", type=int, default=20)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fgpu-bench-health-", dir="/tmp"))
    cluster = Cluster(root / "cluster").start()
    plugin = None
    try:
        cluster.add_node(NODE)
        resource = kubernetes.client.ResourceV1Api(cluster.api_client())
        state = root / "gpus.json"
        plugin = PluginUnderTest(
            node=NODE, kubeconfig=str(cluster.kubeconfig), root=root, extra_env={MOCK_STATE_ENV: str(state)},
            extra_args=["--offer=whole"],
        ).start()  # fmt: skip
        wait(lambda: resource.list_resource_slice(field_selector=f"spec.nodeName={NODE}").items)
        gpus = MockNvml(load_machine("dgx-h100"), state)
        gpus.nvmlInit()
        record = HealthRecord(plugin.state_dir)
        seconds = []
        for round_ in range(args.injections):
            gpu = round_ % 8
            gpus.inject_xid(gpu, 79)
            started = time.monotonic()
            wait(lambda gpu=gpu: f"gpu-{gpu}" in tainted(resource))
            seconds.append(time.monotonic() - started)
            record.clear()
            wait(lambda: not tainted(resource))
        ordered = sorted(seconds)
        print(
            json.dumps(
                {
                    "injections": len(seconds),
                    "p50_s": round(statistics.median(ordered), 3),
                    "p99_s": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 3),
                    "max_s": round(ordered[-1], 3),
                }
            )
        )
    finally:
        if plugin is not None:
            plugin.stop()
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
