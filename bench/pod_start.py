"""Benchmark: pod-with-claim start latency on the real node (kube-scheduler, kubelet and containerd
from upstream, `fgpu kubelet-plugin` on mock dgx-h100 GPUs), per kind of device.

One pod at a time on an otherwise idle node: create a ResourceClaim, then a pod that uses it; the
latency runs from the claim's creation to the pod reported Running (its container started), seen
through a watch. Then the pod and claim go, and the next starts once the claim is unprepared. Next
to it, the part that is NodePrepareResources: kubelet's own
`dra_operations_duration_seconds{operation_name="PrepareResources"}` (mean from its sum and
count; its buckets start at 100 ms) and our plugin's per-claim duration from its INFO line.

  python -m bench.pod_start --pods 20 [--kinds whole mig mps timeslice]   # needs root
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import sys
import time
import uuid
from typing import Any

import kubernetes
from prometheus_client.parser import text_string_to_metric_families

from testbed.cluster.node import RealNode
from testbed.local_cluster import local_cluster
from testbed.node_plugin import NodePlugin
from testbed.workloads import claim_template, pod, wait_until

NS = "default"
KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "whole": ("gpu.fgpu.dev", {}),
    "mig": ("mig.gpu.fgpu.dev", {"selector": 'device.attributes["gpu.fgpu.dev"].profile == "1g.10gb"'}),
    "mps": ("mps.gpu.fgpu.dev", {"capacity": {"memory": "4Gi", "compute": "20"}}),
    "timeslice": ("timeslice.gpu.fgpu.dev", {"capacity": {"memory": "4Gi"}}),
}
PREPARED_LINE = re.compile(r"prepared claim [^/]+/(\S+) \(uid \S+\) in (\d+) ms")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def kubelet_prepare_totals(core: kubernetes.client.CoreV1Api, node: str) -> tuple[float, float]:
    """(sum of seconds, count) of kubelet's successful PrepareResources so far."""
    text = core.connect_get_node_proxy_with_path(node, "metrics")
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != "dra_operations_duration_seconds":
            continue
        for sample in family.samples:
            labels = sample.labels
            if labels.get("operation_name") == "PrepareResources" and labels.get("is_error") == "false":
                if sample.name.endswith("_sum"):
                    total = sample.value
                elif sample.name.endswith("_count"):
                    count = sample.value
    return total, count


def claim(name: str, device_class: str, args: dict[str, Any]) -> dict[str, Any]:
    spec = claim_template(name, device_class, **args)["spec"]["spec"]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name}, "spec": spec}


def one_pod(client: kubernetes.client.ApiClient, node: RealNode, plugin: NodePlugin, kind: str) -> float:
    """Seconds from creating the claim to the pod Running; the pod and claim are gone afterwards."""
    core = kubernetes.client.CoreV1Api(client)
    resource = kubernetes.client.ResourceV1Api(client)
    name = f"{kind}-{uuid.uuid4().hex[:6]}"
    manifest = pod(name, node.name, template="unused")
    manifest["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": name}]
    watch = kubernetes.watch.Watch()
    started = time.monotonic()
    resource.create_namespaced_resource_claim(NS, claim(name, *KINDS[kind]))
    core.create_namespaced_pod(NS, manifest)
    latency = None
    for event in watch.stream(core.list_namespaced_pod, NS, field_selector=f"metadata.name={name}", timeout_seconds=90):
        if event["object"].status.phase == "Running":
            latency = time.monotonic() - started
            watch.stop()
    if latency is None:
        raise RuntimeError(f"pod {name} did not start within 90s")
    uid = resource.read_namespaced_resource_claim(name, NS).metadata.uid
    core.delete_namespaced_pod(name, NS, grace_period_seconds=0)
    wait_until(f"claim {name} unprepared", lambda: not list(plugin.cdi_dir.glob(f"*{uid}*")))
    resource.delete_namespaced_resource_claim(name, NS)
    return latency


def measure(client: kubernetes.client.ApiClient, node: RealNode, plugin: NodePlugin, kind: str, pods: int) -> dict:
    core = kubernetes.client.CoreV1Api(client)
    kubelet_before = kubelet_prepare_totals(core, node.name)
    latencies = [one_pod(client, node, plugin, kind) for _ in range(pods)]
    kubelet_after = kubelet_prepare_totals(core, node.name)
    ours = [int(ms) for name, ms in PREPARED_LINE.findall(plugin.logs()) if name.startswith(f"{kind}-")]
    kubelet_count = kubelet_after[1] - kubelet_before[1]
    return {
        "kind": kind,
        "pods": pods,
        "start_p50_s": round(percentile(latencies, 0.5), 3),
        "start_p95_s": round(percentile(latencies, 0.95), 3),
        "kubelet_prepare_mean_ms": round(1000 * (kubelet_after[0] - kubelet_before[0]) / kubelet_count, 1)
        if kubelet_count
        else None,
        "plugin_prepare_p50_ms": statistics.median(ours) if ours else None,
        "plugin_prepare_p95_ms": percentile(ours, 0.95) if ours else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pods", type=int, default=20)
    parser.add_argument("--kinds", nargs="+", choices=sorted(KINDS), default=list(KINDS))
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench.pod_start needs root: it runs a real kubelet and containerd", file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.WARNING)
    with local_cluster(purpose="bench-") as local:
        for kind in args.kinds:
            print(json.dumps(measure(local.client, local.node, local.plugin, kind, args.pods)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
