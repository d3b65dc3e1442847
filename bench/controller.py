"""kube-scheduler allocating vs `fgpu controller` allocating, on the real control plane, same run,
same mix: N pods, each with a claim from a ResourceClaimTemplate (whole GPUs, MIG profiles, MPS
shares: bench/allocator.py's mix) and CPU and memory in proportion to the GPU it asks (below), on
M fake nodes x 8 mock H100 with 64 CPUs and 512 GiB (slices published through the API; no kubelet,
so "bound" is where it ends). Each path then checks pod fit: kube-scheduler its filters, the
controller driver/scheduling/nodefit.py; the CPU cost of the controller's checks is measured in-process on
the run's own objects at the end (`fit`). First the scheduler allocates (plain templates),
then, after everything is deleted, the controller (templates labelled for it, pods gated).

kube-controller-manager (which makes the claims from the templates) and kube-scheduler get
--kube-api-qps=1000 --kube-api-burst=2000, so neither path waits on their client rate limits
(defaults: 20/30 and 50/100); the controller's client has no rate limit.

  python -m bench.controller --nodes 50 --pods 400
  python -m bench.controller --startup --nodes 1000   # the controller's start-up only
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
import urllib3
from kubernetes.watch.watch import iter_resp_lines

from bench.allocator import classes, cluster_slices, mixed_stream, node_slices_json, percentile
from driver.allocator.model import claim_from_object
from driver.controller.fit import node_room
from driver.scheduling.opt_in import OPT_IN_LABEL, SCHEDULING_GATE, gated
from testbed.cluster.harness import Cluster

CLIENT_LIMITS = ["--kube-api-qps=1000", "--kube-api-burst=2000"]
WATCHED = ("kube-apiserver", "etcd", "kube-controller-manager", "kube-scheduler")


class UnthrottledCluster(Cluster):
    """The test control plane, with kube-controller-manager's and kube-scheduler's client rate
    limits raised (the harness starts them with upstream's defaults)."""

    def _spawn(self, name: str, argv: list[str], logs: Path) -> None:
        extra = CLIENT_LIMITS if name in ("kube-controller-manager", "kube-scheduler") else []
        super()._spawn(name, [*argv, *extra], logs)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Observed:
    """When this process saw things happen (time.monotonic), from watches on the namespace."""

    pod_created: dict[str, float] = field(default_factory=dict)
    pod_bound: dict[str, float] = field(default_factory=dict)
    pod_released: dict[str, float] = field(default_factory=dict)  # seen without fgpu's gate
    claim_created: dict[str, float] = field(default_factory=dict)
    claim_allocated: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_pod(self, obj: dict[str, Any]) -> None:
        name, now = obj["metadata"]["name"], time.monotonic()
        with self.lock:
            if not gated(obj):
                self.pod_released.setdefault(name, now)
            if (obj.get("spec") or {}).get("nodeName"):
                self.pod_bound.setdefault(name, now)

    def on_claim(self, obj: dict[str, Any]) -> None:
        name, now = obj["metadata"]["name"], time.monotonic()
        with self.lock:
            self.claim_created.setdefault(name, now)
            if (obj.get("status") or {}).get("allocation"):
                self.claim_allocated.setdefault(name, now)


def watch(
    lister: Callable[..., Any], namespace: str, handle: Callable[[dict[str, Any]], None], stop: threading.Event
) -> None:
    """Raw JSON events (no model objects: the bench shares the CPUs with what it measures)."""
    while not stop.is_set():
        response = lister(namespace, watch=True, timeout_seconds=30, _preload_content=False)
        for line in iter_resp_lines(response):
            if stop.is_set():
                break
            event = json.loads(line)
            if event.get("type") in ("ADDED", "MODIFIED"):
                handle(event["object"])
        response.release_conn()


def templates(namespace: str, requests: list[dict[str, Any]], opt_in: bool) -> dict[str, dict[str, Any]]:
    """One ResourceClaimTemplate per distinct request, by the request's JSON."""
    out: dict[str, dict[str, Any]] = {}
    for request in requests:
        key = json.dumps(request, sort_keys=True)
        if key not in out:
            meta = {"labels": {OPT_IN_LABEL: "fgpu"}} if opt_in else {}
            spec = {"metadata": meta, "spec": {"devices": {"requests": [{"name": "r", "exactly": request}]}}}
            out[key] = {"metadata": {"name": f"t{len(out)}", "namespace": namespace}, "spec": spec}
    return out


# What a pod asks of its node per GPU it uses: half the node's 8 CPUs and 64 GiB a GPU. (At 7 CPUs a
# GPU, as the openb trace's GPU pods ask ~11 of ~12, kube-scheduler's spreading left pods it could
# not place within 10 minutes: the bench compares speed, so every pod must fit either way.)
CPU_PER_GPU, GIB_PER_GPU = 4, 32
GPU_GIB = 80  # an H100's memory, for MPS shares


def gpus_asked(request: dict[str, Any]) -> float:
    """The GPU share a bench request takes: whole GPUs by count, a MIG profile by its compute
    slices of 7, an MPS share by its memory of the GPU's."""
    if "capacity" in request:
        return int(request["capacity"]["requests"]["memory"].removesuffix("Gi")) / GPU_GIB
    if request["deviceClassName"] == "mig.gpu.fgpu.dev":
        profile = request["selectors"][0]["cel"]["expression"].rsplit('"', 2)[1]
        return int(profile.split("g.", 1)[0]) / 7
    return float(request.get("count", 1))


def pod_requests(request: dict[str, Any]) -> dict[str, str]:
    share = gpus_asked(request)
    cpu_milli, memory_gib = max(100, round(share * CPU_PER_GPU * 1000)), max(1, round(share * GIB_PER_GPU))
    return {"cpu": f"{cpu_milli}m", "memory": f"{memory_gib}Gi"}


def pod(name: str, template: str, gated: bool, requests: dict[str, str]) -> dict[str, Any]:
    resources = {"claims": [{"name": "gpu"}], "requests": requests}
    spec: dict[str, Any] = {
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
        "containers": [{"name": "main", "image": "registry.invalid/cuda:12", "resources": resources}],
        "terminationGracePeriodSeconds": 0,
    }
    if gated:
        spec["schedulingGates"] = [{"name": SCHEDULING_GATE}]
    return {"metadata": {"name": name}, "spec": spec}


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


def run_phase(cluster: Cluster, label: str, requests: list[dict[str, Any]], controller: int | None) -> dict[str, Any]:
    client = cluster.api_client()
    core, resource = kubernetes.client.CoreV1Api(client), kubernetes.client.ResourceV1Api(client)
    namespace = f"bench-{label}"
    core.create_namespace({"metadata": {"name": namespace}})
    wait_until(lambda: bool(core.list_namespaced_service_account(namespace).items), 60, "default service account")
    made = templates(namespace, requests, opt_in=controller is not None)
    for body in made.values():
        resource.create_namespaced_resource_claim_template(namespace, body)
    observed, stop = Observed(), threading.Event()
    for lister, handle in (
        (core.list_namespaced_pod, observed.on_pod),
        (resource.list_namespaced_resource_claim, observed.on_claim),
    ):
        threading.Thread(target=watch, args=(lister, namespace, handle, stop), daemon=True).start()
    time.sleep(1.0)  # the watches are open before the first pod
    pids = {name: cluster.processes[name].pid for name in WATCHED}
    if controller is not None:
        pids["fgpu controller"] = controller
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    load_before = os.getloadavg()

    def create(i: int) -> None:
        name = f"p{i:04d}"
        observed.pod_created[name] = time.monotonic()
        template = made[json.dumps(requests[i], sort_keys=True)]["metadata"]["name"]
        body = pod(name, template, gated=controller is not None, requests=pod_requests(requests[i]))
        core.create_namespaced_pod(namespace, body)

    with ThreadPoolExecutor(8) as creators:
        list(creators.map(create, range(len(requests))))
    settled(observed, len(requests), gated=controller is not None)
    cpu = {name: round(cpu_seconds(pid) - cpu_before[name], 1) for name, pid in pids.items()}
    stop.set()
    first, last = min(observed.pod_created.values()), max(observed.pod_bound.values())
    bound = [observed.pod_bound[p] - observed.pod_created[p] for p in observed.pod_bound]
    allocated = [observed.claim_allocated[c] - observed.claim_created[c] for c in observed.claim_allocated]
    result = {
        "path": label,
        "pods": len(requests),
        "not_placed": unbound_summary(core, namespace) if len(observed.pod_bound) < len(requests) else None,
        "pods_per_s": round(len(observed.pod_bound) / (last - first), 1),
        "create_to_bound_p50_s": round(percentile(bound, 0.5), 2),
        "create_to_bound_p99_s": round(percentile(bound, 0.99), 2),
        "claim_created_to_allocated_p50_s": round(percentile(allocated, 0.5), 2),
        "claim_created_to_allocated_p99_s": round(percentile(allocated, 0.99), 2),
        "cpu_s": cpu,
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
    }
    if controller is not None:  # kube-scheduler's share: from fgpu lifting the gate to the binding
        released = [observed.pod_bound[p] - observed.pod_released[p] for p in observed.pod_bound]
        result["released_to_bound_p50_s"] = round(percentile(released, 0.5), 2)
        result["released_to_bound_p99_s"] = round(percentile(released, 0.99), 2)
        result["fit"] = fit_cost(client, namespace)
    delete_pods(core, namespace)
    wait_until(lambda: not resource.list_namespaced_resource_claim(namespace).items, 600, f"{label}: claims deleted")
    return result


def delete_pods(core: kubernetes.client.CoreV1Api, namespace: str) -> None:
    """Every pod of the namespace. A collection delete stops where its request times out (thousands
    of pods on 2 cores take longer than the API server's 60 s: a 504, or the connection closed):
    asked again until none is left."""
    deadline = time.monotonic() + 600
    while True:
        try:
            core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
        except kubernetes.client.ApiException as error:
            if error.status != 504:
                raise
        except urllib3.exceptions.HTTPError:  # the API server closed the connection at its timeout
            pass
        listed = core.list_namespaced_pod(namespace, _preload_content=False)
        if all(p["metadata"].get("deletionTimestamp") for p in json.loads(listed.data)["items"]):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{namespace}: pods not deleted in 600 s")

    def gone() -> bool:
        listed = core.list_namespaced_pod(namespace, limit=1, _preload_content=False)
        return not json.loads(listed.data)["items"]

    wait_until(gone, 600, f"{namespace}: pods deleted")


SETTLED_S = 30  # no pod bound for this long: what is left does not fit (the path's own packing)


def settled(observed: Observed, pods: int, gated: bool) -> None:
    """Until every pod is bound, or none has been for SETTLED_S (the pods left cannot be placed:
    kube-scheduler's spreading can leave no node with four free GPUs where the controller's
    packing does). Rates then count the pods bound. On the controller's path (`gated`) only the
    pods it still holds count as left: a pod it released is kube-scheduler's to bind, which on
    2 busy cores has taken over 20 s (released_to_bound_p99_s), so it is waited for."""
    deadline = time.monotonic() + 600
    while len(observed.pod_bound) < pods and time.monotonic() < deadline:
        with observed.lock:
            last = max(observed.pod_bound.values(), default=0.0)
            released_unbound = gated and observed.pod_released.keys() - observed.pod_bound.keys()
        if observed.pod_bound and time.monotonic() - last > SETTLED_S and not released_unbound:
            return
        time.sleep(0.2)
    if len(observed.pod_bound) < pods and time.monotonic() >= deadline:
        raise TimeoutError(f"{pods - len(observed.pod_bound)} pods not bound in 600 s")


def unbound_summary(core: kubernetes.client.CoreV1Api, namespace: str) -> str:
    """How many pods were not placed: those fgpu still gates, and what kube-scheduler says of the
    others (its PodScheduled condition: a pod released but not yet tried again still shows the
    message it had while gated)."""
    listed = core.list_namespaced_pod(namespace, _preload_content=False)
    unbound = [p for p in json.loads(listed.data)["items"] if not p["spec"].get("nodeName")]
    still_gated = sum(1 for p in unbound if gated(p))
    said = Counter(
        c.get("message", "")
        for p in unbound
        if not gated(p)
        for c in (p.get("status") or {}).get("conditions") or ()
        if c.get("type") == "PodScheduled"
    )
    told = "; ".join(f"{n}: {message or 'nothing said'}" for message, n in said.most_common(2))
    return f"{len(unbound)} pods: {still_gated} gated by fgpu, {len(unbound) - still_gated} released" + (
        f" (kube-scheduler: {told})" if told else ""
    )


def fit_cost(client: kubernetes.client.ApiClient, namespace: str) -> dict[str, Any]:
    """The controller's pod-fit work on this run's objects, in this process, once every pod is
    bound: the room a pass builds (every node, every pod counted where it runs, every claim), and
    each claim's pods checked against every node, as a search that tries them all would (the
    controller's stops at the first node that fits)."""
    core, resource = kubernetes.client.CoreV1Api(client), kubernetes.client.ResourceV1Api(client)
    as_json = client.sanitize_for_serialization
    nodes = as_json(core.list_node().items)
    pods = as_json(core.list_namespaced_pod(namespace).items)
    claims = as_json(resource.list_namespaced_resource_claim(namespace).items)
    started = time.process_time()
    room = node_room(nodes, pods, claims)
    built = time.process_time() - started
    names = [n["metadata"]["name"] for n in nodes]
    started = time.process_time()
    for claim_object in claims:
        claim = claim_from_object(claim_object)
        for node in names:
            room.fits(claim, node)
    checked = time.process_time() - started
    return {
        "room_ms": round(built * 1000, 1),
        "room_us_per_pod": round(built / len(pods) * 1e6, 1),
        "check_us_per_pod_and_node": round(checked / (len(claims) * len(names)) * 1e6, 2),
        "check_ms_per_claim_all_nodes": round(checked / len(claims) * 1000, 2),
    }


def start_controller(cluster: Cluster, log: Path | None) -> subprocess.Popen[bytes]:
    level = "DEBUG" if log else "WARNING"
    argv = [sys.executable, "-m", "driver.cli", f"--log-level={level}", "controller"]
    argv += [f"--kubeconfig={cluster.kubeconfig}", "--lease-namespace=default", "--identity=bench"]
    with open(log or os.devnull, "wb") as output:  # the child keeps its own descriptor
        process = subprocess.Popen(argv, stderr=output if log else None)
    lease = kubernetes.client.CoordinationV1Api(cluster.api_client())

    def leads() -> bool:
        try:
            return lease.read_namespaced_lease("fgpu-controller", "default").spec.holder_identity == "bench"
        except kubernetes.client.ApiException:
            return False

    wait_until(leads, 60, "controller leads")
    time.sleep(2.0)  # its informers have listed the 50 nodes' slices
    return process


def publish(cluster: Cluster, nodes: int) -> None:
    """The device classes, N nodes and their slices (bench/allocator.py's copies of one node's)."""
    client = cluster.api_client()
    for document in classes():
        kubernetes.utils.create_from_dict(client, document)
    resource = kubernetes.client.ResourceV1Api(client)
    names = [f"node-{i:04d}" for i in range(nodes)]
    with ThreadPoolExecutor(8) as creators:
        list(creators.map(cluster.add_node, names))
        for text in node_slices_json(nodes):
            bodies = json.loads(text)
            list(creators.map(lambda body: resource.create_resource_slice(body, _preload_content=False), bodies))


def memory_kib(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {line.split(":")[0]: int(line.split()[1]) for line in status if line.startswith(("VmRSS", "VmHWM"))}


def startup(args: argparse.Namespace) -> dict[str, Any]:
    """The controller started against N nodes' slices already in the API server, with one claim
    waiting for it: time to caches synced (its log), to that claim's allocation, and its memory."""
    with tempfile.TemporaryDirectory() as workdir:
        cluster = UnthrottledCluster(Path(workdir)).start()
        controller = None
        try:
            publish(cluster, args.nodes)
            claim = {"metadata": {"name": "first", "labels": {OPT_IN_LABEL: "fgpu"}}}
            claim["spec"] = {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": "gpu.fgpu.dev"}}]}}
            resource = kubernetes.client.ResourceV1Api(cluster.api_client())
            resource.create_namespaced_resource_claim("default", claim)
            log = Path(workdir) / "controller.log"
            started = time.monotonic()
            argv = [sys.executable, "-m", "driver.cli", "--log-level=INFO", "controller"]
            argv += [f"--kubeconfig={cluster.kubeconfig}", "--lease-namespace=default", "--identity=bench"]
            with log.open("wb") as output:
                controller = subprocess.Popen(argv, stderr=output)

            def allocated() -> bool:
                found = resource.read_namespaced_resource_claim("first", "default", _preload_content=False)
                return bool((json.loads(found.data).get("status") or {}).get("allocation"))

            wait_until(allocated, 900, "first allocation")
            first_allocation = time.monotonic() - started
            memory = memory_kib(controller.pid)
            synced = [line for line in log.read_text().splitlines() if "caches synced" in line]
        finally:
            if controller is not None:
                controller.send_signal(signal.SIGTERM)
                controller.wait(timeout=60)
            cluster.stop()
    return {
        "nodes": args.nodes,
        "slices": args.nodes * len(json.loads(node_slices_json(1)[0])),
        "start_to_first_allocation_s": round(first_allocation, 1),
        "caches_synced": synced[0].split("caches synced", 1)[1].strip() if synced else None,
        "controller_rss_mib": round(memory["VmRSS"] / 1024),
        "controller_peak_rss_mib": round(memory["VmHWM"] / 1024),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--pods", type=int, default=400)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--controller-log", type=Path, help="the controller's log, at INFO (default: warnings on stderr)"
    )
    parser.add_argument("--startup", action="store_true", help="only the controller's start-up at --nodes")
    args = parser.parse_args()
    if args.startup:
        print(json.dumps(startup(args)))
        return
    requests = [
        c["spec"]["devices"]["requests"][0]["exactly"] for c in mixed_stream(args.pods, random.Random(args.seed))
    ]
    with tempfile.TemporaryDirectory() as workdir:
        cluster = UnthrottledCluster(Path(workdir)).start()
        controller = None
        try:
            client = cluster.api_client()
            for document in classes():
                kubernetes.utils.create_from_dict(client, document)
            resource = kubernetes.client.ResourceV1Api(client)
            for i in range(args.nodes):
                cluster.add_node(f"node-{i:04d}")
            for body in cluster_slices(args.nodes):
                resource.create_resource_slice(body)
            results = [run_phase(cluster, "scheduler", requests, None)]
            controller = start_controller(cluster, args.controller_log)
            results.append(run_phase(cluster, "controller", requests, controller.pid))
        finally:
            if controller is not None:
                controller.send_signal(signal.SIGTERM)
                controller.wait(timeout=30)
            cluster.stop()
    for result in results:
        print(json.dumps(result))
    print(
        json.dumps(
            {"ratio_pods_per_s": round(results[1]["pods_per_s"] / results[0]["pods_per_s"], 2), "cores": os.cpu_count()}
        )
    )


if __name__ == "__main__":
    main()
