"""Allocator benchmarks.

throughput: N nodes x 8 H100 (whole GPUs, MIG placements, MPS and time-slice shares) and a mixed
claim stream, allocated one claim at a time by ours and by the reference allocator CLI
(k8s.io/dynamic-resource-allocation/structured) on the same files in the same run.

packing: a trace of MIG and MPS requests arriving and leaving; GPUs still touched at each arrival
under our binpack scoring vs first fit (our search in upstream's order: pool, slice, device, and
nodes by name), against the lower bound (total demand / GPU size, rounded up). With --lifetimes,
claims leave when their lifetime is over and say how long they expect to run: binpack and
fragmentation with the allocator reading those hints and not.

hostile: how long one claim of n time-slice requests and one that cannot be met holds the
allocator on one DGX H100 node (issue 38): 8^n orders to try, cut by the search budget.

  python -m bench.allocator throughput --nodes 1000 --claims 400
  python -m bench.allocator throughput --nodes 5000 --claims 400 --no-reference
  python -m bench.allocator throughput --nodes 500 --claims 400 --mig-shares 3g.40gb
  python -m bench.allocator packing --nodes 16 --events 3000
  python -m bench.allocator packing --nodes 16 --events 3000 --lifetimes --hint-noise 0.5
  python -m bench.allocator hostile
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import random
import re
import resource
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from driver.allocator.allocate import SEARCH_STEPS, SearchBudget
from driver.allocator.cluster import ClusterAllocator, Failure, Placement, Snapshot
from driver.allocator.lifetimes import EXPECTED_DURATION, MAX_DURATION_S
from driver.allocator.model import claim_from_object, class_from_object, slice_from_object
from driver.allocator.state import AllocatedState
from driver.inventory.devices import MPS_DEFAULT_COMPUTE
from driver.inventory.discovery import discover_gpus
from driver.inventory.offers import node_inventory
from driver.inventory.sharing import DEFAULT_KINDS, SharingConfig
from driver.inventory.slices import build_slices
from driver.nvml.session import NvmlSession
from testbed.cluster.harness import build_binaries

ROOT = Path(__file__).resolve().parents[1]
DRIVER = "gpu.fgpu.dev"
SHARE_MEMORY_GIB = 79.5  # what an H100 80GB offers MPS shares (81408Mi)
PROFILES = ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb"]


def sharing(mig_shares: Sequence[str]) -> SharingConfig:
    """Every GPU's default kinds; with `mig_shares`, also MPS shares inside those MIG profiles."""
    if not mig_shares:
        return SharingConfig()
    return SharingConfig(default=DEFAULT_KINDS | {"mig-mps"}, mig_share_profiles=frozenset(mig_shares))


def cluster_slices(nodes: int, mig_shares: Sequence[str] = ()) -> list[dict[str, Any]]:
    inventory = node_inventory(discover_gpus(NvmlSession.open("mock:dgx-h100")), sharing(list(mig_shares)))
    return [s for i in range(nodes) for s in build_slices(DRIVER, f"node-{i:04d}", inventory, generation=1, owner=None)]


def node_slices_json(nodes: int, mig_shares: Sequence[str] = ()) -> list[str]:
    """Each node's slices as the API server sends them (JSON text): one node's built by the node
    plugin's code, copied per node with its own name and GPU UUIDs (building them anew for every
    node would take minutes at 5,000 nodes; the copies differ where real nodes differ)."""
    template = json.dumps(cluster_slices(1, mig_shares))
    return [node_copy(template, "node-0000", f"node-{i:04d}", i) for i in range(nodes)]


_GPU_UUID = re.compile(r"(GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-)[0-9a-f]{12}")


def node_copy(template: str, template_node: str, node: str, serial: int) -> str:
    """One node's slices (JSON text) as another node's: its name, and GPU UUIDs ending in `serial`."""
    return _GPU_UUID.sub(lambda m: f"{m.group(1)}{serial:012x}", template.replace(template_node, node))


def classes() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((ROOT / "daemonset" / "deviceclasses.yaml").read_text()) if d]


def claim(name: str, request: dict[str, Any]) -> dict[str, Any]:
    metadata = {"name": name, "namespace": "bench", "uid": f"uid-{name}"}
    body = {"devices": {"requests": [{"name": "r", "exactly": request}]}}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": metadata, "spec": body}


def mig(profile: str) -> dict[str, Any]:
    expression = f'device.attributes["{DRIVER}"].profile == "{profile}"'
    return {"deviceClassName": "mig.gpu.fgpu.dev", "selectors": [{"cel": {"expression": expression}}]}


def mps(memory_gib: int) -> dict[str, Any]:
    return {"deviceClassName": "mps.gpu.fgpu.dev", "capacity": {"requests": {"memory": f"{memory_gib}Gi"}}}


def mig_mps(profile: str, memory_gib: int) -> dict[str, Any]:
    expression = f'device.attributes["{DRIVER}"].profile == "{profile}"'
    return {
        "deviceClassName": "mig-mps.gpu.fgpu.dev",
        "selectors": [{"cel": {"expression": expression}}],
        "capacity": {"requests": {"memory": f"{memory_gib}Gi"}},
    }


def mixed_stream(count: int, rng: random.Random, mig_shares: Sequence[str] = ()) -> list[dict[str, Any]]:
    """30% whole GPUs, 40% MIG devices, 30% MPS shares; with `mig_shares`, 15 of the 30 points of
    MPS shares are shares inside a partition of one of those profiles instead."""
    claims = []
    for i in range(count):
        kind = rng.random()
        if kind < 0.3:
            request = {"deviceClassName": "gpu.fgpu.dev", "count": rng.choice([1, 1, 2, 4])}
        elif kind < 0.7:
            request = mig(rng.choice(PROFILES))
        elif mig_shares and kind < 0.85:
            request = mig_mps(rng.choice(list(mig_shares)), rng.choice([2, 5, 10]))
        else:
            request = mps(rng.choice([2, 5, 10, 20]))
        claims.append(claim(f"c{i:05d}", request))
    return claims


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def reference_run(nodes: list[str], device_classes: list[dict[str, Any]], claims: list[dict[str, Any]]):
    """The reference CLI on the same objects: its answer, wall time (parsing included), peak RSS."""
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for name, objects in (("classes", device_classes), ("claims", claims)):
            path = Path(tmp) / f"{name}.json"
            path.write_text(json.dumps({"kind": "List", "items": objects}))
            files.append(str(path))
        slices = Path(tmp) / "slices.json"
        with slices.open("w") as out:  # node by node: the whole list as objects would not fit at 5,000 nodes
            out.write('{"kind": "List", "items": [')
            out.write(",".join(text[1:-1] for text in nodes))
            out.write("]}")
        started = time.perf_counter()
        argv = [str(build_binaries() / "allocate"), files[0], str(slices), files[1]]
        run = subprocess.run(argv, capture_output=True, text=True, check=True)
        wall = time.perf_counter() - started
    return json.loads(run.stdout), wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def build_allocator(
    nodes: list[str], device_classes: list[dict[str, Any]]
) -> tuple[ClusterAllocator, dict[str, float]]:
    """From raw slices to an allocator ready for its first claim, node by node as an informer's
    pages arrive: JSON decoding (the API client's work) timed apart from ours (parse and gather)."""
    gc.collect()
    before = rss_mib()
    decode = parse = parse_cpu = 0.0
    slices = []
    for text in nodes:
        started = time.perf_counter()
        objects = json.loads(text)
        decoded, cpu = time.perf_counter(), time.process_time()
        slices.extend(slice_from_object(obj) for obj in objects)
        gc.freeze()  # as the controller's slices informer does after each page
        parse += time.perf_counter() - decoded
        parse_cpu += time.process_time() - cpu
        decode += decoded - started
        del objects
    started, cpu = time.perf_counter(), time.process_time()
    snapshot = Snapshot.from_slices(slices)
    by_name = {c.name: c for c in map(class_from_object, device_classes)}
    allocator = ClusterAllocator(snapshot, by_name, AllocatedState(), "binpack")
    gather, gather_cpu = time.perf_counter() - started, time.process_time() - cpu
    del slices
    gc.collect()
    return allocator, {
        "json_decode_s": round(decode, 1),
        "parse_s": round(parse, 1),
        "gather_s": round(gather, 1),
        "ready_s": round(parse + gather, 1),  # raw slices (decoded) -> ready
        "ready_cpu_s": round(parse_cpu + gather_cpu, 1),  # the same in CPU time: what a shared machine distorts least
        "state_mib": round(rss_mib() - before),
    }


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    nodes, device_classes = node_slices_json(args.nodes, args.mig_shares), classes()
    claims = mixed_stream(args.claims, rng, args.mig_shares)
    report: dict[str, Any] = {
        "nodes": args.nodes,
        "mig_shares": args.mig_shares,
        "devices": sum(len(s["spec"].get("devices", [])) for s in json.loads(nodes[0])) * args.nodes,
        "claims": args.claims,
        "raw_json_mib": round(sum(map(len, nodes)) / 2**20),
    }
    allocator, setup = build_allocator(nodes, device_classes)
    latencies, allocated = [], 0
    started = time.perf_counter()
    for obj in claims:
        begin = time.perf_counter()
        outcome = allocator.allocate(claim_from_object(obj))
        if not isinstance(outcome, Failure):
            allocator.commit(outcome)
            allocated += 1
        latencies.append(time.perf_counter() - begin)
    ours_seconds = time.perf_counter() - started
    report["ours"] = {
        "allocated": allocated,
        "claims_per_s": round(args.claims / ours_seconds, 1),
        "p50_ms": round(statistics.median(latencies) * 1e3, 2),
        "p99_ms": round(percentile(latencies, 0.99) * 1e3, 2),
        **setup,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }
    if args.reference:
        del allocator
        gc.collect()
        reference, wall, rss = reference_run(nodes, device_classes, claims)
        ref_latencies = [r["seconds"] for r in reference["results"]]
        report["reference"] = {
            "allocated": reference["allocated"],
            "claims_per_s": round(args.claims / reference["seconds"], 1),
            "p50_ms": round(statistics.median(ref_latencies) * 1e3, 2),
            "p99_ms": round(percentile(ref_latencies, 0.99) * 1e3, 2),
            "wall_s_with_parsing": round(wall, 1),
            "peak_rss_mib": round(rss),
        }
        report["ratio_ours_over_reference"] = round(reference["seconds"] / ours_seconds, 2)
    return report


def _martello_toth_l2(sizes: list[float]) -> int:
    """The L2 lower bound on bins of size 1 (Martello and Toth): items above 1 - a and above 1/2
    each need a bin of their own; items in [a, 1/2] fill what those leave, at best."""
    best = math.ceil(sum(sizes) - 1e-9)
    for alpha in {x for x in sizes if x <= 0.5} | {0.0}:
        big = [x for x in sizes if x > 1 - alpha + 1e-9]
        middle = [x for x in sizes if 0.5 + 1e-9 < x <= 1 - alpha + 1e-9]
        small = [x for x in sizes if alpha - 1e-9 <= x <= 0.5 + 1e-9]
        room = len(middle) - sum(middle)
        best = max(best, len(big) + len(middle) + max(0, math.ceil(sum(small) - room - 1e-9)))
    return best


def lower_bound(demands: list[tuple[str, float, float]]) -> int:
    """GPUs needed at least: MIG and MPS never share a GPU; each kind needs its memory and its
    compute, each bounded with L2 (a share's or profile's size as a fraction of one GPU)."""
    need = 0
    for wanted in ("mig", "mps"):
        memory = [m for kind, m, _ in demands if kind == wanted]
        compute = [c for kind, _, c in demands if kind == wanted]
        need += max(_martello_toth_l2(memory), _martello_toth_l2(compute))
    return need


Demand = tuple[str, float, float]  # kind, memory and compute as a share of one GPU (lower_bound's terms)


def packing_trace(events: int, seed: int) -> list[tuple[str, dict[str, Any], Demand]]:
    """The arrivals of the packing trace: 60% MIG profiles, 40% MPS shares, with their demand."""
    rng = random.Random(seed)
    # (memory slices of 8, compute slices of 7) per profile; MPS shares: of 79.5 GiB, 10% compute.
    sizes = {"1g.10gb": (1, 1), "1g.20gb": (2, 1), "2g.20gb": (2, 2), "3g.40gb": (4, 3), "4g.40gb": (4, 4)}
    trace: list[tuple[str, dict[str, Any], Demand]] = []
    for i in range(events):
        if rng.random() < 0.6:
            profile = rng.choice(PROFILES)
            trace.append((f"m{i}", mig(profile), ("mig", sizes[profile][0] / 8, sizes[profile][1] / 7)))
        else:
            gib = rng.choice([5, 10, 20, 40])
            trace.append((f"s{i}", mps(gib), ("mps", gib / SHARE_MEMORY_GIB, MPS_DEFAULT_COMPUTE / 100)))
    return trace


def packing(args: argparse.Namespace) -> dict[str, Any]:
    """GPUs in use (any allocation on them) after each arrival, averaged over the trace (with
    --lifetimes: packing_lifetimes)."""
    if args.lifetimes:
        return packing_lifetimes(args)
    slices = [slice_from_object(s) for s in cluster_slices(args.nodes)]
    device_classes = {c.name: c for c in map(class_from_object, classes())}
    trace = packing_trace(args.events, args.seed)
    results = {}
    for policy in ("binpack", "first-fit"):
        allocator = ClusterAllocator(Snapshot.from_slices(slices), device_classes, AllocatedState(), policy)
        live: list[tuple[str, dict[str, Any], Demand]] = []
        touched, bounds, failed = [], [], 0
        event_rng = random.Random(args.seed + 1)
        for name, request, demand in trace:
            while live and args.departures and event_rng.random() < 0.45:  # steady load
                node, allocation, _ = live.pop(event_rng.randrange(len(live)))
                allocator.release(node, allocation)
            outcome = allocator.allocate(claim_from_object(claim(name, request)))
            if isinstance(outcome, Failure):
                failed += 1
                if not args.departures:
                    break  # arrivals only: measure up to the first claim that no longer fits
                continue
            allocator.commit(outcome)
            live.append((outcome.node, outcome.allocation, demand))
            used = {(r["pool"], r["device"].split("-")[1]) for _, a, _ in live for r in a["devices"]["results"]}
            touched.append(len(used))
            bounds.append(lower_bound([d for _, _, d in live]))
        results[policy] = {
            "mean_gpus_used": round(statistics.mean(touched), 1),
            "final_gpus_used": touched[-1],
            "final_lower_bound": bounds[-1],
            "placed": len(touched),
            "failed": failed,
        }
        results["lower_bound_mean"] = round(statistics.mean(bounds), 1)
    for policy in ("binpack", "first-fit"):
        results[policy]["over_lower_bound_pct"] = round(
            100 * (results[policy]["mean_gpus_used"] / results["lower_bound_mean"] - 1), 1
        )
    return {"nodes": args.nodes, "events": args.events, "departures": args.departures, **results}


EVENT_S = 60.0  # --lifetimes: simulated seconds between arrivals
EPOCH = 1_700_000_000.0  # --lifetimes: the simulated clock's start (seconds since the epoch)


def lifetimes(events: int, seed: int) -> list[float]:
    """--lifetimes: each arrival's lifetime in seconds, from the seed: half short (10-70 arrivals'
    time: jobs, notebooks tried out), half long (250-750: training, services), so that about 60% of
    16 nodes' GPUs are in use at steady load."""
    rng = random.Random(seed + 2)
    return [EVENT_S * (rng.uniform(10, 70) if rng.random() < 0.5 else rng.uniform(250, 750)) for _ in range(events)]


def hinted_claim(name: str, request: dict[str, Any], created: float, hint_s: float | None) -> dict[str, Any]:
    """claim() created at `created` (seconds since the epoch), annotated with its expected
    duration where `hint_s` is given (driver/allocator/lifetimes.py reads both)."""
    return with_lifetime(claim(name, request), created, hint_s)


def with_lifetime(obj: dict[str, Any], created: float, hint_s: float | None) -> dict[str, Any]:
    """The claim object created at `created` (seconds since the epoch) and annotated with its
    expected duration where `hint_s` is given (at most the 30 days the annotation may say)."""
    obj["metadata"]["creationTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
    if hint_s is not None:
        obj["metadata"]["annotations"] = {EXPECTED_DURATION: f"{max(1, min(round(hint_s), int(MAX_DURATION_S)))}s"}
    return obj


def packing_lifetimes(args: argparse.Namespace) -> dict[str, Any]:
    """--lifetimes: the packing trace's arrivals, one every EVENT_S, each leaving when its lifetime
    (lifetimes()) is over instead of at random; each claim says its expected duration (its
    lifetime times e^(hint_noise x N(0, 1)), drawn from the seed). Per policy, GPUs in use and the
    lower bound at each arrival, with the allocator reading the hints and not (lifetime_hints)."""
    slices = [slice_from_object(s) for s in cluster_slices(args.nodes)]
    device_classes = {c.name: c for c in map(class_from_object, classes())}
    trace = packing_trace(args.events, args.seed)
    lives = lifetimes(args.events, args.seed)
    noise = random.Random(args.seed + 3)
    hints = [life * math.exp(args.hint_noise * noise.gauss(0, 1)) for life in lives]
    results: dict[str, Any] = {}
    for policy, hinted in itertools.product(("binpack", "fragmentation"), (False, True)):
        state = AllocatedState()
        allocator = ClusterAllocator(Snapshot.from_slices(slices), device_classes, state, policy, hinted)
        live: dict[str, tuple[float, Placement, Demand]] = {}  # name -> when it ends, placement, demand
        touched, bounds, failed = [], [], 0
        for i, (name, request, demand) in enumerate(trace):
            now = EPOCH + i * EVENT_S
            for gone in [n for n, (end, _, _) in live.items() if end <= now]:
                _, placement, _ = live.pop(gone)
                allocator.release(placement.node, placement.allocation, placement.claim)
            outcome = allocator.allocate(claim_from_object(hinted_claim(name, request, now, hints[i])))
            if isinstance(outcome, Failure):
                failed += 1
                continue
            allocator.commit(outcome)
            live[name] = (now + lives[i], outcome, demand)
            results_now = (r for _, p, _ in live.values() for r in p.allocation["devices"]["results"])
            touched.append(len({(r["pool"], r["device"].split("-")[1]) for r in results_now}))
            bounds.append(lower_bound([d for _, _, d in live.values()]))
        over = [t - b for t, b in zip(touched, bounds, strict=True)]
        results[f"{policy}, hints {'read' if hinted else 'off'}"] = {
            "mean_gpus_used": round(statistics.mean(touched), 1),
            "mean_lower_bound": round(statistics.mean(bounds), 1),
            "mean_gpus_over_lower_bound": round(statistics.mean(over), 1),
            "over_lower_bound_pct": round(100 * (statistics.mean(touched) / statistics.mean(bounds) - 1), 1),
            "placed": len(touched),
            "failed": failed,
        }
    return {"nodes": args.nodes, "events": args.events, "lifetimes": True, "hint_noise": args.hint_noise, **results}


def hostile(args: argparse.Namespace) -> dict[str, Any]:
    """Per n, the seconds and steps one hostile claim takes: n time-slice requests then a request
    no order of them leaves room for (8 whole GPUs), and the same with one no device matches."""
    allocator, _ = build_allocator(node_slices_json(1), classes())
    impossible = {
        "eight whole GPUs": {"deviceClassName": "gpu.fgpu.dev", "count": 8},
        "no device matches": mig("9g.900gb"),
    }
    results: dict[str, Any] = {"search_steps": SEARCH_STEPS}
    for label, last in impossible.items():
        for n in range(3, 9):
            requests = [{"name": f"ts{i}", "exactly": {"deviceClassName": "timeslice.gpu.fgpu.dev"}} for i in range(n)]
            obj = claim(f"hostile-{n}", {})
            obj["spec"]["devices"]["requests"] = [*requests, {"name": "last", "exactly": last}]
            budget = SearchBudget(SEARCH_STEPS)
            started = time.perf_counter()
            outcome = allocator.allocate(claim_from_object(obj), budget=budget)
            seconds = round(time.perf_counter() - started, 3)
            assert isinstance(outcome, Failure)
            results[f"{label}, n={n}"] = {"seconds": seconds, "steps": budget.spent, "cut": budget.exhausted}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["throughput", "packing", "hostile"])
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--claims", type=int, default=400)
    parser.add_argument("--events", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--departures", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--lifetimes",
        action="store_true",
        help="packing: claims leave when their lifetime is over and say their expected duration (hints read and not)",
    )
    parser.add_argument(
        "--hint-noise", type=float, default=0.0, help="--lifetimes: the hints' error, sigma of a log-normal factor"
    )
    parser.add_argument(
        "--mig-shares", nargs="*", default=[], metavar="PROFILE", help="also MPS shares inside these MIG profiles"
    )
    args = parser.parse_args()
    modes = {"throughput": throughput, "packing": packing, "hostile": hostile}
    print(json.dumps(modes[args.mode](args), indent=2))


if __name__ == "__main__":
    main()
