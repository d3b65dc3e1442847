"""The openb bench's protocol pieces (bench/openb.py) on a tiny trace: tuning the pod list to 130%
of capacity, the arrived-% buckets, the unallocated metric, the claims a pod becomes, a whole
replay through the allocator over slices fgpu builds, and kube-scheduler placing the pods without
claims as deployed."""

from __future__ import annotations

import argparse
import random
from typing import get_args

import pytest

from bench.openb import (
    CpuPods,
    KubeScheduler,
    TraceNode,
    TracePod,
    buckets,
    claim_object,
    cluster,
    nodes_to_score,
    pod_needs,
    protocol_nodes,
    published,
    read_nodes,
    read_pods,
    replay,
    run,
    seeds,
    share_compute,
    table,
    unallocated,
    workload,
)
from driver.allocator.cluster import ClusterAllocator, Placement
from driver.allocator.model import Claim, claim_from_object
from driver.scheduling.nodefit import NodeRoom
from tests.support.openb import pod, write_tiny_traces

TINY = [pod("p0", 1, 500), pod("p1", 1, 1000), pod("p2", 2, 1000), pod("p3", 0), pod("p4", 1, 250)]


def test_tuning_up_keeps_every_pod_shuffled_and_appends_clones_until_the_target():
    pods = workload(TINY, capacity_milli=4000, seed=42)
    originals, clones = pods[: len(TINY)], pods[len(TINY) :]
    assert sorted(p.name for p in originals) == sorted(p.name for p in TINY)
    assert [p.name.rsplit("-", 1)[1] for p in clones] == [str(i) for i in range(len(clones))]
    assert all(p.name.split("-tuned-")[0] in {t.name for t in TINY} for p in clones)
    assert sum(p.gpu_total for p in pods) <= 1.3 * 4000 < sum(p.gpu_total for p in pods) + 2000
    assert workload(TINY, 4000, 42) == pods and [p.name for p in workload(TINY, 4000, 43)] != [p.name for p in pods]
    assert sorted(p.name for p in workload(TINY, 4000, 42, ratio=0)) == [p.name for p in TINY]  # only shuffled


def test_tuning_up_checks_the_per_gpu_thousandths_as_the_simulator_does():
    # 2 x 1000 per pod, target 13,000: the check reads 1,000 each time, so 14,000 gets in.
    assert sum(p.gpu_total for p in workload([pod("big", 2)], capacity_milli=10_000, seed=1)) == 14_000


def test_tuning_down_removes_random_pods_until_within_the_target():
    many = [pod(f"p{i}", 1, 1000) for i in range(10)]
    pods = workload(many, capacity_milli=5000, seed=42)
    assert len(pods) == 6 and {p.name for p in pods} < {p.name for p in many}


def test_buckets_round_arrived_half_to_even_average_and_fall_back_one_either_side():
    capacity = 10_000
    events = [(250, 100), (260, 200), (350, 300), (1000, 1000), (1049, 999)]  # 2.5% -> 2, 2.6% -> 3, 3.5% -> 4
    result = buckets(events, capacity)
    assert result[2] == 1.0 and result[3] == 2.0 and result[4] == 3.0
    assert result[10] == 10.0  # 10.0 and 10.49 -> 10: mean of 10.0 and 9.99 is 9.995, rounded half to even
    assert result[5] == 3.0  # empty: the events of buckets 4..6
    assert 0 not in result and 1 in result  # bucket 1 falls back to bucket 2's event
    assert unallocated(result)[4] == 97.0


def test_the_metric_is_published_as_one_hundred_less_allocation(tmp_path):
    header = "workload,sc_policy,tune,seed,total_gpus," + ",".join(str(b) for b in range(131))
    rows = [
        f"openb_pod_list_default,06-FGD,1.3,{seed},6212," + ",".join(str(min(b, v)) for b in range(131))
        for seed, v in ((42, 95.0), (43, 95.5))
    ]
    path = tmp_path / "results.csv"
    path.write_text("\n".join([header, *rows]) + "\n")
    table = published("default", path)
    assert table == {"FGD": {95: [5.0, 5.0], 100: [5.0, 4.5], 110: [5.0, 4.5], 130: [5.0, 4.5]}}


def test_a_pod_becomes_whole_gpus_a_share_in_whole_percents_or_no_request():
    whole = claim_from_object(claim_object(pod("w", 4, 1000, spec=("T4", "P100"))))
    ((request,),) = whole.requests
    assert (request.class_name, request.count) == ("gpu.fgpu.dev", 4)
    assert request.selectors == (
        'device.attributes["gpu.fgpu.dev"].productName in ["Tesla P100-PCIE-16GB", "Tesla T4"]',
    )
    ((share,),) = claim_from_object(claim_object(pod("s", 1, 470))).requests
    assert (share.class_name, share.capacity) == ("mps.gpu.fgpu.dev", {"compute": 47, "memory": 256 * 2**20})
    assert share_compute(471) == 48 and share_compute(10) == 1
    assert claim_from_object(claim_object(pod("c", 0))).requests == ()
    assert seeds("42-44") == [42, 43, 44] and seeds("42,45") == [42, 45]


@pytest.mark.parametrize("policy", ["binpack", "fragmentation", "first-fit"])
def test_a_replay_places_what_fits_and_drops_the_rest(policy: str):
    # One node of 2 T4 and 8 CPUs. The trace's GPU pods fill both GPUs exactly (600 + 400 share one,
    # whatever the order); the clones the tuning appends find no GPU left, and the CPU-only pod's
    # clones no CPU once two of them run (3 CPUs go to the GPU pods).
    nodes = [TraceNode("n0", 8000, 65536, 2, "T4")]
    pods = [pod("a", 1, 600), pod("b", 1, 400), pod("c", 1, 1000), pod("d", 0, cpu=2000)]
    run = replay(nodes, pods, seed=42, policy=policy)
    tuned = workload(pods, 2000, 42)
    clones = tuned[len(pods) :]
    cpu_only = sum(1 for p in tuned if not p.num_gpu)
    assert run.claims == sum(1 for p in tuned if p.num_gpu)
    assert run.failed == sum(1 for p in clones if p.num_gpu) + max(0, cpu_only - 2)
    assert run.unallocated[100] == 0.0 and run.unallocated[max(run.unallocated)] == 0.0


def test_a_replay_stopped_early_measures_no_bucket_beyond_its_end():
    nodes = [TraceNode("n0", 8000, 65536, 2, "T4")]
    pods = [pod("a", 1, 600), pod("b", 1, 400), pod("c", 1, 1000), pod("d", 0, cpu=2000)]
    run = replay(nodes, pods, seed=42, policy="binpack", stop_at=100)
    assert max(run.unallocated) <= 101 and run.unallocated[100] == 0.0


def test_the_command_reports_ours_beside_the_published_figures(tmp_path):
    write_tiny_traces(tmp_path)
    args = argparse.Namespace(
        trace="default",
        seeds="42,43",
        policy="fragmentation",
        cpu_pods="policy",
        traces=tmp_path,
        every=2,
        stop_at=130,
        gpu_pods_only=frozenset(),
    )
    result = run(args, progress=lambda line: None)
    assert result["seeds"] == [42, 43] and len(result["failed_pods"]) == 2
    assert set(result["unallocated_pct"]) == {95, 100, 110, 130}
    assert result["shares_rounded_to_1pct"] == 0
    assert result["published"] == {"BestFit": {95: "10.00", 100: "10.00", 110: "10.00", 130: "10.00"}}
    assert result["claims_per_s"] > 0 and result["p99_ms"] >= result["p50_ms"]
    assert result["gpu_pods_only"] == []
    lines = table(result).splitlines()
    assert (
        lines[2].startswith("| **fgpu fragmentation (CPU-only pods: policy)** | ") and "BestFit (published)" in lines[3]
    )


def _loaded(nodes: list[TraceNode], load: dict[str, TracePod]) -> tuple[NodeRoom, list[str]]:
    """The room of a cluster of `nodes` and their names in node order, each node's pod of `load` on it."""
    pods_of: dict[str, list] = {}
    allocator, room, names = cluster(nodes, 1, "binpack", pods_of)
    for node, name in zip(nodes, names, strict=True):
        if (p := load.get(node.name)) is not None:
            c = claim_from_object(claim_object(p))
            pods_of[c.key] = [pod_needs(p)]
            outcome = allocator.allocate(c, nodes=[name], room=room)
            allocator.commit(outcome)
            room.take(outcome)
    return room, names


def _asking(room: NodeRoom, p: TracePod) -> Claim:
    claim = claim_from_object(claim_object(p))
    room.pods_of[claim.key] = [pod_needs(p)]
    return claim


def test_kube_scheduler_stand_in_scores_cpu_only_pods_as_node_resources_fit_does():
    # n0: 2 T4, both taken, 6 of 8 CPUs free; n1: 2 T4 free, 4 of 8 CPUs free; a 1-CPU pod.
    # BalancedAllocation gives both 72, so NodeResourcesFit's strategy decides.
    nodes = [TraceNode("n0", 8000, 65536, 2, "T4"), TraceNode("n1", 8000, 65536, 2, "T4")]
    room, names = _loaded(nodes, {"n0": pod("g", 2, 1000, cpu=2000), "n1": pod("h", 0, cpu=4000)})
    small = _asking(room, pod("s", 0, cpu=1000))
    chosen = {mode: KubeScheduler(room, mode, names, random.Random(1)).node(small) for mode in get_args(CpuPods)[1:]}
    assert chosen == {"least-allocated": names[0], "most-allocated": names[1]}


def test_kube_scheduler_stand_in_adds_balanced_allocation_to_the_fit_score():
    # Both nodes score 56 on LeastAllocated with the pod (1 CPU, 16 GiB); on n0 (half its CPU
    # taken, no memory) the pod evens CPU and memory out, on n1 (a quarter of each) it unbalances
    # them: BalancedAllocation 78 against 71 puts it on n0, every time (no tie to break).
    nodes = [TraceNode("n0", 8000, 65536, 1, "T4"), TraceNode("n1", 8000, 65536, 1, "T4")]
    load = {"n0": TracePod("a", 4000, 0, 0, 0, ()), "n1": TracePod("b", 2000, 16384, 0, 0, ())}
    room, names = _loaded(nodes, load)
    claim = _asking(room, TracePod("p", 1000, 16384, 0, 0, ()))
    chosen = {KubeScheduler(room, "least-allocated", names, random.Random(s)).node(claim) for s in range(8)}
    assert chosen == {names[0]}


def test_kube_scheduler_stand_in_breaks_ties_at_random():
    nodes = [TraceNode("n0", 8000, 65536, 1, "T4"), TraceNode("n1", 8000, 65536, 1, "T4")]
    room, names = _loaded(nodes, {})
    claim = _asking(room, pod("p", 0))
    chosen = {KubeScheduler(room, "least-allocated", names, random.Random(s)).node(claim) for s in range(16)}
    assert chosen == set(names)


@pytest.mark.parametrize(("nodes", "scored"), [(50, 50), (150, 100), (1213, 497), (5000, 500), (100_000, 5000)])
def test_nodes_to_score_is_kube_schedulers_adaptive_percentage(nodes, scored):
    assert nodes_to_score(nodes) == scored


def test_kube_scheduler_stand_in_scores_only_the_nodes_from_where_its_last_search_stopped():
    # 200 nodes, all alike: it looks for 100 feasible ones from where it stopped, so the first pod
    # lands among nodes 50-149 (0-49 are full) and the next among 150-199 and 50-99.
    nodes = [TraceNode(f"n{i:03d}", 8000, 65536, 1, "T4") for i in range(200)]
    room, names = _loaded(nodes, {f"n{i:03d}": TracePod(f"full{i}", 8000, 0, 0, 0, ()) for i in range(50)})
    scheduler = KubeScheduler(room, "least-allocated", names, random.Random(1))
    small = _asking(room, pod("small", 0))
    assert scheduler.node(small) in names[50:150] and scheduler.start == 150
    assert scheduler.node(small) in names[150:] + names[50:100] and scheduler.start == 100


@pytest.mark.parametrize("mode", get_args(CpuPods)[1:])
def test_as_deployed_the_allocator_only_hears_of_the_pods_kube_scheduler_places(tmp_path, monkeypatch, mode):
    # The controller never commits a placement for a pod without claims: the allocator commits the
    # GPU pods' placements only, and is told of each pod kube-scheduler placed as the controller
    # tells it, by the pod's node (AllocatorCache.follow).
    folder = write_tiny_traces(tmp_path)
    nodes, pods = read_nodes(folder / "openb_node_list_gpu_node.csv"), read_pods(folder / "openb_pod_list_default.csv")
    committed: list[Placement] = []
    told: list[list[str]] = []
    commit, pods_changed = ClusterAllocator.commit, ClusterAllocator.pods_changed

    def counted_commit(self: ClusterAllocator, placement: Placement) -> None:
        committed.append(placement)
        commit(self, placement)

    def counted_pods_changed(self: ClusterAllocator, changed: list[str]) -> None:
        told.append(list(changed))
        pods_changed(self, changed)

    monkeypatch.setattr(ClusterAllocator, "commit", counted_commit)
    monkeypatch.setattr(ClusterAllocator, "pods_changed", counted_pods_changed)
    result = replay(nodes, pods, seed=42, policy="fragmentation", cpu_pods=mode)
    tuned = workload(pods, 1000 * sum(n.gpus for n in nodes), 42)
    gpu_pods = sum(1 for p in tuned if p.num_gpu)
    assert all(p.allocation["devices"]["results"] for p in committed) and len(committed) <= gpu_pods
    assert told and all(len(names) == 1 for names in told) and len(told) <= len(tuned) - gpu_pods
    assert len(committed) + len(told) + result.failed == len(tuned)


def test_nodes_kept_for_gpu_pods_take_no_pod_without_gpus_from_kube_scheduler(tmp_path, monkeypatch):
    # --gpu-pods-only T4: the T4 nodes are tainted against pods without GPUs, which kube-scheduler's
    # stand-in then places on the G2 node only; pods with GPUs tolerate the taint.
    args = argparse.Namespace(traces=write_tiny_traces(tmp_path), every=1, gpu_pods_only=frozenset({"T4"}))
    nodes = protocol_nodes(args)
    assert [(n.model, n.gpu_pods_only) for n in nodes] == [("T4", True), ("G2", False), ("T4", True)]
    told: list[str] = []
    committed: list[str] = []
    commit, pods_changed = ClusterAllocator.commit, ClusterAllocator.pods_changed

    def counted_commit(self: ClusterAllocator, placement: Placement) -> None:
        committed.append(placement.node)
        commit(self, placement)

    def counted_pods_changed(self: ClusterAllocator, changed: list[str]) -> None:
        told.extend(changed)
        pods_changed(self, changed)

    monkeypatch.setattr(ClusterAllocator, "commit", counted_commit)
    monkeypatch.setattr(ClusterAllocator, "pods_changed", counted_pods_changed)
    pods = [pod(f"cpu{i}", 0) for i in range(4)] + [pod(f"t4-share{i}", 1, 400, spec=("T4",)) for i in range(4)]
    replay(nodes, pods, seed=42, policy="fragmentation", cpu_pods="least-allocated")
    assert told and all(node.endswith("-n1") for node in told)
    assert any(node.endswith(("-n0", "-n2")) for node in committed)
