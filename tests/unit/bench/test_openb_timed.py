"""The openb trace replayed in time (bench/openb_timed.py): pods in arrival order with their run
times, a pod that fits nowhere waiting until a departure frees a node it fits, the figures (wait,
GPU-hours waited, holes), making room, and the command as users run it, on tiny traces."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.openb import TraceNode, TracePod, node_names
from bench.openb_timed import (
    FgpuPlacer,
    Ledger,
    Placer,
    Replay,
    ReplicaPlacer,
    Spot,
    TimedPod,
    read_times,
    time_means,
    timed_pods,
)
from tests.support.openb import pod, write_tiny_traces

ONE_T4 = [TraceNode("n0", 8000, 65536, 1, "T4")]
TWO_T4 = [TraceNode("n0", 8000, 65536, 2, "T4")]


def placer(kind: str, nodes: list[TraceNode], pods: list[TracePod]) -> Placer:
    if kind == "fgpu":
        return FgpuPlacer(nodes, 42, "fragmentation", "policy")
    return ReplicaPlacer(nodes, pods, 42, kind)


def replay(kind: str, nodes: list[TraceNode], timed: list[TimedPod], make_room: float = 0.0) -> Replay:
    built = placer(kind, nodes, [t.pod for t in timed])
    return Replay(timed, built, Ledger(dict(zip(node_names(nodes, 42), nodes, strict=True))), make_room)


def test_pods_arrive_in_recorded_order_sped_up_and_run_from_their_scheduled_time(tmp_path):
    traces = write_tiny_traces(tmp_path)
    times = read_times(traces / "openb_pod_list_default.csv")
    assert times["b"] == (100, 400, None)
    pods = [pod("d", 0), pod("c"), pod("b", 1, 400), pod("a", 1, 600)]
    timed = timed_pods(pods, times, speedup=10)
    assert [t.pod.name for t in timed] == ["a", "b", "c", "d"]
    assert [t.arrival for t in timed] == [0.0, 10.0, 20.0, 30.0]
    # run time: deletion less scheduled time, less creation where never scheduled, at least 1 s
    assert [t.runtime for t in timed] == [995.0, 300.0, 700.0, 49.0]
    clone = timed_pods([pod("c-tuned-0")], times, speedup=10)  # a clone the tuning added runs as its original
    assert (clone[0].arrival, clone[0].runtime) == (20.0, 700.0)


@pytest.mark.parametrize("kind", ["fgpu", "fgd", "bestfit"])
def test_a_pod_that_fits_nowhere_waits_until_a_departure_frees_its_node(kind):
    timed = [TimedPod(pod("first"), 0.0, 100.0), TimedPod(pod("second"), 10.0, 50.0)]
    result = replay(kind, ONE_T4, timed).run(kind, 42)
    assert result.never_placed == 0 and result.waited == 1
    assert result.wait_p50_s == 45.0 and result.wait_p99_s == pytest.approx(90.0, abs=1)  # waits 0 and 90
    assert result.gpu_hours_waited == pytest.approx(90 / 3600)
    # busy from 0 until the second is placed at 100: one GPU allocated all along, one waiting 10..100
    assert result.clock.busy_until == 100.0
    assert time_means(result.clock.steps, 0.0, 100.0) == pytest.approx((1.0, 0.9))
    assert time_means(result.clock.steps, 0.0, 200.0) == pytest.approx((0.75, 0.45))  # idle after 150


@pytest.mark.parametrize("kind", ["fgpu", "fgd"])
def test_a_pod_bigger_than_any_node_is_never_placed_and_waits_until_the_end(kind):
    timed = [TimedPod(pod("two", 2), 0.0, 10.0), TimedPod(pod("one"), 5.0, 20.0)]
    result = replay(kind, ONE_T4, timed).run(kind, 42)
    assert result.never_placed == 1 and result.waited == 1
    assert result.gpu_hours_waited == pytest.approx(2 * 25 / 3600)  # until the last event, at 25


def test_a_departure_wakes_only_the_pods_that_might_fit_the_node_it_freed():
    timed = [
        TimedPod(pod("whole"), 0.0, 100.0),
        TimedPod(pod("cpu", 0, cpu=1000), 1.0, 5.0),
        TimedPod(pod("waits"), 2.0, 10.0),
    ]
    run = replay("fgpu", ONE_T4, timed)
    result = run.run("fgpu", 42)
    # three arrivals, then one try at 100 when the whole GPU leaves; the CPU pod's departure at 6
    # frees no GPU and wakes nobody
    assert result.attempts == 4 and result.never_placed == 0
    assert result.wait_p99_s == pytest.approx(98.0, abs=1)


def test_holes_are_partly_used_gpus_no_waiting_pod_can_use():
    ledger = Ledger({"n0": TWO_T4[0], "n1": TraceNode("n1", 8000, 65536, 1, "G2")})
    ledger.take(pod("a", 1, 700), Spot("n0", (0,)))
    ledger.take(pod("b", 1, 500), Spot("n1", (0,)))
    assert ledger.holes([]) == (2, 0)  # nothing waits: nothing is denied
    assert ledger.holes([pod("w", 1, 400)]) == (2, 1)  # 300 left on n0 is too little; n1's 500 fits
    assert ledger.holes([pod("w", 1, 400, spec=("T4",))]) == (2, 2)  # n1 is not a T4
    assert ledger.holes([pod("w", 1, 200, spec=("T4",))]) == (2, 1)
    assert ledger.holes([pod("whole")]) == (2, 2)
    assert ledger.may_fit(pod("w", 1, 300), "n0") and not ledger.may_fit(pod("w", 1, 400, spec=("G2",)), "n0")


def test_making_room_moves_a_share_so_a_whole_gpu_pod_does_not_wait():
    timed = [
        TimedPod(pod("a", 1, 500), 0.0, 1000.0),
        TimedPod(pod("b", 1, 600), 1.0, 3.0),
        TimedPod(pod("c", 1, 400), 2.0, 1000.0),
        TimedPod(pod("whole"), 10.0, 10.0),
    ]
    waited = replay("fgpu", TWO_T4, timed).run("fgpu", 42)
    moved = replay("fgpu", TWO_T4, timed, make_room=1000).run("fgpu", 42)
    assert waited.never_placed == 0 and waited.evictions == 0 and waited.gpu_hours_waited > 0
    assert moved.evictions == 1 and moved.gpu_hours_waited == 0 and moved.wait_p99_s == 0


@pytest.mark.parametrize("profile, waits", [("least-allocated", True), ("most-allocated", False)])
def test_fgds_replica_with_kube_scheduler_placing_the_cpu_only_pods(profile, waits):
    # FGD puts the first pod (6 of 8 CPUs) on one node; kube-scheduler puts the CPU-only pod
    # (2 CPUs) on the other with LeastAllocated and beside it with MostAllocated (its room counts
    # the replica's pods too); the last pod needs 7 CPUs and a node's GPU: it waits only where the
    # CPU-only pod took the other node.
    nodes = [TraceNode("n0", 8000, 65536, 1, "T4"), TraceNode("n1", 8000, 65536, 1, "T4")]
    timed = [
        TimedPod(pod("gpu", cpu=6000), 0.0, 1000.0),
        TimedPod(pod("cpu", 0, cpu=2000), 1.0, 100.0),
        TimedPod(pod("big", cpu=7000), 2.0, 10.0),
    ]
    placer = ReplicaPlacer(nodes, [t.pod for t in timed], 42, "fgd", profile)
    result = Replay(timed, placer, Ledger(dict(zip(node_names(nodes, 42), nodes, strict=True)))).run(profile, 42)
    assert result.never_placed == 0
    assert (result.gpu_hours_waited > 0) is waits


def test_the_command_as_users_run_it_reports_every_policy(tmp_path):
    traces = write_tiny_traces(tmp_path)
    command = [
        *(sys.executable, "-m", "bench.openb", "--timed", "--traces", str(traces), "--seeds", "42,43"),
        *("--speedup", "10", "--tune", "1.3", "--lifetimes", "--make-room", "50", "--cpu-pods", "least-allocated"),
        *("--gpu-pods-only", "T4"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    rows = [line.split(" | ")[0] for line in done.stdout.splitlines() if line.startswith("| ")]
    assert rows[1:] == [
        "| fgpu fragmentation",
        "| fgpu binpack",
        "| FGD (replica)",
        "| BestFit (replica)",
        "| FGD (replica), CPU-only pods least-allocated",
        "| fgpu fragmentation, claims saying their run time",
        "| fgpu fragmentation, making room <= 50/1,000",
    ]
    assert '"speedup": 10.0' in done.stdout and '"tune": 1.3' in done.stdout and '"pods": 4' in done.stdout
    assert '"gpu_pods_only": [\n    "T4"\n  ]' in done.stdout


def test_gpu_hours_waited_are_told_by_the_kind_of_pod_that_waited():
    timed = [
        TimedPod(pod("whole"), 0.0, 7200.0),
        TimedPod(pod("share", 1, 500), 0.0, 3600.0),
        TimedPod(pod("pair", 2), 0.0, 10.0),
    ]
    result = replay("fgd", ONE_T4, timed).run("fgd", 42)
    # the share waits 2 h for the GPU; the pair fits no node: it waits to the last event, at 3 h
    assert result.waited_by_kind == {"multi-GPU": 6.0, "share": 1.0} and result.gpu_hours_waited == 7.0
