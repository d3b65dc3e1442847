"""Packing on the public Alibaba GPU-sharing trace (openb, cluster-trace-gpu-v2023) with the FGD
paper's protocol (Weng et al., USENIX ATC '23; ../shared/traces/openb/README.md), through fgpu's own
allocator over ResourceSlices built by fgpu's own code, next to the authors' published results.

Protocol: pods sorted by name and shuffled per seed; the list tuned to 130% of the cluster's GPU
capacity (drawing pods with replacement, or removing random ones); one pod at a time, never
departing; a pod that fits nowhere is dropped; after every pod the GPU thousandths allocated and
arrived are logged; the unallocated % at each arrived % is the mean over that bucket's events.

Mapping: one machine profile per GPU model (mock NVML, no MIG: the trace has none) offering whole
GPUs and MPS shares; a pod asking k whole GPUs is a claim for k devices of gpu.fgpu.dev, a sharing
pod (thousandths m < 1000) an MPS share of compute ceil(m / 10) % (the trace's values are whole
percents; the report counts any it had to round), gpu_spec a CEL selector on productName. Pod CPU
and memory fit: driver/scheduling/nodefit.py's NodeRoom, as the controller uses it. CPU-only pods are claims
without requests: the allocator places them with the same policy as GPU pods (fgpu places every
pod), or with --cpu-pods as deployed: kube-scheduler places them as its scoring would
(NodeResourcesFit's least-allocated, its default and the profile docs/allocator.md recommends, plus
BalancedAllocation, over the share of nodes it scores, ties at random: KubeScheduler), and the
allocator learns of them only as the controller does (their node's pods changed), with no commit.

  python -m bench.openb --trace default --seeds 42-51 --policy binpack
  python -m bench.openb --trace gpushare80 --seeds 42-44 --policy binpack --cpu-pods least-allocated
  python -m bench.openb --trace default --seeds 42 --policy fragmentation --every 4 --stop-at 111
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal, get_args

import yaml

from bench.allocator import DRIVER, classes, node_copy, percentile
from driver.allocator.cluster import ClusterAllocator, Failure, Placement, Snapshot
from driver.allocator.model import Claim, claim_from_object, class_from_object, slice_from_object
from driver.allocator.policies import POLICIES, Policy
from driver.allocator.state import AllocatedState
from driver.inventory.discovery import discover_gpus
from driver.inventory.offers import node_inventory
from driver.inventory.sharing import SharingConfig
from driver.inventory.slices import build_slices
from driver.nvml.session import NvmlSession
from driver.scheduling.nodefit import CPU, MEMORY, PODS, NodeFacts, NodeRoom, PodNeeds

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces" / "openb"
PUBLISHED = TRACES / "fgd_expected_results" / "analysis_allo_discrete.csv"
VARIANTS = ("default", "gpushare40", "gpushare60", "gpushare80", "gpushare100", "multigpu50", "gpuspec33", "cpu050")
TUNE_RATIO = 1.3
REPORTED = (95, 100, 110, 130)  # arrived % buckets printed
PODS_PER_NODE = 1001  # the simulator's node pod capacity: never the limit
SHARE_MEMORY = "256Mi"  # the trace has one scalar per GPU (compute); the smallest memory, so memory never binds
TUNED = "-tuned-"  # a clone's name: the original's, this, its number
CpuPods = Literal["policy", "least-allocated", "most-allocated"]
MiB = 2**20

# Mock NVML profiles per trace GPU model: memory as the real part has it (G2 and G3 are Alibaba's
# internal codes, their memory is not published); architecture is a stand-in the mock accepts (it
# knows Ampere and newer), read by nothing here.
MODELS: dict[str, tuple[str, int]] = {
    "G2": ("openb G2", 32768),
    "G3": ("openb G3", 32768),
    "T4": ("Tesla T4", 15360),
    "P100": ("Tesla P100-PCIE-16GB", 16280),
    "V100M16": ("Tesla V100-SXM2-16GB", 16160),
    "V100M32": ("Tesla V100-SXM2-32GB", 32510),
    "A10": ("NVIDIA A10", 22731),
}


# --gpu-pods-only: the taint a platform team puts on the nodes it keeps for pods with GPUs, and the
# toleration those pods carry (kube-scheduler keeps the pods without GPUs off such nodes)
GPU_PODS_ONLY = {"key": "gpu.fgpu.dev/gpu-pods-only", "value": "true", "effect": "NoSchedule"}
TOLERATES_GPU_PODS_ONLY = {"key": GPU_PODS_ONLY["key"], "operator": "Exists", "effect": "NoSchedule"}


@dataclass(frozen=True)
class TraceNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str
    gpu_pods_only: bool = False  # tainted GPU_PODS_ONLY


@dataclass(frozen=True)
class TracePod:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int  # per GPU; below 1000 only for a sharing pod (num_gpu 1)
    gpu_spec: tuple[str, ...] = ()  # allowed models; empty: any

    @property
    def gpu_total(self) -> int:
        return self.num_gpu * self.gpu_milli


def read_nodes(path: Path) -> list[TraceNode]:
    with path.open() as f:
        return [
            TraceNode(r["sn"], int(r["cpu_milli"]), int(r["memory_mib"]), int(r["gpu"]), r["model"])
            for r in csv.DictReader(f)
        ]


def read_pods(path: Path) -> list[TracePod]:
    with path.open() as f:
        return [
            TracePod(
                r["name"],
                int(r["cpu_milli"]),
                int(r["memory_mib"]),
                int(r["num_gpu"]),
                int(r["gpu_milli"]) if int(r["num_gpu"]) else 0,
                tuple(m for m in (r.get("gpu_spec") or "").split("|") if m),
            )
            for r in csv.DictReader(f)
        ]


# --- the protocol ---------------------------------------------------------------------------------


def workload(pods: Sequence[TracePod], capacity_milli: int, seed: int, ratio: float = TUNE_RATIO) -> list[TracePod]:
    """The pods of one run: sorted by name, shuffled, then tuned to `ratio` x capacity as the
    simulator's TunePodsByNodeTotalResource does (Python's generator seeded with `seed` stands for
    Go's math/rand: same steps, other draws)."""
    rng = random.Random(seed)
    ordered = sorted(pods, key=lambda p: p.name)
    rng.shuffle(ordered)
    target = ratio * capacity_milli
    total = sum(p.gpu_total for p in ordered)
    if ratio <= 0:
        return ordered
    if total > target:  # tuneDownPods: random pods out until the total is within the target
        while total > target:
            total -= ordered.pop(rng.randrange(len(ordered))).gpu_total
        return ordered
    tuned = list(ordered)
    index = 0
    while True:  # tuneUpPods: clones drawn with replacement, appended; the check reads per-GPU milli (sic)
        pod = ordered[rng.randrange(len(ordered))]
        if total + pod.gpu_milli > target:
            return tuned
        total += pod.gpu_total
        tuned.append(replace(pod, name=f"{pod.name}{TUNED}{index}"))
        index += 1


def buckets(events: Iterable[tuple[int, int]], capacity_milli: int) -> dict[int, float]:
    """Allocation % per arrived % bucket (0..130) from (arrived, used) GPU thousandths logged after
    each pod: arrived % rounded half to even, allocation % rounded to 2 places, their mean per
    bucket (rounded to 2), a bucket with no event taking the events within +-1 (merge_alloc_discrete.py)."""
    rows = [(round(a / capacity_milli * 100), round(u / capacity_milli * 100, 2)) for a, u in events]
    result = {}
    for bucket in range(131):
        values = [u for a, u in rows if a == bucket] or [u for a, u in rows if bucket - 1 <= a <= bucket + 1]
        if values:
            result[bucket] = round(statistics.mean(values), 2)
    return result


def unallocated(allocation: dict[int, float]) -> dict[int, float]:
    return {bucket: round(100 - value, 2) for bucket, value in allocation.items()}


def published(trace: str, path: Path = PUBLISHED) -> dict[str, dict[int, list[float]]]:
    """The authors' unallocated % per policy and bucket, one value per seed."""
    table: dict[str, dict[int, list[float]]] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            if row["workload"] != f"openb_pod_list_{trace}" or row["tune"] != str(TUNE_RATIO):
                continue
            policy = table.setdefault(row["sc_policy"].split("-", 1)[1], {})
            for bucket in REPORTED:
                if row.get(str(bucket)):
                    policy.setdefault(bucket, []).append(round(100 - float(row[str(bucket)]), 2))
    return table


# --- the cluster, as fgpu publishes it -------------------------------------------------------------


def machine_slices(model: str, gpus: int, node: str) -> list[dict[str, Any]]:
    """The slices fgpu's node plugin publishes on a node of `gpus` GPUs of a trace model (mock
    NVML from a machine profile written for it): whole GPUs and MPS shares."""
    product, memory_mib = MODELS[model]
    profile = {
        "name": f"openb-{model.lower()}x{gpus}",
        "gpuCount": gpus,
        "driverVersion": "580.95.05",
        "cudaDriverVersion": 13000,
        "gpu": {
            "productName": product,
            "architecture": "ampere",
            "cudaComputeCapability": "8.0",
            "pciDeviceId": 0x1000,
            "memoryMiB": memory_mib,
            "multiprocessors": 80,
            "migCapable": False,
        },
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "machine.yaml"
        path.write_text(yaml.safe_dump(profile))
        session = NvmlSession.open(f"mock:{path}")
        try:
            gpus_found = discover_gpus(session)
        finally:
            session.close()
    inventory = node_inventory(gpus_found, SharingConfig(default=frozenset({"whole", "mps"})))
    return build_slices(DRIVER, node, inventory, generation=1, owner=None)


def node_names(nodes: Sequence[TraceNode], seed: int) -> list[str]:
    """The nodes' names in the run of `seed`: the simulator puts a random permutation's number
    before each node name (ties broken at random)."""
    prefixes = random.Random(seed).sample(range(len(nodes)), len(nodes))
    return [f"p{prefix:04d}-{node.name}" for node, prefix in zip(nodes, prefixes, strict=True)]


def cluster(
    nodes: Sequence[TraceNode], seed: int, policy: Policy, pods_of: dict[str, list[PodNeeds]]
) -> tuple[ClusterAllocator, NodeRoom, list[str]]:
    """The allocator over every node's slices, and the nodes' room for pods (`pods_of`: each
    claim's pods, filled as they arrive)."""
    names = node_names(nodes, seed)
    templates: dict[tuple[str, int], str] = {}
    slices = []
    for serial, (node, name) in enumerate(zip(nodes, names, strict=True)):
        key = (node.model, node.gpus)
        if key not in templates:
            templates[key] = json.dumps(machine_slices(node.model, node.gpus, "openb-template"))
        copied = node_copy(templates[key], "openb-template", name, serial)
        slices.extend(slice_from_object(o) for o in json.loads(copied))
    device_classes = {c.name: c for c in map(class_from_object, classes())}
    allocator = ClusterAllocator(Snapshot.from_slices(slices), device_classes, AllocatedState(), policy)
    return allocator, pod_room(nodes, names, pods_of), names


def pod_room(nodes: Sequence[TraceNode], names: Sequence[str], pods_of: dict[str, list[PodNeeds]]) -> NodeRoom:
    """The nodes' room for pods (CPU, memory, pod count), by the names the run gives them."""
    facts = [
        NodeFacts(
            name,
            allocatable={
                CPU: Fraction(node.cpu_milli, 1000),
                MEMORY: Fraction(node.memory_mib * MiB),
                PODS: Fraction(PODS_PER_NODE),
            },
            taints=(GPU_PODS_ONLY,) if node.gpu_pods_only else (),
        )
        for name, node in zip(names, nodes, strict=True)
    ]
    return NodeRoom(facts, pods_of)


def share_compute(gpu_milli: int) -> int:
    """A share's MPS compute in percent (1% steps): thousandths rounded up."""
    return math.ceil(gpu_milli / 10)


def claim_object(pod: TracePod) -> dict[str, Any]:
    """The pod's ResourceClaim: k whole GPUs, or one MPS share; none for a CPU-only pod."""
    requests = []
    if pod.num_gpu:
        selectors = []
        if pod.gpu_spec:
            products = ", ".join(json.dumps(MODELS[m][0]) for m in sorted(set(pod.gpu_spec)))
            selectors = [{"cel": {"expression": f'device.attributes["{DRIVER}"].productName in [{products}]'}}]
        if pod.gpu_milli >= 1000:
            request = {"deviceClassName": "gpu.fgpu.dev", "count": pod.num_gpu}
        else:
            compute = str(share_compute(pod.gpu_milli))
            request = {"deviceClassName": "mps.gpu.fgpu.dev", "capacity": {"requests": {"compute": compute}}}
            request["capacity"]["requests"]["memory"] = SHARE_MEMORY
        requests = [{"name": "gpu", "exactly": {**request, "selectors": selectors}}]
    metadata = {"name": pod.name, "namespace": "openb", "uid": f"uid-{pod.name}"}
    return {"metadata": metadata, "spec": {"devices": {"requests": requests}}}


def pod_needs(pod: TracePod) -> PodNeeds:
    """What fit reads of the trace's pod: its CPU and memory; a pod with GPUs tolerates GPU_PODS_ONLY."""
    return PodNeeds(
        f"openb/{pod.name}",
        requests={CPU: Fraction(pod.cpu_milli, 1000), MEMORY: Fraction(pod.memory_mib * MiB)},
        tolerations=(TOLERATES_GPU_PODS_ONLY,) if pod.num_gpu else (),
    )


# --- kube-scheduler placing CPU-only pods, for the comparison -------------------------------------

MAX_NODE_SCORE = 100


def nodes_to_score(count: int) -> int:
    """How many feasible nodes kube-scheduler looks for before it scores them, with the default
    percentageOfNodesToScore (0: adaptive; pkg/scheduler/schedule_one.go numFeasibleNodesToFind)."""
    if count < 100:
        return count
    percentage = max(50 - count // 125, 5)
    return max(count * percentage // 100, 100)


def _fractions(room: NodeRoom, node: str, extra: dict[str, Fraction]) -> list[Fraction]:
    """CPU and memory requested on `node` with `extra` added, as shares of allocatable."""
    allocatable, requested = room.nodes[node].allocatable, room.requested[node]
    return [(requested.get(r, Fraction(0)) + extra.get(r, Fraction(0))) / allocatable[r] for r in (CPU, MEMORY)]


def _fit_score(shares: Sequence[Fraction], most: bool) -> int:
    """NodeResourcesFit's score, each resource weighted 1: LeastAllocated's (1 - share) x 100 or
    MostAllocated's share x 100 per resource, each truncated as kube-scheduler's int64 arithmetic
    does, then their mean."""
    per = [min(s, 1) if most else max(1 - s, 0) for s in shares]
    return sum(math.floor(p * MAX_NODE_SCORE) for p in per) // len(per)


def _balance(shares: Sequence[Fraction]) -> int:
    """balancedResourceScore: (1 - the standard deviation of the CPU and memory shares) x 100."""
    first, second = (min(float(s), 1.0) for s in shares)
    return int((1 - abs(first - second) / 2) * MAX_NODE_SCORE)


@dataclass
class KubeScheduler:
    """kube-scheduler placing a pod without claims with its default profile, the plugins whose
    scores differ across these nodes: NodeResourcesFit (LeastAllocated, the default; or
    MostAllocated) on CPU and memory plus NodeResourcesBalancedAllocation, both weighted 1. No
    profile of theirs can weigh the nodes' GPUs for such a pod: they skip an extended resource the
    pod does not request (resource_allocation.go, calculateNodeAllocatableRequest), the GPUs DRA
    backs included. As kube-scheduler does, it looks at the nodes from where its last search
    stopped (`start`, in the order its cache lists them: by name) until it has found
    nodes_to_score feasible ones, scores only those, and breaks ties at random. Requests are the
    pods' own (kube-scheduler counts a container without a CPU or memory request as 100m and
    200 MB; one pod of the trace has none)."""

    room: NodeRoom
    mode: CpuPods
    names: Sequence[str]
    rng: random.Random
    start: int = 0

    def node(self, claim: Claim) -> str | None:
        needs = self.room.pods_of[claim.key][0]
        feasible: list[str] = []
        wanted, count, looked = nodes_to_score(len(self.names)), len(self.names), 0
        while looked < count and len(feasible) < wanted:
            node = self.names[(self.start + looked) % count]
            looked += 1
            if self.room.fits(claim, node):
                feasible.append(node)
        self.start = (self.start + looked) % count
        best: list[str] = []
        top = -1
        for node in feasible:
            score = self._score(node, needs)
            if score > top:
                top, best = score, [node]
            elif score == top:
                best.append(node)
        return self.rng.choice(best) if best else None

    def _score(self, node: str, needs: PodNeeds) -> int:
        before, after = _fractions(self.room, node, {}), _fractions(self.room, node, needs.requests)
        # BalancedAllocation scores how much the pod improves the node's balance
        # (balancedResourceScorer): 75 for no change, towards 100 for better, 50 for worse.
        balanced = MAX_NODE_SCORE // 2 + (MAX_NODE_SCORE // 2 + _balance(after) - _balance(before)) // 2
        return _fit_score(after, most=self.mode == "most-allocated") + balanced


# --- one run -------------------------------------------------------------------------------------


@dataclass
class Run:
    seed: int
    unallocated: dict[int, float]
    failed: int
    claims: int
    seconds: float
    latencies: list[float]
    rounded_shares: int


def replay(
    nodes: Sequence[TraceNode],
    pods: Sequence[TracePod],
    seed: int,
    policy: Policy,
    cpu_pods: CpuPods = "policy",
    stop_at: float = TUNE_RATIO * 100,
) -> Run:
    """One seed's run; `stop_at` (arrived %) below 130 ends it early: the buckets above it are
    not measured (the last pods mostly fail, and a failing claim is the dearest to search for)."""
    capacity = 1000 * sum(n.gpus for n in nodes)
    pods_of: dict[str, list[PodNeeds]] = {}
    allocator, room, names = cluster(nodes, seed, policy, pods_of)
    scheduler = KubeScheduler(room, cpu_pods, sorted(names), random.Random(seed))
    arrived = used = failed = 0
    events: list[tuple[int, int]] = []
    latencies: list[float] = []
    for pod in workload(pods, capacity, seed):
        if arrived + pod.gpu_total > stop_at / 100 * capacity:
            break
        arrived += pod.gpu_total
        claim = claim_from_object(claim_object(pod))
        pods_of[claim.key] = [pod_needs(pod)]
        started = time.perf_counter()
        if pod.num_gpu == 0 and cpu_pods != "policy":
            placed = by_kube_scheduler(allocator, scheduler, claim) is not None
        else:
            placed = by_fgpu(allocator, room, claim) is not None
        if pod.num_gpu:
            latencies.append(time.perf_counter() - started)
        if placed:
            used += pod.gpu_total
        else:
            failed += 1
        events.append((arrived, used))
    rounded = sum(1 for p in pods if 0 < p.gpu_milli < 1000 and p.gpu_milli % 10)
    return Run(seed, unallocated(buckets(events, capacity)), failed, len(latencies), sum(latencies), latencies, rounded)


def by_fgpu(allocator: ClusterAllocator, room: NodeRoom, claim: Claim) -> Placement | None:
    """The claim placed by the allocator and committed, its pods counted in the room; None where
    it fits nowhere."""
    outcome = allocator.allocate(claim, room=room, why=False)  # failures are counted, not explained
    if isinstance(outcome, Failure):
        return None
    allocator.commit(outcome)
    room.take(outcome)
    return outcome


def by_kube_scheduler(allocator: ClusterAllocator, scheduler: KubeScheduler, claim: Claim) -> Placement | None:
    """A pod without claims placed as kube-scheduler would (KubeScheduler), as deployed: it
    runs there, so the room counts it, and the allocator, kept from pod to pod as the controller
    keeps it from pass to pass, learns only that the node's pods changed (what the controller tells
    it, driver/controller/allocators.py follow): no allocation is committed, as none is made. None
    where it fits nowhere."""
    node = scheduler.node(claim)
    if node is None:
        return None
    placement = Placement(claim, node, {"devices": {"results": []}})
    scheduler.room.take(placement)
    allocator.pods_changed([node])
    return placement


# --- report --------------------------------------------------------------------------------------


def seeds(text: str) -> list[int]:
    """`42-51` or `42,45`."""
    if "-" in text:
        first, last = (int(x) for x in text.split("-"))
        return list(range(first, last + 1))
    return [int(x) for x in text.split(",")]


def spread(values: Sequence[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.2f}" if values else "-"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def report(trace: str, policy: str, cpu_pods: CpuPods, runs: Sequence[Run], traces: Path = TRACES) -> dict[str, Any]:
    latencies = [x for r in runs for x in r.latencies]
    claims, seconds = sum(r.claims for r in runs), sum(r.seconds for r in runs)
    ours = {b: [r.unallocated[b] for r in runs if b in r.unallocated] for b in REPORTED}
    return {
        "trace": trace,
        "policy": policy,
        "cpu_pods": cpu_pods,
        "seeds": [r.seed for r in runs],
        "unallocated_pct": {b: spread(v) for b, v in ours.items()},
        "per_seed_at_100": [r.unallocated.get(100) for r in runs],
        "failed_pods": [r.failed for r in runs],
        "shares_rounded_to_1pct": runs[0].rounded_shares if runs else 0,
        "claims_per_s": round(claims / seconds, 1) if seconds else None,
        "p50_ms": round(statistics.median(latencies) * 1e3, 2) if latencies else None,
        "p99_ms": round(percentile(latencies, 0.99) * 1e3, 2) if latencies else None,
        "published": {
            name: {b: spread(v) for b, v in by_bucket.items()}
            for name, by_bucket in published(trace, traces / PUBLISHED.relative_to(TRACES)).items()
        },
    }


def table(result: dict[str, Any]) -> str:
    head = "| policy | " + " | ".join(f"{b}% arrived" for b in REPORTED) + " |"
    lines = [head, "|---" * (len(REPORTED) + 1) + "|"]
    ours = f"fgpu {result['policy']} (CPU-only pods: {result['cpu_pods']})"
    lines.append(f"| **{ours}** | " + " | ".join(result["unallocated_pct"][b] for b in REPORTED) + " |")
    for name, by_bucket in result["published"].items():
        lines.append(f"| {name} (published) | " + " | ".join(by_bucket.get(b, "-") for b in REPORTED) + " |")
    return "\n".join(lines)


def run(
    args: argparse.Namespace, progress: Callable[[str], None] = lambda line: print(line, flush=True)
) -> dict[str, Any]:
    nodes = protocol_nodes(args)
    pods = read_pods(args.traces / f"openb_pod_list_{args.trace}.csv")
    runs = []
    for seed in seeds(args.seeds):
        runs.append(replay(nodes, pods, seed, args.policy, args.cpu_pods, args.stop_at))
        last = runs[-1]
        progress(
            f"{args.trace} {args.policy} seed {seed}: unallocated at 95/100/110/130% arrived "
            f"{[last.unallocated.get(b) for b in REPORTED]}, {last.claims / last.seconds:.0f} claims/s"
        )
    return {
        **report(args.trace, args.policy, args.cpu_pods, runs, args.traces),
        "gpu_pods_only": sorted(args.gpu_pods_only),
    }


def protocol_arguments(doc: str | None) -> argparse.ArgumentParser:
    """A parser with the protocol's options: which trace, seeds and cluster, where to stop."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", choices=VARIANTS, default="default")
    parser.add_argument("--seeds", default="42-51", help="42-51 or 42,45")
    parser.add_argument("--traces", type=Path, default=TRACES, help="folder of the openb CSVs")
    parser.add_argument("--every", type=int, default=1, help="every Nth node only: a smaller cluster to iterate on")
    parser.add_argument("--stop-at", type=float, default=TUNE_RATIO * 100, help="end at this arrived %% (130: all)")
    return parser


def protocol_nodes(args: argparse.Namespace) -> list[TraceNode]:
    """The cluster the options ask for: every `--every`th node (protocol_arguments), those of the
    `--gpu-pods-only` models (main's) tainted against pods without GPUs."""
    nodes = read_nodes(args.traces / "openb_node_list_gpu_node.csv")[:: args.every]
    return [replace(node, gpu_pods_only=True) if node.model in args.gpu_pods_only else node for node in nodes]


def print_result(result: dict[str, Any], render: Callable[[dict[str, Any]], str]) -> None:
    """The table (`render`), then the figures as JSON."""
    print(render(result))
    print(json.dumps({k: v for k, v in result.items() if k != "published"}, indent=2))


def main() -> None:
    parser = protocol_arguments(__doc__)
    parser.add_argument("--policy", choices=POLICIES, default="binpack")
    parser.add_argument("--cpu-pods", choices=get_args(CpuPods), default="policy")
    parser.add_argument(
        "--gpu-pods-only",
        type=lambda text: frozenset(text.split(",")),
        default=frozenset(),
        metavar="MODEL[,MODEL]",
        help="nodes of these GPU models tainted against pods without GPUs (G3: the nodes only the largest pods fit)",
    )
    timed = parser.add_argument_group("in time (bench/openb_timed.py)")
    timed.add_argument("--timed", action="store_true", help="arrivals and departures in time, pods waiting")
    timed.add_argument("--speedup", type=float, default=1.0, help="arrival times divided by this")
    timed.add_argument("--tune", type=float, default=0.0, help="the pods tuned to this x capacity (0: as recorded)")
    timed.add_argument("--lifetimes", action="store_true", help="fgpu too with claims saying their run time")
    timed.add_argument(
        "--make-room", type=float, default=0.0, help="also fgpu making room: evictions per 1,000 arrivals"
    )
    args = parser.parse_args()
    if args.timed:
        from bench import openb_timed  # it builds on this module: loaded only when asked

        print_result(openb_timed.run(args), openb_timed.table)
    else:
        print_result(run(args), table)


if __name__ == "__main__":
    main()
