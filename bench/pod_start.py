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
call, the old one's withdrawal). And what users see meanwhile: a pod with a MIG 1g claim created
right after each SIGKILL, and one every 0.5 s through each rollout until the old instance has
exited; each pod's start runs from its claim's creation to the pod Running. A pod whose prepare
kubelet tried with no plugin there starts once the plugin, registered again, has it retried
(driver/node/kubelet/prepare_retries.py); kubelet alone would wait for its next pod sync (60-90 s).

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
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import grpc
import kubernetes
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from driver.node.kubelet.liveness import READY_SERVICE
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
CONTAINER_RESTART_S = 1.2  # a killed plugin's container back (issue 26: 1.1-1.6 s)
GAP_POD_KIND = "mig"
POD_EVERY_S = 0.5  # pods created through a rollout
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


@dataclass
class StartedPod:
    name: str
    created: float  # monotonic, when its claim was created


def create_pod(client: kubernetes.client.ApiClient, node: RealNode, kind: str) -> StartedPod:
    """A claim of `kind` and a pod on the node that uses it."""
    name = f"{kind}-{uuid.uuid4().hex[:6]}"
    manifest = pod(name, node.name, template="unused")
    manifest["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": name}]
    created = time.monotonic()
    kubernetes.client.ResourceV1Api(client).create_namespaced_resource_claim(NS, claim(name, *KINDS[kind]))
    kubernetes.client.CoreV1Api(client).create_namespaced_pod(NS, manifest)
    return StartedPod(name, created)


class RunningPods:
    """When each pod of the namespace was first seen Running (monotonic), from a watch kept open
    in the background, so that pods created together are each timed when they start."""

    WATCH_S = 5  # each watch request's length: how soon stop() ends the thread

    def __init__(self, client: kubernetes.client.ApiClient) -> None:
        self._core = kubernetes.client.CoreV1Api(client)
        self.running_at: dict[str, float] = {}
        self._stopped = threading.Event()
        version = self._core.list_namespaced_pod(NS).metadata.resource_version
        self._thread = threading.Thread(target=self._run, args=(version,), daemon=True)
        self._thread.start()

    def _run(self, version: str) -> None:
        while not self._stopped.is_set():
            watch = kubernetes.watch.Watch()
            for event in watch.stream(
                self._core.list_namespaced_pod, NS, resource_version=version, timeout_seconds=self.WATCH_S
            ):
                found = event["object"]
                version = found.metadata.resource_version
                if found.status.phase == "Running":
                    self.running_at.setdefault(found.metadata.name, time.monotonic())

    def latency(self, started: StartedPod) -> float:
        """Seconds from the pod's claim's creation to the pod Running."""
        wait_until(f"pod {started.name} running", lambda: started.name in self.running_at, timeout_s=120, interval=0.05)
        return self.running_at[started.name] - started.created

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(2 * self.WATCH_S)


def remove_pod(client: kubernetes.client.ApiClient, plugin: NodePlugin, started: StartedPod) -> None:
    """The pod and its claim gone, the claim unprepared."""
    core = kubernetes.client.CoreV1Api(client)
    resource = kubernetes.client.ResourceV1Api(client)
    uid = resource.read_namespaced_resource_claim(started.name, NS).metadata.uid
    core.delete_namespaced_pod(started.name, NS, grace_period_seconds=0)
    wait_until(f"claim {started.name} unprepared", lambda: not list(plugin.cdi_dir.glob(f"*{uid}*")))
    resource.delete_namespaced_resource_claim(started.name, NS)


def one_pod(
    client: kubernetes.client.ApiClient, running: RunningPods, node: RealNode, plugin: NodePlugin, kind: str
) -> float:
    """Seconds from creating the claim to the pod Running; the pod and claim are gone afterwards."""
    started = create_pod(client, node, kind)
    latency = running.latency(started)
    remove_pod(client, plugin, started)
    return latency


def measure(client: kubernetes.client.ApiClient, node: RealNode, plugin: NodePlugin, kind: str, pods: int) -> dict:
    core = kubernetes.client.CoreV1Api(client)
    kubelet_before = kubelet_prepare_totals(core, node.name)
    running = RunningPods(client)
    try:
        latencies = [one_pod(client, running, node, plugin, kind) for _ in range(pods)]
    finally:
        running.stop()
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


@dataclass
class Gap:
    no_plugin_s: float
    pod_starts_s: list[float]  # of the pods created meanwhile


def crash_gap(client: kubernetes.client.ApiClient, running: RunningPods, node: RealNode, plugin: NodePlugin) -> Gap:
    """Seconds from the SIGKILL to kubelet's registration of the restarted process, and the start
    of a pod created right after the kill."""
    before = plugin.registrations()
    killed = time.time()
    plugin.stop(signal.SIGKILL)
    started = create_pod(client, node, GAP_POD_KIND)
    time.sleep(max(0.0, killed + CONTAINER_RESTART_S - time.time()))  # kubelet restarting the container
    plugin.start(wait=False)
    wait_until("kubelet registered the restarted plugin", lambda: plugin.registrations() > before, interval=0.02)
    gap = Gap(logged_at(plugin, "registered with kubelet")[-1] - killed, [running.latency(started)])
    remove_pod(client, plugin, started)
    return gap


def rollout_gap(
    client: kubernetes.client.ApiClient, running: RunningPods, node: RealNode, old: NodePlugin, readiness: bool
) -> tuple[NodePlugin, Gap]:
    """The new instance, seconds kubelet had no registered instance (from the old one's
    withdrawal to the new one's registration; 0 where the new one was registered first), and the
    starts of pods created every POD_EVERY_S from the new instance's start until the old one exited."""
    new = NodePlugin.on(node, nvml=old.nvml, uid=str(uuid.uuid4()), sharing_state_of=old)
    pods = [create_pod(client, node, GAP_POD_KIND)]
    new.start(wait=False)
    deadline = time.monotonic() + 60
    while readiness and not ready(new):
        assert time.monotonic() < deadline, "the new plugin did not become Ready within 60s"
        time.sleep(POD_EVERY_S)
        pods.append(create_pod(client, node, GAP_POD_KIND))
    stopping = threading.Thread(target=old.stop, args=(signal.SIGTERM,))  # the DaemonSet controller deletes the old pod
    stopping.start()
    while stopping.is_alive():
        pods.append(create_pod(client, node, GAP_POD_KIND))
        stopping.join(POD_EVERY_S)
    pods.append(create_pod(client, node, GAP_POD_KIND))
    wait_until("kubelet registered the new plugin", lambda: new.registrations() > 0, interval=0.02)
    no_plugin = logged_at(new, "registered with kubelet")[0] - logged_at(old, "registration withdrawn")[-1]
    starts = [running.latency(started) for started in pods]
    for started in pods:
        remove_pod(client, new, started)
    return new, Gap(max(no_plugin, 0.0), starts)


def gap_figures(scenario: str, gaps: list[Gap]) -> dict:
    windows = [g.no_plugin_s for g in gaps]
    starts = [s for g in gaps for s in g.pod_starts_s]
    return {
        "scenario": scenario,
        "no_plugin_p50_s": round(percentile(windows, 0.5), 2),
        "no_plugin_max_s": round(max(windows), 2),
        "no_plugin_s": [round(v, 2) for v in windows],
        "pods": len(starts),
        "pod_start_p50_s": round(percentile(starts, 0.5), 2),
        "pod_start_max_s": round(max(starts), 2),
    }


def gaps(client: kubernetes.client.ApiClient, node: RealNode, plugin: NodePlugin, times: int) -> list[dict]:
    """Crashes, then rollouts with and without readiness, `times` each."""
    running = RunningPods(client)
    serving = plugin
    try:
        figures = [gap_figures("crash", [crash_gap(client, running, node, plugin) for _ in range(times)])]
        for readiness in (True, False):
            rollouts = []
            for _ in range(times):
                new, gap = rollout_gap(client, running, node, serving, readiness)
                if serving is not plugin:
                    serving.remove()
                serving = new
                rollouts.append(gap)
            figures.append(gap_figures("rollout" if readiness else "rollout without readiness", rollouts))
    finally:
        running.stop()
        if serving is not plugin:
            serving.remove()
            plugin.start_registered()  # the node's plugin again, for what runs next
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
            for figures in gaps(local.client, local.node, local.plugin, args.gaps):
                print(json.dumps(figures), flush=True)
            return 0
        for kind in args.kinds:
            print(json.dumps(measure(local.client, local.node, local.plugin, kind, args.pods)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
