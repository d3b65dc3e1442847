"""A day of GPU pods on a fleet that Karpenter grows and shrinks (issue 40 item 6): pods arrive at a
day-shaped rate (a morning and an afternoon peak, a quiet night) compressed into minutes, each
asking for whole H100s or an MPS share of a given memory, and each deleted its run time after it
starts Running. Karpenter v1.15.0 (its kwok provider, DRA on, fgpu's templates for a DGX H100 node
type offering whole GPUs and MPS shares) adds kwok nodes for pods that wait and removes the nodes
that empty; `fgpu simulate-fleet` publishes each new node's slices. The same pods twice in one
run: first with fgpu's controller off (kube-scheduler allocates the claims: first fit), then with
it on (claims opted in, pods gated, the controller places them and marks those that fit no node
unschedulable for Karpenter).

Recorded per path, from watches (this process's clock): the nodes existing, used (a pod Running on
them) and kept (a Running pod that is never moved on them) every second against the lower bound (the
fewest DGX H100 nodes whose GPUs hold the Running pods' whole GPUs and shares, counting memory and
MPS compute as divisible) and a first-fit-decreasing packing of the same pods (nodes that do hold
them: the fewest lies between the two); nodes added and removed; each pod's wait from creation to
Running, split for pods that ran on a node added after they were created, and for those the node's
start (node created -> Ready without start-up taints and its slices published) and what is left once
one provisioning round (Karpenter's batch, at most 5 s) and that start are taken off.

  python -m bench.autoscaling --pods 500 --day-s 300            # the medium form
  python -m bench.autoscaling --pods 500 --day-s 300 --lifetimes  # claims say their run time
  python -m bench.autoscaling --pods 500 --day-s 300 --empty-nodes  # the controller empties nodes
  python -m bench.autoscaling --pods 40 --day-s 30 --json out.json --markdown out.md

Pods carry karpenter.sh/do-not-disrupt (a GPU job is not restarted to pack nodes): Karpenter only
removes nodes that empty. With --empty-nodes the controller path's share pods are movable
inference replicas (each a ReplicaSet of one, annotated gpu.fgpu.dev/movable, deleted its run time
after its first pod Running) and the controller runs with --make-room --compact-when-idle
--empty-nodes: it moves them off nodes it can empty (docs/autoscaling.md), and each pod made again
counts as a move. Karpenter runs with --share-counters-once (docs/autoscaling.md: v1.15.0
charges a shared device's counters per share)."""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.watch.watch import iter_resp_lines

from bench.allocator import classes, percentile
from bench.controller import UnthrottledCluster, delete_pods, unbound_summary, wait_until
from bench.fleet import start_controller, start_fleet
from driver.allocator.lifetimes import EXPECTED_DURATION
from driver.fleet.machine_types import MachineType, machine_inventory
from driver.inventory.slices import build_slices
from driver.scheduling.opt_in import MOVABLE_ANNOTATION, OPT_IN_LABEL, OPT_IN_VALUE, SCHEDULING_GATE
from testbed.cluster.harness import stop_process
from testbed.cluster.karpenter_manager import DGX_H100, InstanceType, KarpenterManager, NodePool
from testbed.cluster.kwok_manager import ON_FLEET_NODES, Kwok

NODE_TYPE = InstanceType("dgx-h100", "dgx-h100", cpu="224", memory="2Ti", price=DGX_H100.price, offer="whole,mps")
GPUS_PER_NODE = 8
GPU_MEMORY_GI = 79.5  # an H100's 81,559 MiB as its MPS device publishes it (rounded down to 256Mi steps)
SHARE_COMPUTE = 10  # an MPS share's default compute (active thread percentage) of 100
SHARE_SIZES_GI = (10, 20, 26, 39)  # 7, 3, 3, 2 to a GPU
WHOLE_COUNTS = ((1, 0.6), (2, 0.2), (4, 0.12), (8, 0.08))
WHOLE_FRACTION = 0.35
RUN_FRACTION = (0.04, 0.2)  # a pod's run time, as a fraction of the day
NODEPOOL_LABEL = "karpenter.sh/nodepool"
DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"
PODS_NOT_RUNNING_S = 300  # after the last arrival and the longest run: pods still waiting are reported
DRAIN_S = 240  # after the day: how long the nodes may take to go
# kept: nodes in use that a Running pod which is never moved keeps (every pod but the movable shares)
COLUMNS = ("t_s", "existing", "used", "bound", "packed", "bound_alive", "pending", "kept")
ARRIVAL_LABEL = "bench.fgpu.dev/arrival"  # on every pod: the arrival it is (a ReplicaSet's pods have other names)
EVICTIONS_PER_MINUTE = 60  # the controller's budget with --empty-nodes: a node's shares within a minute
ROUND_S = 5.0  # a provisioning round: Karpenter's --batch-max-duration as karpenter_manager.py sets it


@dataclass(frozen=True)
class Shape:
    """What a pod asks: `gpus` whole GPUs, or one MPS share of `memory_gi` (gpus 0)."""

    gpus: int = 0
    memory_gi: int = 0

    def request(self) -> dict[str, Any]:
        if self.gpus:
            return {"deviceClassName": "gpu.fgpu.dev", "count": self.gpus}
        return {"deviceClassName": "mps.gpu.fgpu.dev", "capacity": {"requests": {"memory": f"{self.memory_gi}Gi"}}}

    @property
    def key(self) -> str:
        return f"gpu{self.gpus}" if self.gpus else f"mps{self.memory_gi}"


@dataclass(frozen=True)
class Arrival:
    name: str
    at_s: float  # from the day's start
    run_s: float  # from Running to its deletion
    shape: Shape


def day_rate(fraction: float) -> float:
    """Arrivals per unit of time at this fraction of the day: a quiet night, a morning peak, a
    smaller afternoon peak."""
    return 0.15 + math.exp(-(((fraction - 0.3) / 0.08) ** 2)) + 0.8 * math.exp(-(((fraction - 0.65) / 0.1) ** 2))


def day_trace(pods: int, day_s: float, seed: int) -> list[Arrival]:
    """`pods` arrivals drawn from day_rate over `day_s` seconds (inverse CDF on a grid), sorted."""
    rng = random.Random(seed)
    grid = 1000
    cumulative, total = [], 0.0
    for i in range(grid):
        total += day_rate((i + 0.5) / grid)
        cumulative.append(total)
    arrivals = []
    for _ in range(pods):
        u = rng.random() * total
        cell = bisect.bisect_left(cumulative, u)
        low = cumulative[cell - 1] if cell else 0.0
        within = (u - low) / (cumulative[cell] - low)
        at = (cell + within) / grid * day_s
        if rng.random() < WHOLE_FRACTION:
            shape = Shape(gpus=rng.choices([c for c, _ in WHOLE_COUNTS], [w for _, w in WHOLE_COUNTS])[0])
        else:
            shape = Shape(memory_gi=rng.choice(SHARE_SIZES_GI))
        arrivals.append((at, rng.uniform(*RUN_FRACTION) * day_s, shape))
    arrivals.sort(key=lambda a: a[0])
    return [Arrival(f"p{i:04d}", round(at, 3), round(run, 3), shape) for i, (at, run, shape) in enumerate(arrivals)]


def lower_bound(shapes: Iterable[Shape]) -> int:
    """The fewest nodes whose GPUs hold these pods, with every share's memory and compute taken as
    divisible across GPUs (so no packing does better)."""
    whole = memory = compute = 0.0
    for shape in shapes:
        whole += shape.gpus
        if not shape.gpus:
            memory += shape.memory_gi / GPU_MEMORY_GI
            compute += SHARE_COMPUTE / 100
    return math.ceil((whole + max(memory, compute)) / GPUS_PER_NODE - 1e-9)


def packed(shapes: Iterable[Shape]) -> int:
    """Nodes that do hold these pods: shares first-fit decreasing onto GPUs (memory and compute),
    then the pods' whole GPUs and the shared GPUs first-fit decreasing onto nodes."""
    gpus: list[list[float]] = []  # [memory left, compute left]
    items = []
    for shape in sorted(shapes, key=lambda s: (s.gpus, s.memory_gi), reverse=True):
        if shape.gpus:
            items.append(shape.gpus)
            continue
        for gpu in gpus:
            if gpu[0] >= shape.memory_gi and gpu[1] >= SHARE_COMPUTE:
                gpu[0] -= shape.memory_gi
                gpu[1] -= SHARE_COMPUTE
                break
        else:
            gpus.append([GPU_MEMORY_GI - shape.memory_gi, 100 - SHARE_COMPUTE])
    items += [1] * len(gpus)
    nodes: list[int] = []  # GPUs left
    for size in sorted(items, reverse=True):
        for i, left in enumerate(nodes):
            if left >= size:
                nodes[i] -= size
                break
        else:
            nodes.append(GPUS_PER_NODE - size)
    return len(nodes)


@dataclass
class Observed:
    """What the watches saw, in this process's time.monotonic()."""

    pod_created: dict[str, float] = field(default_factory=dict)
    pod_running: dict[str, float] = field(default_factory=dict)
    pod_node: dict[str, str] = field(default_factory=dict)
    pod_deleted: dict[str, float] = field(default_factory=dict)
    where: dict[str, tuple[str, str]] = field(default_factory=dict)  # arrival -> its pod Running now, its node
    pods_run: dict[str, set[str]] = field(default_factory=dict)  # arrival -> the pods of it that ran
    node_added: dict[str, float] = field(default_factory=dict)
    node_removed: dict[str, float] = field(default_factory=dict)
    node_published: dict[str, float] = field(default_factory=dict)
    node_usable: dict[str, float] = field(default_factory=dict)  # Ready, without start-up taints
    node_slices: dict[str, set[str]] = field(default_factory=dict)
    claim_allocator: dict[str, str] = field(default_factory=dict)  # who wrote the allocation
    slices_per_node: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_pod(self, kind: str, obj: dict[str, Any]) -> None:
        """An arrival runs from its first pod Running (wait, first node); where it runs now follows
        its pods as they are moved (evicted and made again) and end."""
        meta, now = obj["metadata"], time.monotonic()
        pod = meta["name"]
        name = (meta.get("labels") or {}).get(ARRIVAL_LABEL, pod)
        node, phase = (obj.get("spec") or {}).get("nodeName"), (obj.get("status") or {}).get("phase")
        with self.lock:
            if kind == "DELETED" or meta.get("deletionTimestamp") or phase in ("Succeeded", "Failed"):
                if self.where.get(name, ("",))[0] == pod:
                    del self.where[name]
            elif node and phase == "Running":
                self.pod_running.setdefault(name, now)
                self.pod_node.setdefault(name, node)
                self.where[name] = (pod, node)
                self.pods_run.setdefault(name, set()).add(pod)

    def on_claim(self, kind: str, obj: dict[str, Any]) -> None:
        if kind == "DELETED" or not (obj.get("status") or {}).get("allocation"):
            return
        writers = [
            f.get("manager", "?")
            for f in obj["metadata"].get("managedFields") or ()
            if "f:allocation" in ((f.get("fieldsV1") or {}).get("f:status") or {})
        ]
        with self.lock:
            self.claim_allocator.setdefault(obj["metadata"]["name"], ",".join(sorted(writers)) or "?")

    def on_node(self, kind: str, obj: dict[str, Any]) -> None:
        if NODEPOOL_LABEL not in (obj["metadata"].get("labels") or {}):
            return
        name, now = obj["metadata"]["name"], time.monotonic()
        with self.lock:
            self.node_added.setdefault(name, now)
            if _usable(obj):
                self.node_usable.setdefault(name, now)
            if kind == "DELETED":
                self.node_removed.setdefault(name, now)

    def on_slice(self, kind: str, obj: dict[str, Any]) -> None:
        node = (obj.get("spec") or {}).get("nodeName")
        if kind != "ADDED" or not node:
            return
        with self.lock:
            seen = self.node_slices.setdefault(node, set())
            seen.add(obj["metadata"]["name"])
            if len(seen) >= self.slices_per_node:
                self.node_published.setdefault(node, time.monotonic())

    def existing_nodes(self) -> set[str]:
        with self.lock:
            return set(self.node_added) - set(self.node_removed)


START_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable", "karpenter.sh/unregistered")


def _usable(node: dict[str, Any]) -> bool:
    ready = any(
        c["type"] == "Ready" and c["status"] == "True" for c in (node.get("status") or {}).get("conditions") or []
    )
    return ready and not any(t["key"] in START_TAINTS for t in (node.get("spec") or {}).get("taints") or [])


def watch_events(
    lister: Callable[..., Any], handle: Callable[[str, dict[str, Any]], None], stop: threading.Event, *args: Any
) -> None:
    """Raw JSON events of every type, the watch opened again where it ends."""
    version = ""
    while not stop.is_set():
        with contextlib.suppress(Exception):  # an ended or broken watch is opened again
            listed = json.loads(lister(*args, _preload_content=False).data)
            version = listed["metadata"]["resourceVersion"]
            for item in listed["items"]:
                handle("ADDED", item)
            response = lister(*args, watch=True, resource_version=version, timeout_seconds=30, _preload_content=False)
            for line in iter_resp_lines(response):
                if stop.is_set():
                    break
                event = json.loads(line)
                if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                    handle(event["type"], event["object"])
            response.release_conn()
        if not stop.is_set():
            time.sleep(0.2)


def templates(
    namespace: str, trace: list[Arrival], opt_in: bool, lifetimes: bool
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """ResourceClaimTemplates, and each pod's: one per shape, named after it; with `lifetimes` one
    per pod, named after it, whose claim says the pod's run time (gpu.fgpu.dev/expected-duration)."""
    out: dict[str, dict[str, Any]] = {}
    of_pod = {}
    for arrival in trace:
        name = arrival.name if lifetimes else arrival.shape.key
        of_pod[arrival.name] = name
        if name in out:
            continue
        meta: dict[str, Any] = {"labels": {OPT_IN_LABEL: OPT_IN_VALUE}} if opt_in else {}
        if lifetimes:
            meta["annotations"] = {EXPECTED_DURATION: f"{math.ceil(arrival.run_s)}s"}
        request = {"name": "gpu", "exactly": arrival.shape.request()}
        spec = {"metadata": meta, "spec": {"devices": {"requests": [request]}}}
        out[name] = {"metadata": {"name": name, "namespace": namespace}, "spec": spec}
    return out, of_pod


def pod_body(arrival: Arrival, template: str, gated: bool, movable: bool = False) -> dict[str, Any]:
    resources = {"claims": [{"name": "gpu"}], "requests": {"cpu": "1", "memory": "4Gi"}}
    spec: dict[str, Any] = {
        **ON_FLEET_NODES,
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
        "containers": [{"name": "main", "image": "registry.invalid/cuda:12", "resources": resources}],
        "terminationGracePeriodSeconds": 0,
    }
    if gated:
        spec["schedulingGates"] = [{"name": SCHEDULING_GATE}]
    annotations = {DO_NOT_DISRUPT: "true", **({MOVABLE_ANNOTATION: "true"} if movable else {})}
    metadata = {"name": arrival.name, "labels": {ARRIVAL_LABEL: arrival.name}, "annotations": annotations}
    return {"metadata": metadata, "spec": spec}


def replica_set_body(arrival: Arrival, template: str, gated: bool) -> dict[str, Any]:
    """A movable replica: a ReplicaSet of one pod, made again wherever it is evicted."""
    pod = pod_body(arrival, template, gated, movable=True)
    del pod["metadata"]["name"]
    selector = {"matchLabels": {ARRIVAL_LABEL: arrival.name}}
    return {"metadata": {"name": arrival.name}, "spec": {"replicas": 1, "selector": selector, "template": pod}}


def run_day(
    cluster: UnthrottledCluster, label: str, trace: list[Arrival], args: argparse.Namespace, per_node: int
) -> dict[str, Any]:
    """The trace once: pods created at their times and deleted their run time after Running;
    sampled every second; then the nodes' drain."""
    client = cluster.api_client()
    core, resource = kubernetes.client.CoreV1Api(client), kubernetes.client.ResourceV1Api(client)
    apps = kubernetes.client.AppsV1Api(client)
    opt_in = label == "fgpu-controller"
    movable = {a.name for a in trace if opt_in and args.empty_nodes and not a.shape.gpus}
    namespace = f"day-{label}"
    core.create_namespace({"metadata": {"name": namespace}})
    wait_until(lambda: bool(core.list_namespaced_service_account(namespace).items), 60, "default service account")
    made, template_of = templates(namespace, trace, opt_in, opt_in and args.lifetimes)
    with ThreadPoolExecutor(8) as creators:
        list(creators.map(lambda body: resource.create_namespaced_resource_claim_template(namespace, body),
                          made.values()))  # fmt: skip
    observed, stop = Observed(slices_per_node=per_node), threading.Event()
    by_name = {a.name: a for a in trace}
    watches = [
        (core.list_namespaced_pod, observed.on_pod, namespace),
        (resource.list_namespaced_resource_claim, observed.on_claim, namespace),
        (core.list_node, observed.on_node),
        (resource.list_resource_slice, observed.on_slice),
    ]
    for lister, handle, *rest in watches:
        threading.Thread(target=watch_events, args=(lister, handle, stop, *rest), daemon=True).start()
    time.sleep(1.0)
    samples: list[list[float]] = []
    workers = ThreadPoolExecutor(8)
    start = time.monotonic()

    def create(arrival: Arrival) -> None:
        observed.pod_created[arrival.name] = time.monotonic()
        template = template_of[arrival.name]
        if arrival.name in movable:
            body = replica_set_body(arrival, template, gated=opt_in)
            apps.create_namespaced_replica_set(namespace, body, _preload_content=False)
        else:
            core.create_namespaced_pod(namespace, pod_body(arrival, template, gated=opt_in), _preload_content=False)

    def delete(name: str) -> None:
        observed.pod_deleted[name] = time.monotonic()
        with contextlib.suppress(kubernetes.client.ApiException):
            if name in movable:  # the ReplicaSet, then its pod at once (not when the garbage collector comes)
                apps.delete_namespaced_replica_set(name, namespace, _preload_content=False)
                core.delete_collection_namespaced_pod(
                    namespace, label_selector=f"{ARRIVAL_LABEL}={name}", grace_period_seconds=0
                )
            else:
                core.delete_namespaced_pod(name, namespace, grace_period_seconds=0, _preload_content=False)

    def sample() -> None:
        with observed.lock:
            alive = [n for n in observed.pod_created if n not in observed.pod_deleted]
            running = [n for n in alive if n in observed.where]
            used = {observed.where[n][1] for n in running}
            kept = {observed.where[n][1] for n in running if n not in movable}
            existing = set(observed.node_added) - set(observed.node_removed)
        shapes = [by_name[n].shape for n in running]
        samples.append([
            round(time.monotonic() - start, 1), len(existing), len(used), lower_bound(shapes), packed(shapes),
            lower_bound(by_name[n].shape for n in alive), len(alive) - len(running), len(kept),
        ])  # fmt: skip

    last_end = trace[-1].at_s + max(a.run_s for a in trace) if trace else 0.0
    deadline = start + last_end + PODS_NOT_RUNNING_S
    next_arrival, next_sample = 0, start
    try:
        while True:
            now = time.monotonic()
            while next_arrival < len(trace) and start + trace[next_arrival].at_s <= now:
                workers.submit(create, trace[next_arrival])
                next_arrival += 1
            with observed.lock:
                due = [n for n, t in observed.pod_running.items() if n not in observed.pod_deleted
                       and t + by_name[n].run_s <= now]  # fmt: skip
                for name in due:
                    observed.pod_deleted[name] = now  # claimed here; delete() sets the time it asks
            for name in due:
                workers.submit(delete, name)
            if now >= next_sample:
                sample()
                next_sample += 1.0
            if next_arrival == len(trace) and len(observed.pod_deleted) == len(trace):
                break
            if now > deadline:
                break
            time.sleep(0.1)
        day_end = time.monotonic()
        not_run = [a.name for a in trace if a.name not in observed.pod_running]
        said = unbound_summary(core, namespace) if not_run else None  # what the scheduler said of one
        if not_run:
            if movable:
                apps.delete_collection_namespaced_replica_set(namespace)
            delete_pods(core, namespace)
        drained = day_end + DRAIN_S
        while observed.existing_nodes() and time.monotonic() < drained:
            if time.monotonic() >= next_sample:
                sample()
                next_sample += 1.0
            time.sleep(0.2)
        sample()
    finally:
        workers.shutdown(wait=True)
        stop.set()
    result = summarize(label, trace, observed, samples, start, day_end)
    result["pods_not_run"] = len(not_run)
    result["pods_not_run_said"] = said
    with contextlib.suppress(kubernetes.client.ApiException):
        core.delete_namespace(namespace)
    return result


def summarize(
    label: str,
    trace: list[Arrival],
    observed: Observed,
    samples: list[list[float]],
    start: float,
    day_end: float,
) -> dict[str, Any]:
    waits, waits_new, waits_old, node_start, provisioning, beyond = [], [], [], [], [], []
    late: list[dict[str, Any]] = []  # the pods beyond a round and their node's start: which, and where the time went
    for arrival in trace:
        created, running = observed.pod_created.get(arrival.name), observed.pod_running.get(arrival.name)
        if created is None or running is None:
            continue
        wait = running - created
        waits.append(wait)
        node = observed.pod_node[arrival.name]
        added = observed.node_added.get(node)
        if added is not None and added > created:
            waits_new.append(wait)
            ready = max(observed.node_published.get(node, running), observed.node_usable.get(node, running))
            started = ready - added
            node_start.append(started)
            provisioning.append(added - created)
            beyond.append(wait - ROUND_S - started)
            if beyond[-1] > 0:
                late.append({
                    "arrival": arrival.name, "shape": arrival.shape.key, "wait_s": round(wait, 2),
                    "to_node_created_s": round(added - created, 2), "node_start_s": round(started, 2),
                })  # fmt: skip
        else:
            waits_old.append(wait)
    nodes_added = len(observed.node_added)
    removed_after_day = sum(1 for t in observed.node_removed.values() if t >= day_end)
    # Node-seconds over the day (the first arrival to the last pod's end), one sample a second.
    day = [s for s in samples if s[0] <= day_end - start]
    sums = {key: sum(s[COLUMNS.index(key)] for s in day) for key in ("existing", "used", "bound", "packed", "kept")}

    def over(key: str) -> float | None:
        return round(100 * (sums[key] / sums["bound"] - 1), 1) if sums["bound"] else None

    def p(values: list[float], q: float) -> float | None:
        return round(percentile(values, q), 2) if values else None

    peak = max(samples, key=lambda s: s[3]) if samples else None
    return {
        "path": label,
        "pods": len(trace),
        "pods_run": len(waits),
        "wait_p50_s": p(waits, 0.5),
        "wait_p99_s": p(waits, 0.99),
        "pods_on_new_nodes": len(waits_new),
        "wait_new_node_p50_s": p(waits_new, 0.5),
        "wait_new_node_p99_s": p(waits_new, 0.99),
        "wait_new_node_max_s": round(max(waits_new), 2) if waits_new else None,
        "wait_existing_node_p50_s": p(waits_old, 0.5),
        "wait_existing_node_p99_s": p(waits_old, 0.99),
        "provisioning_p50_s": p(provisioning, 0.5),
        "provisioning_p99_s": p(provisioning, 0.99),
        "node_start_p50_s": p(node_start, 0.5),
        "node_start_p99_s": p(node_start, 0.99),
        "pods_beyond_round_and_start": sum(1 for b in beyond if b > 0),
        "beyond_round_and_start_p99_s": p(beyond, 0.99),
        "beyond_round_and_start": late,
        "claims_allocated_by": _counts(observed.claim_allocator.values()),
        "pods_moved": sum(len(pods) - 1 for pods in observed.pods_run.values()),
        "nodes_added": nodes_added,
        "nodes_removed": len(observed.node_removed),
        "nodes_removed_after_day": removed_after_day,
        "nodes_left": nodes_added - len(observed.node_removed),
        "node_seconds": {k: round(v) for k, v in sums.items()},
        "existing_over_bound_pct": over("existing"),
        "used_over_bound_pct": over("used"),
        "packed_over_bound_pct": over("packed"),
        "busy_over_bound_pct": busy_over_bound(day),
        "used_over_packed_pct": round(100 * (sums["used"] / sums["packed"] - 1), 1) if sums["packed"] else None,
        "peak": {"t_s": peak[0], "existing": peak[1], "used": peak[2], "bound": peak[3], "packed": peak[4]}
        if peak
        else None,
        "used_below_bound_samples": sum(1 for s in samples if s[2] < s[3]),
        "day_s": round(day_end - start, 1),
        "drain_s": round(max(observed.node_removed.values(), default=day_end) - day_end, 1),
        "series": {"columns": list(COLUMNS), "rows": samples},
    }


BUSY = 0.7  # "busy": the lower bound at 70% of its peak or more


def busy_over_bound(rows: list[list[float]]) -> dict[str, float | None]:
    """Nodes existing and used over the lower bound while the day is busy (samples whose bound is
    at least BUSY of its peak), in percent: packing where it counts, without the tails."""
    top = max((row[3] for row in rows), default=0)
    busy = [row for row in rows if top and row[3] >= BUSY * top]
    bound = sum(row[3] for row in busy)
    if not bound:
        return {"existing": None, "used": None}
    return {key: round(100 * (sum(row[i] for row in busy) / bound - 1), 1) for i, key in ((1, "existing"), (2, "used"))}


def _counts(values: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for value in values:
        out[value] = out.get(value, 0) + 1
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    trace = day_trace(args.pods, args.day_s, args.seed)
    per_node = len(build_slices("gpu.fgpu.dev", "n", machine_inventory(MachineType("dgx-h100", "mps,whole")), 1, None))
    shapes: dict[str, int] = {}
    for arrival in trace:
        shapes[arrival.shape.key] = shapes.get(arrival.shape.key, 0) + 1
    result: dict[str, Any] = {
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "pods": args.pods, "day_s": args.day_s, "seed": args.seed, "shapes": shapes,
        "policy": args.policy, "lifetimes": args.lifetimes, "empty_nodes": args.empty_nodes, "cores": os.cpu_count(),
        "load_avg_before": [round(x, 2) for x in os.getloadavg()],
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="fgpu-autoscaling-") as workdir:
        work = Path(workdir)
        cluster = UnthrottledCluster(work / "cluster").start()
        kwok = Kwok(cluster, work / "kwok")
        karpenter: KarpenterManager | None = None
        processes: list[subprocess.Popen[bytes]] = []
        try:
            client = cluster.api_client()
            for document in classes():
                kubernetes.utils.create_from_dict(client, document)
            kwok.start()
            processes.append(start_fleet(cluster.kubeconfig, work / "fleet.log"))
            pool = NodePool("dgx-h100", ("dgx-h100",), args.max_nodes, args.consolidate_after)
            karpenter = KarpenterManager(cluster, work / "karpenter", (NODE_TYPE,), (pool,), share_counters_once=True)
            karpenter.start()
            result["scheduler"] = run_day(cluster, "kube-scheduler", trace, args, per_node)
            print(json.dumps({k: v for k, v in result["scheduler"].items() if k != "series"}), flush=True)
            _no_nodes_left(karpenter)
            flags = [f"--policy={args.policy}"]
            if args.empty_nodes:
                flags += ["--make-room", f"--evictions-per-minute={EVICTIONS_PER_MINUTE}", "--compact-when-idle",
                          "--empty-nodes"]  # fmt: skip
            controller, _ = start_controller(cluster.kubeconfig, work / "controller.log", *flags)
            processes.append(controller)
            result["controller"] = run_day(cluster, "fgpu-controller", trace, args, per_node)
            print(json.dumps({k: v for k, v in result["controller"].items() if k != "series"}), flush=True)
        finally:
            for process in reversed(processes):
                stop_process(process, grace_s=30)
            if karpenter is not None:
                karpenter.stop()
            kwok.stop()
            cluster.stop()
    result["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    result["finished_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    return result


def _no_nodes_left(karpenter: KarpenterManager) -> None:
    """Between the paths: nodes the first left (not drained in time) are taken away, so the second
    starts from none (the manager's own clean-up at stop, which waits for them to go)."""
    if karpenter.node_claims():
        karpenter._delete_node_claims()


ROWS = (
    ("pods run / arrived", lambda r: f"{r['pods_run']} / {r['pods']}"),
    ("wait creation -> Running p50 / p99 (s)", lambda r: f"{r['wait_p50_s']} / {r['wait_p99_s']}"),
    ("pods on a node added after they came", lambda r: str(r["pods_on_new_nodes"])),
    ("their wait p50 / p99 / max (s)",
     lambda r: f"{r['wait_new_node_p50_s']} / {r['wait_new_node_p99_s']} / {r['wait_new_node_max_s']}"),
    ("pods on nodes already there: wait p50 / p99 (s)",
     lambda r: f"{r['wait_existing_node_p50_s']} / {r['wait_existing_node_p99_s']}"),
    ("of it, pod created -> its node created p50 / p99 (s)",
     lambda r: f"{r['provisioning_p50_s']} / {r['provisioning_p99_s']}"),
    ("node start (created -> Ready, untainted, slices published) p50 / p99 (s)",
     lambda r: f"{r['node_start_p50_s']} / {r['node_start_p99_s']}"),
    ("pods waiting longer than a round and their node's start", lambda r: str(r["pods_beyond_round_and_start"])),
    ("pods moved (evicted, made again and Running)", lambda r: str(r.get("pods_moved", 0))),
    ("claims allocated by", lambda r: ", ".join(f"{k} {v}" for k, v in sorted(r["claims_allocated_by"].items()))),
    ("nodes added / removed / removed after the day / left", lambda r:
     f"{r['nodes_added']} / {r['nodes_removed']} / {r['nodes_removed_after_day']} / {r['nodes_left']}"),
    ("node-seconds over the day: existing / used / packed / lower bound", lambda r:
     "{existing} / {used} / {packed} / {bound}".format(**r["node_seconds"])),
    ("of the node-seconds used: on nodes a pod that is never moved keeps", lambda r: str(r["node_seconds"]["kept"])),
    ("existing over the lower bound", lambda r: f"{r['existing_over_bound_pct']}%"),
    ("used over the lower bound", lambda r: f"{r['used_over_bound_pct']}%"),
    ("while busy (bound >= 70% of its peak): existing / used over the bound",
     lambda r: "{existing}% / {used}%".format(**r["busy_over_bound_pct"])),
    ("used over first-fit-decreasing (nodes that hold them)", lambda r: f"{r['used_over_packed_pct']}%"),
    ("at the peak: existing / used / packed / bound",
     lambda r: "{existing} / {used} / {packed} / {bound}".format(**r["peak"]) if r["peak"] else "-"),
    ("after the day: last node removed (s)", lambda r: str(r["drain_s"])),
)  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    paths = [result[k] for k in ("scheduler", "controller") if k in result]
    lines = ["| | " + " | ".join(p["path"] for p in paths) + " |", "|---|" + "---|" * len(paths)]
    lines += [f"| {what} | " + " | ".join(show(p) for p in paths) + " |" for what, show in ROWS]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=500, help="pods over the day")
    parser.add_argument("--day-s", type=float, default=300.0, help="the day, compressed to this many seconds")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-nodes", type=int, default=100, help="the NodePool's limit")
    parser.add_argument("--consolidate-after", default="0s", help="the NodePool's consolidateAfter")
    parser.add_argument("--policy", default="binpack", help="the controller's --policy")
    parser.add_argument(
        "--lifetimes",
        action="store_true",
        help="the controller's claims say their pod's run time (gpu.fgpu.dev/expected-duration)",
    )
    parser.add_argument(
        "--empty-nodes",
        action="store_true",
        help="the controller's share pods are movable replicas and it empties nodes for Karpenter (--empty-nodes)",
    )
    parser.add_argument("--json", type=Path, help="write the whole result (with the series) here")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    args = parser.parse_args()
    # SIGTERM ends the run as Ctrl-C does: through the finally blocks that stop what it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run(args)
    table = markdown(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.markdown:
        args.markdown.write_text(table)
    print(table, flush=True)


if __name__ == "__main__":
    main()
