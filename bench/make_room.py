"""Making room on the packing trace with departures of `python -m bench.allocator packing`: GPUs in
use over the lower bound, and evictions per 1,000 arrivals, for plain binpack and with the planner
(driver/allocator/make_room.py) on: making room for claims that fail (their victims moved, never
killed), compaction after departures (moves that empty GPUs, those that free the most GPUs per
eviction first and none that frees fewer than --pays, within an eviction budget), and both. Every
allocation in the trace is movable. --policy places arrivals and moves with another policy (the
mode `binpack` is then that policy with no moves).

  python -m bench.make_room --nodes 16 --events 1500
  python -m bench.make_room --nodes 16 --events 1500 --budget 50 --compaction-moves 2
  python -m bench.make_room --nodes 16 --events 1500 --modes compaction --budget 1000 --compaction-moves 4 --pays 0
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.allocator import Demand, claim, classes, cluster_slices, lower_bound, packing_trace
from driver.allocator.cluster import ClusterAllocator, Failure, Placement, Snapshot
from driver.allocator.make_room import PAYS, Holder, compaction, make_room
from driver.allocator.model import claim_from_object, class_from_object, slice_from_object
from driver.allocator.policies import POLICIES, Policy
from driver.allocator.state import AllocatedState

MODES = ("binpack", "make-room", "compaction", "both")


@dataclass
class Live:
    holder: Holder
    demand: Demand


def gpus_used(live: Sequence[Live]) -> int:
    """GPUs with anything on them, counted as bench.allocator's packing counts them."""
    results = (r for entry in live for r in entry.holder.allocation["devices"]["results"])
    return len({(r["pool"], r["device"].split("-")[1]) for r in results})


def moved(holder: Holder, to: Placement) -> Holder:
    return Holder(holder.claim, to.node, to.allocation, holder.movable, holder.started)


def apply_moves(allocator: ClusterAllocator, live: list[Live], moves: dict[int, Placement]) -> None:
    """Victims released, then placed again where the plan says (id(holder) -> its new placement)."""
    for entry in live:
        if id(entry.holder) in moves:
            allocator.release(entry.holder.node, entry.holder.allocation)
    for entry in live:
        to = moves.get(id(entry.holder))
        if to is not None:
            allocator.commit(to)
            entry.holder = moved(entry.holder, to)


def cluster(nodes: int, policy: Policy = "binpack") -> ClusterAllocator:
    slices = [slice_from_object(s) for s in cluster_slices(nodes)]
    device_classes = {c.name: c for c in map(class_from_object, classes())}
    return ClusterAllocator(Snapshot.from_slices(slices), device_classes, AllocatedState(), policy)


def depart(allocator: ClusterAllocator, live: list[Live], rng: random.Random) -> None:
    """The departures before an arrival, as bench.allocator's packing draws them."""
    while live and rng.random() < 0.45:
        entry = live.pop(rng.randrange(len(live)))
        allocator.release(entry.holder.node, entry.holder.allocation)


def replay(
    args: argparse.Namespace, arrivals: list[tuple[str, dict[str, Any], Demand]]
) -> tuple[ClusterAllocator, list[Live]]:
    """Plain placement's state after the arrivals and their departures (for tests to plan on)."""
    allocator, live = cluster(args.nodes, getattr(args, "policy", "binpack")), []
    event_rng = random.Random(args.seed + 1)
    for arrival, (name, request, demand) in enumerate(arrivals):
        depart(allocator, live, event_rng)
        pending = claim_from_object(claim(name, request))
        outcome = allocator.allocate(pending)
        if isinstance(outcome, Placement):
            allocator.commit(outcome)
            live.append(Live(Holder(pending, outcome.node, outcome.allocation, True, arrival), demand))
    return allocator, live


def run(mode: str, args: argparse.Namespace, arrivals: list[tuple[str, dict[str, Any], Demand]]) -> dict[str, Any]:
    allocator, live = cluster(args.nodes, getattr(args, "policy", "binpack")), []
    pays = getattr(args, "pays", PAYS)
    touched, bounds, plan_seconds = [], [], []
    failed = evictions = made_room = emptied = 0
    event_rng = random.Random(args.seed + 1)
    for arrival, (name, request, demand) in enumerate(arrivals):
        depart(allocator, live, event_rng)
        budget = args.budget * (arrival + 1) / 1000 - evictions
        if mode in ("compaction", "both") and budget >= 1:
            started = time.perf_counter()
            holders = [e.holder for e in live]
            moves = compaction(allocator, holders, min(args.compaction_moves, int(budget)), pays=pays)
            plan_seconds.append(time.perf_counter() - started)
            apply_moves(allocator, live, {id(m.holder): m.to for m in moves})
            evictions += len(moves)
            emptied += bool(moves)
        pending = claim_from_object(claim(name, request))
        outcome = allocator.allocate(pending)
        if isinstance(outcome, Failure) and mode in ("make-room", "both"):
            started = time.perf_counter()
            plans = make_room(allocator, pending, [e.holder for e in live], limit=1)
            plan_seconds.append(time.perf_counter() - started)
            if plans:
                plan = plans[0]
                apply_moves(allocator, live, {id(v): m for v, m in zip(plan.victims, plan.moves, strict=True)})
                outcome = plan.placements[0]
                evictions += len(plan.victims)
                made_room += 1
        if isinstance(outcome, Failure):
            failed += 1
            continue
        allocator.commit(outcome)
        live.append(Live(Holder(pending, outcome.node, outcome.allocation, True, arrival), demand))
        touched.append(gpus_used(live))
        bounds.append(lower_bound([e.demand for e in live]))
    mean_used, mean_bound = statistics.mean(touched), statistics.mean(bounds)
    return {
        "mean_gpus_used": round(mean_used, 1),
        "lower_bound_mean": round(mean_bound, 1),
        "over_lower_bound_pct": round(100 * (mean_used / mean_bound - 1), 1),
        "placed": len(touched),
        "failed": failed,
        "made_room": made_room,
        "compactions": emptied,
        "evictions": evictions,
        "evictions_per_1000_arrivals": round(1000 * evictions / len(arrivals), 1),
        "plan_ms_mean": round(1e3 * statistics.mean(plan_seconds), 1) if plan_seconds else None,
        "plan_ms_max": round(1e3 * max(plan_seconds), 1) if plan_seconds else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--events", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--budget", type=float, default=50, help="compaction's evictions per 1,000 arrivals")
    parser.add_argument("--compaction-moves", type=int, default=2, help="moves one compaction call may plan")
    parser.add_argument(
        "--pays", type=float, default=PAYS, help="GPUs a compaction plan must free per eviction (0: any plan)"
    )
    parser.add_argument("--policy", choices=POLICIES, default="binpack", help="placement of arrivals and moves")
    parser.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES))
    args = parser.parse_args()
    arrivals = packing_trace(args.events, args.seed)
    report = {
        "nodes": args.nodes,
        "events": args.events,
        "policy": args.policy,
        "budget": args.budget,
        "pays": args.pays,
    }
    report.update({mode: run(mode, args, arrivals) for mode in args.modes})
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
