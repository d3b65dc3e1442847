"""Benchmark: pod-with-claim start latency on the real node (kube-scheduler, kubelet and containerd
from upstream, `fgpu kubelet-plugin` on mock dgx-h100 GPUs), per kind of device.

One pod at a time on an otherwise idle node: create a ResourceClaim, then a pod that uses it; the
latency runs from the claim's creation to the pod reported Running (its container started), seen
through a watch. Then the pod and claim go, and the next starts once the claim is unprepared. Next
to it, the part that is NodePrepareResources: kubelet's own
`dra_operations_duration_seconds{operation_name="PrepareResources"}` (mean from its sum and
count; its buckets start at 100 ms) and our plugin's per-claim duration from its INFO line.

  python -m bench.pod_start --pods 20 [--kinds whole mig mps timeslice]   # needs root

`--scenario rollout|crash`: pods (time-sliced shares) created every 2 s while the plugin is
replaced as a DaemonSet's rolling update replaces it (a second instance with its own pod UID; the
old one gets SIGTERM once the new one is Ready, i.e. kubelet registered it: the readinessProbe's
`registered` service; `--no-readiness` as soon as the new process runs, the chart before it had a
readinessProbe), or killed (SIGKILL, started again 1.2 s later, as a container restart took in
issue 26). Each pod's start runs from its claim's creation to Running; also the time from the new
process's start to kubelet's registration.

  python -m bench.pod_start --scenario rollout --pods 10 [--no-readiness]
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
import threading
import time
import uuid
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
EVERY_S = 2.0  # a new pod this often during a scenario
CONTAINER_RESTART_S = 1.2  # a killed plugin's container back (issue 26: 1.1-1.6 s)
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


def ready(plugin: NodePlugin) -> bool:
    """What the readinessProbe sees: kubelet registered this instance."""
    request = health_pb2.HealthCheckRequest(service=READY_SERVICE)
    try:
        with grpc.insecure_channel(f"unix://{plugin.dra_socket}") as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(request, timeout=2).status
    except grpc.RpcError:
        return False
    return status == health_pb2.HealthCheckResponse.SERVING


def start_latency(client: kubernetes.client.ApiClient, name: str, created: float) -> float:
    core = kubernetes.client.CoreV1Api(client)
    watch = kubernetes.watch.Watch()
    for event in watch.stream(
        core.list_namespaced_pod, NS, field_selector=f"metadata.name={name}", timeout_seconds=150
    ):
        if event["object"].status.phase == "Running":
            watch.stop()
            return time.monotonic() - created
    raise RuntimeError(f"pod {name} did not start within 150s")


def create_pod(client: kubernetes.client.ApiClient, node: RealNode, name: str) -> float:
    manifest = pod(name, node.name, template="unused")
    manifest["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": name}]
    created = time.monotonic()
    kubernetes.client.ResourceV1Api(client).create_namespaced_resource_claim(NS, claim(name, *KINDS["timeslice"]))
    kubernetes.client.CoreV1Api(client).create_namespaced_pod(NS, manifest)
    return created


def replace_plugin(node: RealNode, old: NodePlugin, scenario: str, readiness: bool) -> tuple[NodePlugin, float]:
    """The rolling update or the crash; returns the serving instance and seconds from its process's
    start to kubelet's registration."""
    if scenario == "crash":
        old.stop(signal.SIGKILL)
        time.sleep(CONTAINER_RESTART_S)
        new = old
    else:
        new = NodePlugin.on(node, nvml=old.nvml, uid=str(uuid.uuid4()), sharing_state_of=old)
    before = new.registrations()
    started = time.monotonic()
    new.start(wait=False)
    if scenario == "rollout":
        if readiness:
            wait_until("the new plugin Ready", lambda: ready(new), interval=0.05)
        else:
            wait_until("the new plugin's process", lambda: new.process is not None, interval=0.05)
        old.stop(signal.SIGTERM)  # the DaemonSet controller deletes the old pod
    wait_until("kubelet registered the new plugin", lambda: new.registrations() > before, interval=0.05)
    registered_s = time.monotonic() - started
    return new, registered_s


def scenario(local: LocalCluster, name: str, pods: int, readiness: bool) -> tuple[dict, NodePlugin]:
    """Pods created every EVERY_S; the plugin replaced (rollout) or killed (crash) after the first."""
    client, node = local.client, local.node
    names = [f"{name}-{uuid.uuid4().hex[:6]}" for _ in range(pods)]
    latencies: dict[str, float] = {}
    watchers = []
    serving: list[tuple[NodePlugin, float]] = []
    for index, pod_name in enumerate(names):
        created = create_pod(client, node, pod_name)
        thread = threading.Thread(
            target=lambda n=pod_name, c=created: latencies.__setitem__(n, start_latency(client, n, c))
        )
        thread.start()
        watchers.append(thread)
        if index == 0:
            threading.Thread(target=lambda: serving.append(replace_plugin(node, local.plugin, name, readiness))).start()
        time.sleep(EVERY_S)
    for thread in watchers:
        thread.join()
    wait_until("the plugin replaced", lambda: serving)
    plugin, registered_s = serving[0]
    values = [latencies[n] for n in names if n in latencies]
    core, resource = kubernetes.client.CoreV1Api(client), kubernetes.client.ResourceV1Api(client)
    for pod_name in names:
        core.delete_namespaced_pod(pod_name, NS, grace_period_seconds=0)
    wait_until("pods gone", lambda: not core.list_namespaced_pod(NS).items, timeout_s=120)
    for pod_name in names:
        resource.delete_namespaced_resource_claim(pod_name, NS)
    return {
        "scenario": name if name == "crash" else f"rollout{'' if readiness else ' without readiness'}",
        "pods": pods,
        "started": len(values),
        "start_p50_s": round(percentile(values, 0.5), 2),
        "start_max_s": round(max(values), 2),
        "within_10s": sum(v <= 10 for v in values),
        "registered_after_start_s": round(registered_s, 2),
    }, plugin


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pods", type=int, default=20)
    parser.add_argument("--kinds", nargs="+", choices=sorted(KINDS), default=list(KINDS))
    parser.add_argument("--scenario", choices=["rollout", "crash"], help="pods started while the plugin is replaced")
    parser.add_argument("--no-readiness", dest="readiness", action="store_false", help="rollout: the old way")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench.pod_start needs root: it runs a real kubelet and containerd", file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.WARNING)
    with local_cluster(purpose="bench-") as local:
        if args.scenario:
            figures, plugin = scenario(local, args.scenario, args.pods, args.readiness)
            print(json.dumps(figures), flush=True)
            if plugin is not local.plugin:
                plugin.remove()
            return 0
        for kind in args.kinds:
            print(json.dumps(measure(local.client, local.node, local.plugin, kind, args.pods)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
