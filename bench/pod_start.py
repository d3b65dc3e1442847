"""Benchmark: pod-with-claim start latency on the real node (kube-scheduler, kubelet and containerd
from upstream, `fgpu kubelet-plugin` on mock dgx-h100 GPUs), per kind of device.

One pod at a time on an otherwise idle node: create a ResourceClaim, then a pod that uses it; the
latency runs from the claim's creation to the pod reported Running (its container started), seen
through a watch. Then the pod and claim go, and the next starts once the claim is unprepared. Next
to it, the part that is NodePrepareResources: kubelet's own
`dra_operations_duration_seconds{operation_name="PrepareResources"}` (mean from its sum and
count; its buckets start at 100 ms) and our plugin's per-claim duration from its INFO line.

  python -m bench.pod_start --pods 20 [--kinds whole mig mps timeslice]   # needs root

`--gaps N`: instead, how long kubelet has no registered gpu.fgpu.dev on the node (so that no claim
can be prepared there), N times each: after a crash (SIGKILL, the container back 1.2 s later as
in issue 26, until kubelet registered the new process), and in a rolling update the DaemonSet's
way (a second instance with its own pod UID; the old one gets SIGTERM once the new one is Ready,
i.e. kubelet registered it; `without readiness`: as soon as the new process runs, as the chart
did before its readinessProbe). Times from the plugins' own log lines (kubelet's registration
call, the old one's withdrawal), not from pods: kubelet retries a pod that met no plugin only at
its next sync, a minute later (docs/operations.md).

  python -m bench.pod_start --gaps 5
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import statistics
import sys
import time
import uuid
from datetime import datetime
from typing import Any

import grpc
import kubernetes
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from driver.node.kubelet.liveness import READY_SERVICE
from testbed.cluster.node import RealNode
from testbed.local_cluster import LocalCluster, local_cluster
from testbed.node_plugin import NodePlugin
from testbed.workloads import claim_template, pod, wait_until

NS = "default"
KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "whole": ("gpu.fgpu.dev", {}),
    "mig": ("mig.gpu.fgpu.dev", {"selector": 'device.attributes["gpu.fgpu.dev"].profile == "1g.10gb"'}),
    "mps": ("mps.gpu.fgpu.dev", {"capacity": {"memory": "4Gi", "compute": "20"}}),
    "timeslice": ("timeslice.gpu.fgpu.dev", {"capacity": {"memory": "4Gi"}}),
}
CONTAINER_RESTART_S = 1.2  # a killed plugin's container back (issue 26: 1.1-1.6 s)
LOG_TIME = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?(registered with kubelet|registration withdrawn)", re.M
)
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


def logged_at(plugin: NodePlugin, what: str) -> list[float]:
    """When the plugin logged `what` (wall-clock seconds), in order."""
    return [
        datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for stamp, event in LOG_TIME.findall(plugin.logs())
        if event == what
    ]


def ready(plugin: NodePlugin) -> bool:
    """What the readinessProbe sees: kubelet registered this instance."""
    request = health_pb2.HealthCheckRequest(service=READY_SERVICE)
    try:
        with grpc.insecure_channel(f"unix://{plugin.dra_socket}") as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(request, timeout=2).status
    except grpc.RpcError:
        return False
    return status == health_pb2.HealthCheckResponse.SERVING


def crash_gap(plugin: NodePlugin) -> float:
    """Seconds from the SIGKILL to kubelet's registration of the restarted process."""
    before = plugin.registrations()
    killed = time.time()
    plugin.stop(signal.SIGKILL)
    time.sleep(CONTAINER_RESTART_S)  # kubelet restarting the container
    plugin.start(wait=False)
    wait_until("kubelet registered the restarted plugin", lambda: plugin.registrations() > before, interval=0.02)
    return logged_at(plugin, "registered with kubelet")[-1] - killed


def rollout_gap(node: RealNode, old: NodePlugin, readiness: bool) -> tuple[NodePlugin, float]:
    """The new instance, and seconds kubelet had no registered instance: from the old one's
    withdrawal to the new one's registration (0 where the new one was registered first)."""
    new = NodePlugin.on(node, nvml=old.nvml, uid=str(uuid.uuid4()), sharing_state_of=old)
    new.start(wait=False)
    if readiness:
        wait_until("the new plugin Ready", lambda: ready(new), interval=0.02)
    old.stop(signal.SIGTERM)  # the DaemonSet controller deletes the old pod; returns once it exited
    wait_until("kubelet registered the new plugin", lambda: new.registrations() > 0, interval=0.02)
    gap = logged_at(new, "registered with kubelet")[0] - logged_at(old, "registration withdrawn")[-1]
    return new, max(gap, 0.0)


def gap_figures(scenario: str, values: list[float]) -> dict:
    return {
        "scenario": scenario,
        "no_plugin_p50_s": round(percentile(values, 0.5), 2),
        "no_plugin_max_s": round(max(values), 2),
        "no_plugin_s": [round(v, 2) for v in values],
    }


def gaps(local: LocalCluster, times: int) -> list[dict]:
    """Crashes, then rollouts with and without readiness, `times` each."""
    figures = [gap_figures("crash", [crash_gap(local.plugin) for _ in range(times)])]
    serving = local.plugin
    for readiness in (True, False):
        rollouts = []
        for _ in range(times):
            new, gap = rollout_gap(local.node, serving, readiness)
            if serving is not local.plugin:
                serving.remove()
            serving = new
            rollouts.append(gap)
        figures.append(gap_figures("rollout" if readiness else "rollout without readiness", rollouts))
    if serving is not local.plugin:
        serving.remove()
    return figures


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pods", type=int, default=20)
    parser.add_argument("--kinds", nargs="+", choices=sorted(KINDS), default=list(KINDS))
    parser.add_argument("--gaps", type=int, default=0, help="measure the plugin's gaps this many times instead")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench.pod_start needs root: it runs a real kubelet and containerd", file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.WARNING)
    with local_cluster(purpose="bench-") as local:
        if args.gaps:
            for figures in gaps(local, args.gaps):
                print(json.dumps(figures), flush=True)
            return 0
        for kind in args.kinds:
            print(json.dumps(measure(local.client, local.node, local.plugin, kind, args.pods)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
