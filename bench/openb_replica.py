"""A small pure-Python replica of the FGD simulator's placement (hkust-adsl/kubernetes-scheduler-simulator,
commit 8f3d641: pkg/simulator/plugin/fgd_score.go, best_fit_score.go, open_gpu_share.go, pkg/utils/frag.go),
replayed with bench/openb.py's own protocol (trace readers, shuffle and tuning, buckets, published CSV).

Purpose: check that our harness reproduces the published FGD and BestFit figures, so that our
`fragmentation` policy (bench/openb.py) is compared with FGD run in the same harness (same Python
RNG, same tuning, same bucket metric), and find what makes FGD better, fast (seconds a seed on the
full cluster instead of minutes through our allocator).

What it replicates (the simulator's code):
- a node: CPU and memory left, its GPUs' thousandths left in device order, its GPU model;
- filters: CPU and memory fit (NodeResourcesFit); the pod's gpu_spec names the node's model; a
  sharing pod needs one GPU with >= its thousandths left, a pod of k whole GPUs k free GPUs;
- typical pods (GetTypicalPods with the run scripts' settings: CPU-only pods included, popularity
  threshold 95%, step 1, no GPU weight): the distinct (cpu, gpu_milli, num_gpu, gpu_spec) of the
  original trace (before tuning), most frequent first (ties: larger cpu, milli, num, spec first),
  taken until they cover 95% of the pods, weights renormalised over those taken;
- F(node) (NodeGpuShareFragAmountScore): over the typical pods, weight x the node's GPU thousandths
  left, all of them unless the typical pod fits (model, CPU, enough GPUs with its thousandths), then
  only the GPUs with less than its thousandths left. A CPU-only typical pod counts all of them
  (class XL/XR is not Q3);
- FGD's score: int(sigmoid((F before - F after) / 1000) x 100), truncated to an integer, the pod's
  CPU counted in the state after; a sharing pod: the GPU whose score is highest (the first in device
  order among equal scores); a whole-GPU pod: the first free GPUs;
- BestFit's score: int((1 - (0.5 (cpu left - cpu) / 128000 + 0.5 (GPU left - GPU asked) / 8000)) x 100)
  (its min-max normalisation keeps the top set), the tightest GPU for a sharing pod;
- equal top scores: the node whose name is the smallest (the simulator's vendored kube-scheduler,
  core/generic_scheduler.go selectHost, patched "for reproducibility": not at random), names being
  prefixed with a per-seed random permutation ("%04d-", syncClusterResourceList): a fixed random
  node order per seed, the first node in it among the best.

Variants (to find what makes FGD better than our policy): `--typical online` learns the typical
pods from the pods seen so far, again at 16, 32, 64, ... pods (as driver/allocator/fragmentation.py
does); `--no-cpu-pods`, `--weigh-devices`, `--one-cpu`, `--exact`, `--ties random`: see --help.
`--strand` adds our policy's stranding term (driver/allocator/fragmentation.py) to F: per typical
GPU pod the node's model can run, the GPU thousandths left beyond what as many of it as the CPU
left feeds would use. `--supply` (with `--one-cpu`) adds its supply weighting: a CPU size of a
GPU request that only nodes holding under half the GPUs of its most common one's have is a typical
pod of its own, and such a pod weighs (GPUs its request could use / GPUs on nodes with its CPU) more.

  python -m bench.openb_replica --trace default --seeds 42-51 --policy fgd
  python -m bench.openb_replica --trace default --seeds 42-49 --policy fgd --every 4 --typical online
"""

from __future__ import annotations

import argparse
import bisect
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from bench.openb import (
    REPORTED,
    TRACES,
    TUNE_RATIO,
    TraceNode,
    TracePod,
    buckets,
    node_names,
    print_result,
    protocol_arguments,
    published,
    read_nodes,
    read_pods,
    seeds,
    spread,
    unallocated,
    workload,
)
from driver.allocator.fragmentation import SCARCE_SUPPLY, supply_weight

MILLI = 1000
MAX_SPEC_CPU = 128000  # BestFit's normalisers (open-gpu-share utils/const.go)
MAX_SPEC_GPU = 8000
POPULARITY = 0.95  # typicalPodsConfig.podPopularityThreshold in generate_config_and_run.py
FIRST_LEARN = 16  # online: as driver/allocator/fragmentation.py

Policy = Literal["fgd", "bestfit"]
Ties = Literal["name", "random", "fullest"]


@dataclass(frozen=True)
class Spec:
    """The simulator's PodResource: what scoring sees of a pod (memory is a filter only)."""

    cpu: int
    milli: int  # per GPU; 0 for a CPU-only pod
    num: int
    gpu_type: str = ""  # allowed models joined by '|'; '' for any

    @property
    def sharing(self) -> bool:
        return self.num == 1 and self.milli < MILLI


def spec_of(pod: TracePod) -> Spec:
    return Spec(pod.cpu_milli, pod.gpu_milli if pod.num_gpu else 0, pod.num_gpu, "|".join(pod.gpu_spec))


@dataclass(frozen=True)
class Typical:
    spec: Spec
    weight: float


@dataclass(frozen=True)
class Mix:
    """How the typical pods are built: the simulator's settings by default; the others are the
    choices our fragmentation policy made, to measure each."""

    cpu_pods: bool = True  # CPU-only pods among them
    weigh_devices: bool = False  # each pod counts num_gpu times (ours), not once
    one_cpu: bool = False  # one CPU size per GPU request, the most common (ours)
    threshold: float = POPULARITY
    supply: bool = False  # scarce CPU sizes kept apart and weighed up by their supply (ours)


def typical_pods(specs: Iterable[Spec], mix: Mix = Mix(), nodes: Sequence[TraceNode] = ()) -> tuple[Typical, ...]:
    """GetTypicalPods: the most frequent specs up to the threshold, weights over those taken;
    with `mix.supply`, a spec whose pod's CPU only nodes holding under SCARCE_SUPPLY of the GPUs
    its request could use have weighs that many times more (driver/allocator/fragmentation.py)."""
    counts: Counter[Spec] = Counter()
    for spec in specs:
        if spec.num or mix.cpu_pods:
            counts[spec] += max(spec.num, 1) if mix.weigh_devices else 1
    if mix.one_cpu:
        counts = _one_cpu(counts, nodes if mix.supply else ())
    total = sum(counts.values())
    ranked = sorted(counts.items(), key=lambda kv: (kv[1], kv[0].cpu, kv[0].milli, kv[0].num, kv[0].gpu_type))
    taken: list[tuple[Spec, float]] = []
    covered = 0.0
    while ranked and covered < mix.threshold * total:
        spec, count = ranked.pop()
        taken.append((spec, count))
        covered += count
    # as Go computes it: count / total, then over covered / total (the last bits decide truncations)
    weighed = [(spec, (count / total) / (covered / total)) for spec, count in taken]
    return tuple(Typical(spec, weight * (_scarcity(spec, nodes) if mix.supply else 1.0)) for spec, weight in weighed)


def supply(spec: Spec, nodes: Sequence[TraceNode], cpu: bool) -> int:
    """The GPUs on nodes with enough GPUs of a model the spec accepts, and with `cpu`, the CPU
    for its pod (memory is not counted: typical pods do not carry it)."""
    return sum(
        n.gpus
        for n in nodes
        if n.gpus >= spec.num and accessible(n.model, spec.gpu_type) and (not cpu or n.cpu_milli >= spec.cpu)
    )


def _scarcity(spec: Spec, nodes: Sequence[TraceNode]) -> float:
    return supply_weight(supply(spec, nodes, True), supply(spec, nodes, False))


def _one_cpu(counts: Counter[Spec], nodes: Sequence[TraceNode] = ()) -> Counter[Spec]:
    """Specs merged per GPU request, each with its most common CPU size; with `nodes`, a CPU size
    whose nodes hold under SCARCE_SUPPLY of the GPUs the most common one's do is kept apart."""
    merged: Counter[Spec] = Counter()
    cpus: dict[tuple[int, int, str], Counter[int]] = {}
    for spec, count in counts.items():
        cpus.setdefault((spec.milli, spec.num, spec.gpu_type), Counter())[spec.cpu] += count
    for (milli, num, gpu_type), by_cpu in cpus.items():
        main = Spec(by_cpu.most_common(1)[0][0], milli, num, gpu_type)
        rest = sum(by_cpu.values())
        enough = SCARCE_SUPPLY * supply(main, nodes, True)
        for cpu, count in by_cpu.items():
            if cpu != main.cpu and nodes and supply(Spec(cpu, milli, num, gpu_type), nodes, True) < enough:
                merged[Spec(cpu, milli, num, gpu_type)] = count
                rest -= count
        merged[main] = rest
    return merged


def accessible(model: str, gpu_type: str) -> bool:
    """IsNodeAccessibleToPodByType: no type named, or the node's model among them."""
    allowed = [t for t in gpu_type.split("|") if t]
    return not allowed or model in allowed


def frag_amount(
    cpu_left: int, gpus: Sequence[int], model: str, typical: Sequence[Typical], strand: bool = False
) -> float:
    """NodeGpuShareFragAmountScore: the expected GPU thousandths left that the typical pods cannot
    use; with `strand`, also those beyond what the typical GPU pods the CPU left feeds would use."""
    total = sum(gpus)
    amount = 0.0
    for t in typical:
        s = t.spec
        if s.milli and accessible(model, s.gpu_type) and cpu_left >= s.cpu and _hosts(gpus, s):
            amount += t.weight * sum(g for g in gpus if g < s.milli)  # Q3: only the GPUs too small for it
        else:  # XL/XR (CPU-only), no access, lack of GPU or CPU: everything left
            amount += t.weight * total
        if strand and s.milli and accessible(model, s.gpu_type):
            fed = (cpu_left // s.cpu) * s.milli * s.num if s.cpu else total
            amount += t.weight * max(0, total - fed)
    return amount


def _hosts(gpus: Sequence[int], spec: Spec) -> bool:
    """CanNodeHostPodOnGpuMemory: enough GPUs with the pod's thousandths left."""
    return sum(1 for g in gpus if g >= spec.milli) >= spec.num


def fgd_score(before: float, after: float, exact: bool = False) -> float:
    """int64(sigmoid((before - after) / 1000) * MaxNodeScore): ties are common, broken at random."""
    value = 1.0 / (1.0 + math.exp(-(before - after) / 1000)) * 100
    return value if exact else float(int(value))


def bestfit_score(cpu_left: int, gpu_left: int, spec: Spec) -> float:
    score = 0.0
    score += (cpu_left - spec.cpu) / MAX_SPEC_CPU * 0.5
    score += (gpu_left - spec.milli * spec.num) / MAX_SPEC_GPU * 0.5
    return float(int((1.0 - score) * 100))


# --- the cluster ---------------------------------------------------------------------------------


@dataclass
class Node:
    name: str
    model: str
    cpu_left: int
    memory_left: int
    gpus: list[int]  # thousandths left per GPU, in device order

    def fits(self, pod: TracePod, spec: Spec) -> bool:
        if self.cpu_left < spec.cpu or self.memory_left < pod.memory_mib:
            return False
        return not spec.num or (accessible(self.model, spec.gpu_type) and _hosts(self.gpus, spec))

    def take(self, pod: TracePod, spec: Spec, gpu_ids: Sequence[int], sign: int = 1) -> None:
        self.cpu_left -= sign * spec.cpu
        self.memory_left -= sign * pod.memory_mib
        for i in gpu_ids:
            self.gpus[i] -= sign * spec.milli

    def give_back(self, pod: TracePod, spec: Spec, gpu_ids: Sequence[int]) -> None:
        """The reverse of take (a pod leaving: bench/openb_timed.py)."""
        self.take(pod, spec, gpu_ids, -1)


def exclusive_gpus(gpus: Sequence[int], spec: Spec) -> list[int]:
    """AllocateExclusiveGpuId: the first free GPUs in device order."""
    return [i for i, g in enumerate(gpus) if g == MILLI][: spec.num]


def after_sub(gpus: Sequence[int], spec: Spec) -> list[int]:
    """NodeResource.Sub's GPUs: the request taken from the least-left GPUs that fit, ascending."""
    out = list(gpus)
    wanted = spec.num
    for i in sorted(range(len(out)), key=lambda i: out[i]):
        if wanted and spec.milli <= out[i]:
            out[i] -= spec.milli
            wanted -= 1
    return out


@dataclass
class Scorer:
    """Node scores for one policy; F is kept by (model, CPU class, GPUs left as a multiset), the
    CPU class being how many typical CPU sizes the CPU left covers: all that F reads of the CPU."""

    policy: Policy
    typical: tuple[Typical, ...] = ()
    exact: bool = False
    strand: bool = False
    _cpu_steps: list[int] = field(default_factory=list)
    _frag: dict[tuple[str, int, tuple[int, ...]], float] = field(default_factory=dict)

    def set_typical(self, typical: tuple[Typical, ...]) -> None:
        self.typical = typical
        self._cpu_steps = sorted({t.spec.cpu for t in typical})
        self._frag.clear()

    def frag(self, model: str, cpu_left: int, gpus: Sequence[int]) -> float:
        # with `strand` F reads how many pods the CPU feeds, not only which sizes fit: keyed exactly
        cpu = cpu_left if self.strand else bisect.bisect_right(self._cpu_steps, cpu_left)
        key = (model, cpu, tuple(sorted(gpus)))
        found = self._frag.get(key)
        if found is None:
            found = self._frag[key] = frag_amount(cpu_left, gpus, model, self.typical, self.strand)
        return found

    def score(self, node: Node, spec: Spec) -> tuple[float, list[int]]:
        """The node's score for the pod and the GPUs it would take there."""
        if self.policy == "bestfit":
            return bestfit_score(node.cpu_left, sum(node.gpus), spec), self._bestfit_gpus(node.gpus, spec)
        before = self.frag(node.model, node.cpu_left, node.gpus)
        cpu_after = node.cpu_left - spec.cpu
        if spec.sharing:
            best: tuple[float, list[int]] | None = None
            for i, left in enumerate(node.gpus):
                if left >= spec.milli:
                    gpus = list(node.gpus)
                    gpus[i] -= spec.milli
                    score = fgd_score(before, self.frag(node.model, cpu_after, gpus), self.exact)
                    if best is None or score > best[0]:  # the first GPU among equal scores
                        best = (score, [i])
            assert best is not None, "filtered nodes have a GPU that fits"
            return best
        after = self.frag(node.model, cpu_after, after_sub(node.gpus, spec))
        return fgd_score(before, after, self.exact), exclusive_gpus(node.gpus, spec)

    @staticmethod
    def _bestfit_gpus(gpus: Sequence[int], spec: Spec) -> list[int]:
        if not spec.sharing:
            return exclusive_gpus(gpus, spec)
        fitting = [i for i, g in enumerate(gpus) if g >= spec.milli]
        return [min(fitting, key=lambda i: (gpus[i], i))]  # the tightest, the first among equals


# --- one run -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    policy: Policy = "fgd"
    typical: Literal["given", "online"] = "given"
    mix: Mix = Mix()
    exact: bool = False
    ties: Ties = "name"
    stop_at: float = TUNE_RATIO * 100
    strand: bool = False


@dataclass
class Result:
    seed: int
    unallocated: dict[int, float]
    failed: int
    pods: int
    seconds: float


def build_nodes(nodes: Sequence[TraceNode], seed: int) -> list[Node]:
    """The cluster in the simulator's node order: names prefixed by a random permutation, sorted
    (equal top scores go to the first)."""
    built = [
        Node(name, n.model, n.cpu_milli, n.memory_mib, [MILLI] * n.gpus)
        for n, name in zip(nodes, node_names(nodes, seed), strict=True)
    ]
    return sorted(built, key=lambda n: n.name)


def replay(nodes: Sequence[TraceNode], pods: Sequence[TracePod], seed: int, options: Options = Options()) -> Result:
    """One seed: bench/openb.py's workload, placed by the replica; (arrived, used) logged after each pod."""
    started = time.perf_counter()
    capacity = MILLI * sum(n.gpus for n in nodes)
    cluster = build_nodes(nodes, seed)
    scorer = Scorer(options.policy, exact=options.exact, strand=options.strand)
    if options.policy == "fgd" and options.typical == "given":
        scorer.set_typical(typical_pods(map(spec_of, pods), options.mix, nodes))
    ties = random.Random(f"ties-{seed}")
    # per node: pod (spec, memory) -> (score, GPUs) or None where it does not fit; dropped when the node changes
    kept: list[dict[tuple[Spec, int], tuple[float, list[int]] | None]] = [{} for _ in cluster]
    seen: list[Spec] = []
    learn_at = FIRST_LEARN
    arrived = used = failed = count = 0
    events: list[tuple[int, int]] = []
    for pod in workload(pods, capacity, seed):
        if arrived + pod.gpu_total > options.stop_at / 100 * capacity:
            break
        count += 1
        spec = spec_of(pod)
        if options.policy == "fgd" and options.typical == "online":
            seen.append(spec)
            if len(seen) >= learn_at:
                learn_at *= 2
                scorer.set_typical(typical_pods(seen, options.mix, nodes))
                kept = [{} for _ in cluster]
        arrived += pod.gpu_total
        chosen = _choose(cluster, kept, scorer, pod, spec, options.ties, ties)
        if chosen is None:
            failed += 1
        else:
            index, gpu_ids = chosen
            cluster[index].take(pod, spec, gpu_ids)
            kept[index] = {}
            used += pod.gpu_total
        events.append((arrived, used))
    return Result(seed, unallocated(buckets(events, capacity)), failed, count, time.perf_counter() - started)


def _choose(
    cluster: Sequence[Node],
    kept: list[dict[tuple[Spec, int], tuple[float, list[int]] | None]],
    scorer: Scorer,
    pod: TracePod,
    spec: Spec,
    ties: Ties,
    rng: random.Random,
) -> tuple[int, list[int]] | None:
    """The node (index) with the top score and its GPUs; equal top scores: the first (the smallest
    name, as the simulator), one at random (upstream kube-scheduler), or the fullest (ours)."""
    key = (spec, pod.memory_mib)
    top = -math.inf
    best: list[int] = []
    for index, node in enumerate(cluster):
        memo = kept[index]
        if key in memo:
            found = memo[key]
        else:
            found = memo[key] = scorer.score(node, spec) if node.fits(pod, spec) else None
        if found is None:
            continue
        if found[0] > top:
            top, best = found[0], [index]
        elif found[0] == top:
            best.append(index)
    if not best:
        return None
    if ties == "random":
        index = rng.choice(best)
    elif ties == "fullest":  # our fragmentation policy's: binpack's order, the least GPU left (share) first
        index = min(best, key=lambda i: (sum(cluster[i].gpus) / max(len(cluster[i].gpus), 1), i))
    else:
        index = best[0]
    found = kept[index][key]
    assert found is not None
    return index, found[1]


# --- report --------------------------------------------------------------------------------------


def label(options: Options) -> str:
    parts = [options.policy]
    if options.policy == "fgd":
        parts.append(f"typical {options.typical}")
        defaults = Mix()
        for name in ("cpu_pods", "weigh_devices", "one_cpu", "threshold", "supply"):
            if getattr(options.mix, name) != getattr(defaults, name):
                parts.append(f"{name}={getattr(options.mix, name)}")
        if options.exact:
            parts.append("exact")
        if options.strand:
            parts.append("strand")
    if options.ties != "name":
        parts.append(f"ties {options.ties}")
    return ", ".join(parts)


def report(trace: str, options: Options, runs: Sequence[Result], traces: Path = TRACES) -> dict[str, object]:
    ours = {b: [r.unallocated[b] for r in runs if b in r.unallocated] for b in REPORTED}
    return {
        "trace": trace,
        "replica": label(options),
        "seeds": [r.seed for r in runs],
        "unallocated_pct": {b: spread(v) for b, v in ours.items()},
        "per_seed_at_100": [r.unallocated.get(100) for r in runs],
        "mean_at_100": round(statistics.mean(ours[100]), 3) if ours[100] else None,
        "failed_pods": [r.failed for r in runs],
        "seconds_per_seed": [round(r.seconds, 1) for r in runs],
        "published": published(trace, traces / "fgd_expected_results" / "analysis_allo_discrete.csv"),
    }


def table(result: dict[str, object]) -> str:
    head = "| policy | " + " | ".join(f"{b}% arrived" for b in REPORTED) + " |"
    lines = [head, "|---" * (len(REPORTED) + 1) + "|"]
    ours: dict[int, str] = result["unallocated_pct"]  # type: ignore[assignment]
    lines.append(f"| **replica: {result['replica']}** | " + " | ".join(ours[b] for b in REPORTED) + " |")
    theirs: dict[str, dict[int, list[float]]] = result["published"]  # type: ignore[assignment]
    for name in ("FGD", "BestFit"):
        if name in theirs:
            lines.append(
                f"| {name} (published) | " + " | ".join(spread(theirs[name].get(b, [])) for b in REPORTED) + " |"
            )
    return "\n".join(lines)


def options_from(args: argparse.Namespace) -> Options:
    mix = Mix(not args.no_cpu_pods, args.weigh_devices, args.one_cpu, args.threshold, args.supply)
    return Options(args.policy, args.typical, mix, args.exact, args.ties, args.stop_at, args.strand)


def run(args: argparse.Namespace, progress: Callable[[str], None] = lambda line: print(line, flush=True)) -> dict:
    nodes = read_nodes(args.traces / "openb_node_list_gpu_node.csv")[:: args.every]
    pods = read_pods(args.traces / f"openb_pod_list_{args.trace}.csv")
    options = options_from(args)
    runs = []
    for seed in seeds(args.seeds):
        runs.append(replay(nodes, pods, seed, options))
        last = runs[-1]
        progress(
            f"{args.trace} {label(options)} seed {seed}: unallocated at 95/100/110/130% arrived "
            f"{[last.unallocated.get(b) for b in REPORTED]}, {last.failed} failed, {last.seconds:.1f} s"
        )
    return report(args.trace, options, runs, args.traces)


def main() -> None:
    parser = protocol_arguments(__doc__)
    parser.add_argument("--policy", choices=("fgd", "bestfit"), default="fgd")
    parser.add_argument("--typical", choices=("given", "online"), default="given", help="FGD's typical pods")
    parser.add_argument("--no-cpu-pods", action="store_true", help="typical pods without CPU-only pods")
    parser.add_argument("--weigh-devices", action="store_true", help="a pod counts num_gpu times in the mix")
    parser.add_argument("--one-cpu", action="store_true", help="one CPU size (the most common) per GPU request")
    parser.add_argument("--threshold", type=float, default=POPULARITY, help="typical pods up to this share")
    parser.add_argument("--exact", action="store_true", help="FGD's score not truncated to an integer")
    parser.add_argument("--supply", action="store_true", help="scarce CPU sizes weighed up by their supply (ours)")
    parser.add_argument("--strand", action="store_true", help="F counts GPUs the CPU left cannot feed (ours)")
    parser.add_argument(
        "--ties",
        choices=("name", "random", "fullest"),
        default="name",
        help="equal top scores: the smallest name (the simulator's), at random (upstream's), the fullest (ours)",
    )
    print_result(run(parser.parse_args()), table)


if __name__ == "__main__":
    main()
