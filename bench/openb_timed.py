"""The openb trace replayed in time (issue 43): pods arrive at their recorded creation times and
leave their recorded run time after they are placed; a pod that fits nowhere waits, and is tried
again when a pod leaves a node it might now fit (kube-scheduler's queueing hints: an event on a
node that cannot help a pod does not wake it). Each policy runs on the same arrivals, in the same
run: fgpu's allocator (over the slices the plugin publishes, `bench/openb.py`) and the FGD and
BestFit replicas (`bench/openb_replica.py`); with `--cpu-pods` other than `policy` (kube-scheduler's
stand-in places fgpu's CPU-only pods) FGD's replica again with the same stand-in placing its
CPU-only pods, as FGD would run where fgpu is deployed; with `--make-room N` fgpu again, moving
running pods (never killing them) to make room for a waiting one, at most N evictions per 1,000
arrivals.

Where the protocol departs from the paper's (no departures, pods sent one at a time, tuned to 130%
of capacity): the pods are the trace's own, untuned and unshuffled (the seed orders the nodes, as
the simulator's name prefixes do, and nothing else); a pod's run time is its deletion time less
its scheduled time (less its creation time when the trace never scheduled it), at least 1 s.
Recorded times alone never fill the cluster: at most 56 pods (65.6 GPUs, 1.1% of 6,212) are alive
at once, so nothing waits and every policy is the same. `--speedup k` divides the arrival times
by k and keeps the run times: the busy month's arrivals come k times as fast, the load rises.

  python -m bench.openb --timed --trace default --seeds 42 --speedup 30000
  python -m bench.openb --timed --trace default --seeds 42 --speedup 30000 --make-room 50
"""

from __future__ import annotations

import argparse
import csv
import heapq
import json
import math
import random
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from bench.allocator import EPOCH, percentile, with_lifetime
from bench.openb import (
    TUNED,
    CpuPods,
    KubeScheduler,
    TraceNode,
    TracePod,
    by_fgpu,
    by_kube_scheduler,
    claim_object,
    cluster,
    node_names,
    pod_needs,
    pod_room,
    protocol_nodes,
    read_pods,
    seeds,
    workload,
)
from bench.openb_replica import MILLI, Node, Scorer, Spec, build_nodes, spec_of, typical_pods
from bench.openb_replica import _choose as replica_choose
from driver.allocator.cluster import Failure, Placement
from driver.allocator.make_room import Holder, make_room
from driver.allocator.model import Claim, claim_from_object
from driver.allocator.policies import Policy
from driver.scheduling.nodefit import PodNeeds

SAMPLES = 400  # holes counted this many times over the arrival window
SEARCHES_PER_EVICTION = 1  # plans looked for, at most, for each eviction the budget allows


@dataclass(frozen=True)
class TimedPod:
    pod: TracePod
    arrival: float  # seconds from the trace's start, divided by the speedup
    runtime: float  # seconds it runs once placed


Times = dict[str, tuple[int, int, int | None]]  # pod name -> creation, deletion, scheduled (or None)


def read_times(path: Path) -> Times:
    """Pod name -> (creation, deletion, scheduled or None) in seconds from the trace's start."""
    with path.open() as f:
        return {
            r["name"]: (
                int(r["creation_time"]),
                int(r["deletion_time"]),
                int(r["scheduled_time"]) if r["scheduled_time"] else None,
            )
            for r in csv.DictReader(f)
        }


def timed_pods(pods: Iterable[TracePod], times: Times, speedup: float) -> list[TimedPod]:
    """The pods in arrival order (ties by name), each with its run time; a clone the tuning added
    (bench/openb.py, workload) arrives and runs as its original."""
    timed = []
    for pod in pods:
        created, deleted, scheduled = times[pod.name.split(TUNED)[0]]
        runtime = max(1.0, float(deleted - (scheduled if scheduled is not None else created)))
        timed.append(TimedPod(pod, created / speedup, runtime))
    return sorted(timed, key=lambda t: (t.arrival, t.pod.name))


# --- where pods are, as every policy's run sees it -------------------------------------------------


@dataclass(frozen=True)
class Spot:
    node: str
    gpus: tuple[int, ...]  # GPU indices on the node; empty for a CPU-only pod


@dataclass
class NodeLeft:
    model: str
    cpu_milli: int
    memory_mib: int
    gpus: list[int]  # thousandths left per GPU


class Ledger:
    """What each node has left, kept from where the policies put pods: the queue's hints and the
    holes read it, the same for every policy."""

    def __init__(self, nodes: dict[str, TraceNode]) -> None:
        self.nodes = {name: NodeLeft(n.model, n.cpu_milli, n.memory_mib, [MILLI] * n.gpus) for name, n in nodes.items()}
        self.used_milli = 0  # GPU thousandths allocated, all nodes

    def take(self, pod: TracePod, spot: Spot, sign: int = 1) -> None:
        left = self.nodes[spot.node]
        left.cpu_milli -= sign * pod.cpu_milli
        left.memory_mib -= sign * pod.memory_mib
        for gpu in spot.gpus:
            left.gpus[gpu] -= sign * pod.gpu_milli
        self.used_milli += sign * pod.gpu_milli * len(spot.gpus)

    def give_back(self, pod: TracePod, spot: Spot) -> None:
        self.take(pod, spot, -1)

    def may_fit(self, pod: TracePod, node: str) -> bool:
        """Whether the pod could run on the node (CPU, memory, model, GPUs): never False where it fits."""
        left = self.nodes[node]
        if left.cpu_milli < pod.cpu_milli or left.memory_mib < pod.memory_mib:
            return False
        if not pod.num_gpu:
            return True
        if pod.gpu_spec and left.model not in pod.gpu_spec:
            return False
        return sum(1 for g in left.gpus if g >= pod.gpu_milli) >= pod.num_gpu

    def holes(self, waiting: Iterable[TracePod]) -> tuple[int, int]:
        """(GPUs partly used, those of them no waiting GPU pod could use): a partly used GPU is a
        hole while a GPU pod waits and none that accepts its model asks for no more than it has
        left. Nothing waiting: no holes."""
        smallest: dict[str, int] = {}  # model ('' any) -> the smallest share a waiting pod asks
        for pod in waiting:
            if pod.num_gpu == 1 and pod.gpu_milli < MILLI:
                for model in pod.gpu_spec or ("",):
                    smallest[model] = min(smallest.get(model, MILLI), pod.gpu_milli)
            elif pod.num_gpu:
                smallest.setdefault("", MILLI)
        partly = holes = 0
        for left in self.nodes.values():
            usable = min(smallest.get(left.model, MILLI), smallest.get("", MILLI))
            for g in left.gpus:
                if 0 < g < MILLI:
                    partly += 1
                    holes += bool(smallest) and g < usable
        return partly, holes


# --- the policies --------------------------------------------------------------------------------


class Placer(Protocol):
    def place(self, pod: TracePod) -> Spot | None: ...
    def fits_on(self, pod: TracePod, nodes: Sequence[str]) -> bool: ...
    def remove(self, pod: TracePod) -> None: ...


def _gpu_indices(allocation: dict[str, Any]) -> tuple[int, ...]:
    """The GPUs an allocation's devices are on (`gpu-<i>` and `gpu-<i>-mps`)."""
    return tuple(sorted({int(r["device"].split("-")[1]) for r in allocation["devices"]["results"]}))


@dataclass
class Moved:
    pod: TracePod
    was: Spot
    now: Spot


class FgpuPlacer:
    """fgpu's allocator and the controller's room for pods, kept across the run; CPU-only pods by
    the policy or kube-scheduler's stand-in (bench/openb.py, `--cpu-pods`)."""

    def __init__(
        self,
        nodes: Sequence[TraceNode],
        seed: int,
        policy: Policy,
        cpu_pods: CpuPods,
        lifetimes: Mapping[str, TimedPod] | None = None,
    ) -> None:
        """`lifetimes`: each pod's claim says its run time (gpu.fgpu.dev/expected-duration, exact),
        created at its arrival (docs/allocator.md, Shares that end together); None: no claim does."""
        self.pods_of: dict[str, list[PodNeeds]] = {}
        self.allocator, self.room, names = cluster(nodes, seed, policy, self.pods_of)
        self.cpu_pods = cpu_pods
        self.scheduler = KubeScheduler(self.room, cpu_pods, sorted(names), random.Random(seed))
        self.lifetimes = lifetimes
        self.placed: dict[str, tuple[Placement, int]] = {}  # pod name -> where, its placement's number
        self.placements = 0  # placed so far: a holder's start order for making room (younger moves first)
        self.claims: dict[str, Claim] = {}
        self.pods: dict[str, TracePod] = {}

    def _claim(self, pod: TracePod) -> Claim:
        claim = self.claims.get(pod.name)
        if claim is None:
            obj = claim_object(pod)
            if self.lifetimes is not None:
                timed = self.lifetimes[pod.name]
                obj = with_lifetime(obj, EPOCH + timed.arrival, timed.runtime)
            claim = self.claims[pod.name] = claim_from_object(obj)
            self.pods_of[claim.key] = [pod_needs(pod)]
            self.pods[pod.name] = pod
        return claim

    def place(self, pod: TracePod) -> Spot | None:
        claim = self._claim(pod)
        if pod.num_gpu == 0 and self.cpu_pods != "policy":
            placement = by_kube_scheduler(self.allocator, self.scheduler, claim)
        else:
            placement = by_fgpu(self.allocator, self.room, claim)
        return None if placement is None else self._record(pod, placement)

    def fits_on(self, pod: TracePod, nodes: Sequence[str]) -> bool:
        claim = self._claim(pod)
        if pod.num_gpu == 0 and self.cpu_pods != "policy":
            return any(self.room.fits(claim, node) for node in nodes)
        return not isinstance(self.allocator.allocate(claim, sorted(nodes), self.room, why=False), Failure)

    def _record(self, pod: TracePod, placement: Placement) -> Spot:
        self.placements += 1
        self.placed[pod.name] = (placement, self.placements)
        return Spot(placement.node, _gpu_indices(placement.allocation))

    def remove(self, pod: TracePod) -> None:
        placement, _ = self.placed.pop(pod.name)
        self.room.give_back(placement)
        self.allocator.release(placement.node, placement.allocation, placement.claim)
        self.allocator.pods_changed([placement.node])  # its CPU and memory back, as the controller hears

    def make_room(self, pod: TracePod) -> tuple[Spot, list[Moved]] | None:
        """Room made for a GPU pod by moving running GPU pods (each fits again elsewhere, its CPU
        and memory too): the pod's spot and the moves, or None."""
        claim = self._claim(pod)
        holders = [
            Holder(p.claim, p.node, p.allocation, True, started)
            for p, started in self.placed.values()
            if p.allocation["devices"]["results"]
        ]
        plans = make_room(self.allocator, claim, holders, limit=1, room=self.room)
        if not plans or not plans[0].victims:
            return None
        plan = plans[0]
        victims = [self.placed[v.claim.name][0] for v in plan.victims]
        for victim in victims:
            self.room.give_back(victim)
        if not self._room_takes([*plan.moves, *plan.placements]):
            for victim in victims:
                self.room.take(victim)
            return None
        moved = []
        for victim in victims:
            self.allocator.release(victim.node, victim.allocation, victim.claim)
        for victim, to in zip(victims, plan.moves, strict=True):
            self.allocator.commit(to)
            victim_pod = self.pods[victim.claim.name]
            was = Spot(victim.node, _gpu_indices(victim.allocation))
            moved.append(Moved(victim_pod, was, self._record(victim_pod, to)))
        placement = plan.placements[0]
        self.allocator.commit(placement)
        return self._record(pod, placement), moved

    def _room_takes(self, placements: Sequence[Placement]) -> bool:
        """Counts each placement's pods in the room if all of them fit, in order; else none."""
        taken: list[Placement] = []
        for placement in placements:
            if not self.room.fits(placement.claim, placement.node):
                for done in taken:
                    self.room.give_back(done)
                return False
            self.room.take(placement)
            taken.append(placement)
        return True


class ReplicaPlacer:
    """The FGD or BestFit replica (bench/openb_replica.py): its nodes, scores and memo. With
    `cpu_pods` other than "policy", kube-scheduler's stand-in places the CPU-only pods, as where
    fgpu is deployed: its room for pods counts every pod, the replica's too."""

    def __init__(
        self, nodes: Sequence[TraceNode], pods: Sequence[TracePod], seed: int, policy: str, cpu_pods: CpuPods = "policy"
    ) -> None:
        self.cluster: list[Node] = build_nodes(nodes, seed)
        self.index = {node.name: i for i, node in enumerate(self.cluster)}
        self.scorer = Scorer("fgd" if policy == "fgd" else "bestfit")
        if policy == "fgd":
            self.scorer.set_typical(typical_pods(map(spec_of, pods), nodes=nodes))
        self.kept: list[dict[tuple[Spec, int], tuple[float, list[int]] | None]] = [{} for _ in self.cluster]
        self.placed: dict[str, tuple[int, list[int]]] = {}
        self.pods_of: dict[str, list[PodNeeds]] = {}
        self.claims: dict[str, Claim] = {}  # pod name -> its claim, for kube-scheduler's stand-in and room
        self.scheduler: KubeScheduler | None = None
        if cpu_pods != "policy":
            names = node_names(nodes, seed)
            room = pod_room(nodes, names, self.pods_of)
            self.scheduler = KubeScheduler(room, cpu_pods, sorted(names), random.Random(seed))

    def place(self, pod: TracePod) -> Spot | None:
        spec = spec_of(pod)
        if self.scheduler is not None and not pod.num_gpu:
            node = self.scheduler.node(self._claim(pod))
            chosen = None if node is None else (self.index[node], [])
        else:
            chosen = replica_choose(self.cluster, self.kept, self.scorer, pod, spec, "name", None)  # type: ignore[arg-type]
        if chosen is None:
            return None
        index, gpus = chosen
        self.cluster[index].take(pod, spec, gpus)
        self.kept[index] = {}
        self.placed[pod.name] = (index, gpus)
        if self.scheduler is not None:
            self.scheduler.room.take(self._placement(pod, index))
        return Spot(self.cluster[index].name, tuple(gpus))

    def _claim(self, pod: TracePod) -> Claim:
        """The pod's claim (made once), its pods counted in the room's `pods_of`."""
        claim = self.claims.get(pod.name)
        if claim is None:
            claim = self.claims[pod.name] = claim_from_object(claim_object(pod))
            self.pods_of[claim.key] = [pod_needs(pod)]
        return claim

    def _placement(self, pod: TracePod, index: int) -> Placement:
        """What the room counts: the pod on the node (its devices are the replica's)."""
        return Placement(self._claim(pod), self.cluster[index].name, {"devices": {"results": []}})

    def fits_on(self, pod: TracePod, nodes: Sequence[str]) -> bool:
        spec = spec_of(pod)
        return any(self.cluster[self.index[node]].fits(pod, spec) for node in nodes)

    def remove(self, pod: TracePod) -> None:
        index, gpus = self.placed.pop(pod.name)
        self.cluster[index].give_back(pod, spec_of(pod), gpus)
        self.kept[index] = {}
        if self.scheduler is not None:
            self.scheduler.room.give_back(self._placement(pod, index))


# --- the replay ----------------------------------------------------------------------------------


Step = tuple[float, int, int]  # from this time on: GPU thousandths allocated, waiting


@dataclass
class Clock:
    """What changes over time: the GPUs allocated and waiting (a step function), the holes counted
    every `step` seconds while the cluster is busy (pods arriving or waiting), and when it last was."""

    start: float
    step: float
    steps: list[Step] = field(default_factory=list)
    next_sample: float = 0.0
    samples: int = 0
    partly: int = 0
    holes: int = 0
    busy_until: float = 0.0
    last: float = 0.0

    def __post_init__(self) -> None:
        self.next_sample = self.busy_until = self.last = self.start

    def advance(
        self, now: float, used_milli: int, waiting_milli: int, holes: Callable[[], tuple[int, int]] | None
    ) -> None:
        """The values from `now` on (its events done); the holes counted at the sample times passed
        (`holes` None: the cluster was idle, nothing waited, the samples skip ahead)."""
        if not self.steps or self.steps[-1][1:] != (used_milli, waiting_milli):
            self.steps.append((now, used_milli, waiting_milli))
        while self.step and self.next_sample <= now:
            if holes is None:
                self.next_sample += self.step * math.ceil((now - self.next_sample) / self.step + 1e-9)
                break
            partly, unusable = holes()
            self.samples, self.partly, self.holes = self.samples + 1, self.partly + partly, self.holes + unusable
            self.next_sample += self.step
        if holes is not None:
            self.busy_until = now
        self.last = now


def time_means(steps: Sequence[Step], start: float, end: float) -> tuple[float, float]:
    """GPUs allocated and waiting, averaged over [start, end]."""
    if end <= start:
        return 0.0, 0.0
    allocated = waiting = 0.0
    for (since, used, queued), (until, _, _) in zip(steps, [*steps[1:], (end, 0, 0)], strict=True):
        span = max(0.0, min(until, end) - max(since, start))
        allocated, waiting = allocated + used * span, waiting + queued * span
    return allocated / MILLI / (end - start), waiting / MILLI / (end - start)


@dataclass
class TimedRun:
    label: str
    seed: int
    arrivals: int
    clock: Clock
    gpu_hours_waited: float
    wait_p50_s: float
    wait_p99_s: float
    waited_by_kind: dict[str, float]  # GPU-hours
    waited: int  # pods that waited at all
    never_placed: int
    evictions: int
    attempts: int
    seconds: float

    def figures(self, end: float) -> dict[str, Any]:
        """The run's figures, the time averages over [first arrival, end]: the same `end` for the
        runs compared (the last busy time of any)."""
        allocated, waiting = time_means(self.clock.steps, self.clock.start, end)
        samples = max(self.clock.samples, 1)
        return {
            "policy": self.label,
            "seed": self.seed,
            "hours": round((end - self.clock.start) / 3600, 2),
            "mean_gpus_allocated": round(allocated, 1),
            "mean_gpus_waiting": round(waiting, 1),
            "gpu_hours_waited": round(self.gpu_hours_waited, 1),
            "gpu_hours_waited_by_kind": self.waited_by_kind,
            "wait_p50_s": round(self.wait_p50_s, 1),
            "wait_p99_s": round(self.wait_p99_s, 1),
            "pods_waited": self.waited,
            "never_placed": self.never_placed,
            "gpus_partly_used_while_busy": round(self.clock.partly / samples, 1),
            "holes_while_busy": round(self.clock.holes / samples, 1),
            "evictions_per_1000_arrivals": round(1000 * self.evictions / max(self.arrivals, 1), 1),
            "placements_per_s": round(self.attempts / self.seconds, 1) if self.seconds else None,
        }


def pod_kind(pod: TracePod) -> str:
    if pod.num_gpu > 1:
        return "multi-GPU"
    return "one GPU" if pod.gpu_milli >= MILLI else "share"


Event = tuple[float, int, int, int]  # (time, 0 departure | 1 arrival, order, pod index)


@dataclass
class Replay:
    """One policy's run over the timed pods: the event loop, the queue and the figures."""

    pods: Sequence[TimedPod]
    placer: Placer
    ledger: Ledger
    make_room_per_1000: float = 0.0
    samples: int = SAMPLES
    waiting: dict[str, int] = field(default_factory=dict)  # pod name -> index, in arrival order
    waiting_milli: int = 0  # their GPU thousandths
    spots: dict[str, Spot] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    gpu_seconds_waited: float = 0.0
    waited_by_kind: dict[str, float] = field(default_factory=dict)  # GPU-seconds by pod_kind
    evictions: int = 0
    searches: int = 0  # for room to make
    attempts: int = 0
    arrived: int = 0

    def run(self, label: str, seed: int) -> TimedRun:
        started = time.perf_counter()
        start, last_arrival = self.pods[0].arrival, self.pods[-1].arrival
        clock = Clock(start, (last_arrival - start) / self.samples)
        self.events = [(t.arrival, 1, i, i) for i, t in enumerate(self.pods)]
        heapq.heapify(self.events)
        while self.events:
            now = self.events[0][0]
            busy = now <= last_arrival or bool(self.waiting)  # pods arrive, or wait until now
            freed: set[str] = set()
            while self.events and self.events[0][0] == now:
                _, kind, _, index = heapq.heappop(self.events)
                if kind == 0:
                    freed.add(self._depart(self.pods[index].pod))
                    continue
                self.arrived += 1
                if not self._try(index, now):
                    self.waiting[self.pods[index].pod.name] = index
                    self.waiting_milli += self.pods[index].pod.gpu_total
            if freed:
                self._retry(freed, now)
            clock.advance(now, self.ledger.used_milli, self.waiting_milli, self._holes if busy else None)
        for index in self.waiting.values():  # never placed: waited until the last event
            timed = self.pods[index]
            self._waited(timed.pod, clock.last - timed.arrival)
        return TimedRun(
            label=label,
            seed=seed,
            arrivals=self.arrived,
            clock=clock,
            gpu_hours_waited=self.gpu_seconds_waited / 3600,
            waited_by_kind={kind: round(seconds / 3600, 1) for kind, seconds in sorted(self.waited_by_kind.items())},
            wait_p50_s=statistics.median(self.waits) if self.waits else 0.0,
            wait_p99_s=percentile(self.waits, 0.99) if self.waits else 0.0,
            waited=sum(1 for w in self.waits if w > 0) + len(self.waiting),
            never_placed=len(self.waiting),
            evictions=self.evictions,
            attempts=self.attempts,
            seconds=time.perf_counter() - started,
        )

    def _holes(self) -> tuple[int, int]:
        return self.ledger.holes(self.pods[i].pod for i in self.waiting.values())

    def _depart(self, pod: TracePod) -> str:
        spot = self.spots.pop(pod.name)
        self.placer.remove(pod)
        self.ledger.give_back(pod, spot)
        return spot.node

    def _try(self, index: int, now: float) -> bool:
        """Place the pod (making room where allowed), its departure scheduled; False: it waits."""
        timed = self.pods[index]
        self.attempts += 1
        spot = self.placer.place(timed.pod)
        if spot is None and timed.pod.num_gpu and now == timed.arrival and self._may_evict():
            spot = self._make_room(timed.pod)  # at its arrival only: a plan is dear to look for
        if spot is None:
            return False
        self.ledger.take(timed.pod, spot)
        self.spots[timed.pod.name] = spot
        waited = now - timed.arrival
        self.waits.append(waited)
        self._waited(timed.pod, waited)
        heapq.heappush(self.events, (now + timed.runtime, 0, len(self.waits), index))
        return True

    def _waited(self, pod: TracePod, seconds: float) -> None:
        gpu_seconds = pod.gpu_total / MILLI * seconds
        self.gpu_seconds_waited += gpu_seconds
        if gpu_seconds:
            kind = pod_kind(pod)
            self.waited_by_kind[kind] = self.waited_by_kind.get(kind, 0.0) + gpu_seconds

    def _may_evict(self) -> bool:
        """Evictions left in the budget, and plan searches: a search is dear at 1,000 nodes, and
        most find nothing, so at most SEARCHES_PER_EVICTION for each eviction the budget allows."""
        allowed = self.make_room_per_1000 * self.arrived / 1000
        return allowed - self.evictions >= 1 and self.searches < SEARCHES_PER_EVICTION * allowed

    def _make_room(self, pod: TracePod) -> Spot | None:
        self.searches += 1
        maker = getattr(self.placer, "make_room", None)
        found = maker(pod) if maker else None
        if found is None:
            return None
        spot, moved = found
        for move in moved:
            self.ledger.give_back(move.pod, move.was)
            self.ledger.take(move.pod, move.now)
            self.spots[move.pod.name] = move.now
        self.evictions += len(moved)
        return spot

    def _retry(self, freed: set[str], now: float) -> None:
        """The waiting pods, in arrival order, that fit a node pods just left (every other node
        only filled since they were last tried: a pod that fits none of these fits nowhere); one
        failure per shape: the same pod shape fails again at the same instant."""
        failed: set[tuple[int, int, int, int, tuple[str, ...]]] = set()
        for name, index in list(self.waiting.items()):
            pod = self.pods[index].pod
            shape = (pod.cpu_milli, pod.memory_mib, pod.num_gpu, pod.gpu_milli, pod.gpu_spec)
            if shape in failed:
                continue
            nodes = [node for node in freed if self.ledger.may_fit(pod, node)]
            if not nodes or not self.placer.fits_on(pod, nodes):
                failed.add(shape)
                continue
            if self._try(index, now):
                del self.waiting[name]
                self.waiting_milli -= pod.gpu_total
            else:
                failed.add(shape)


# --- the runs and the report ---------------------------------------------------------------------


def replay_seed(
    nodes: Sequence[TraceNode],
    pods: Sequence[TracePod],
    timed: Sequence[TimedPod],
    seed: int,
    cpu_pods: CpuPods,
    make_room_per_1000: float,
    lifetimes: bool = False,
    progress: Callable[[str], None] = lambda line: None,
) -> list[dict[str, Any]]:
    """Every policy's figures on the same timed pods (fgpu's fragmentation and binpack, the FGD and
    BestFit replicas, fgpu with claims that say their run time and fgpu making room when asked), their
    time averages over the same hours."""
    named = dict(zip(node_names(nodes, seed), nodes, strict=True))
    runs = []
    placers: list[tuple[str, Callable[[], Placer], float]] = [
        ("fgpu fragmentation", lambda: FgpuPlacer(nodes, seed, "fragmentation", cpu_pods), 0.0),
        ("fgpu binpack", lambda: FgpuPlacer(nodes, seed, "binpack", cpu_pods), 0.0),
        ("FGD (replica)", lambda: ReplicaPlacer(nodes, pods, seed, "fgd"), 0.0),
        ("BestFit (replica)", lambda: ReplicaPlacer(nodes, pods, seed, "bestfit"), 0.0),
    ]
    if cpu_pods != "policy":  # FGD where fgpu is deployed: kube-scheduler places the CPU-only pods
        placers.append(
            (f"FGD (replica), CPU-only pods {cpu_pods}", lambda: ReplicaPlacer(nodes, pods, seed, "fgd", cpu_pods), 0.0)
        )
    if lifetimes:
        by_name = {t.pod.name: t for t in timed}
        placers.append(
            (
                "fgpu fragmentation, claims saying their run time",
                lambda: FgpuPlacer(nodes, seed, "fragmentation", cpu_pods, by_name),
                0.0,
            )
        )
    if make_room_per_1000:
        placers.append(
            (
                f"fgpu fragmentation, making room <= {make_room_per_1000:g}/1,000",
                lambda: FgpuPlacer(nodes, seed, "fragmentation", cpu_pods),
                make_room_per_1000,
            )
        )
    for label, build, evictions in placers:
        runs.append(Replay(timed, build(), Ledger(named), evictions).run(label, seed))
        progress(f"seed {seed}, {label}: {runs[-1].gpu_hours_waited:.1f} GPU-hours waited, {runs[-1].seconds:.0f} s")
    end = max(one.clock.busy_until for one in runs)
    return [one.figures(end) for one in runs]


def run(
    args: argparse.Namespace, progress: Callable[[str], None] = lambda line: print(line, flush=True)
) -> dict[str, Any]:
    """Every seed's runs and their figures; the mean per policy over the seeds."""
    nodes = protocol_nodes(args)
    path = args.traces / f"openb_pod_list_{args.trace}.csv"
    pods = read_pods(path)
    times, capacity = read_times(path), MILLI * sum(n.gpus for n in nodes)
    runs: list[dict[str, Any]] = []
    for seed in seeds(args.seeds):
        tuned = workload(pods, capacity, seed, args.tune) if args.tune else pods
        timed = timed_pods(tuned, times, args.speedup)
        for figures in replay_seed(nodes, pods, timed, seed, args.cpu_pods, args.make_room, args.lifetimes, progress):
            runs.append(figures)
            progress(json.dumps(figures))
    by_policy: dict[str, list[dict[str, Any]]] = {}
    for figures in runs:
        by_policy.setdefault(figures["policy"], []).append(figures)
    return {
        "trace": args.trace,
        "speedup": args.speedup,
        "tune": args.tune,
        "cpu_pods": args.cpu_pods,
        "gpu_pods_only": sorted(args.gpu_pods_only),
        "nodes": len(nodes),
        "pods": len(pods),
        "seeds": seeds(args.seeds),
        "mean": {label: _mean(figures) for label, figures in by_policy.items()},
        "runs": runs,
    }


def _mean(figures: Sequence[dict[str, Any]]) -> dict[str, float]:
    return {
        key: round(statistics.mean(f[key] for f in figures), 1)
        for key, value in figures[0].items()
        if isinstance(value, int | float) and key != "seed" and all(f[key] is not None for f in figures)
    }


COLUMNS = (
    ("hours", "hours"),
    ("mean_gpus_allocated", "GPUs allocated"),
    ("mean_gpus_waiting", "GPUs waiting"),
    ("gpu_hours_waited", "GPU-hours waited"),
    ("wait_p50_s", "wait p50 s"),
    ("wait_p99_s", "wait p99 s"),
    ("gpus_partly_used_while_busy", "GPUs partly used (busy)"),
    ("holes_while_busy", "holes (busy)"),
    ("evictions_per_1000_arrivals", "evictions / 1,000"),
)


def table(result: dict[str, Any]) -> str:
    """Per policy, the mean over the seeds of each figure."""
    lines = ["| policy | " + " | ".join(title for _, title in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for label, mean in result["mean"].items():
        lines.append(f"| {label} | " + " | ".join(str(mean.get(key, "-")) for key, _ in COLUMNS) + " |")
    return "\n".join(lines)
