"""The day of bench/autoscaling.py without a cluster: its trace (day-shaped, seeded, the mix), the
lower bound on nodes and the first-fit-decreasing packing it is compared with, and the table."""

from __future__ import annotations

import math
import random

from bench.autoscaling import (
    ARRIVAL_LABEL,
    GPUS_PER_NODE,
    ROWS,
    SHARE_SIZES_GI,
    Arrival,
    Observed,
    Shape,
    busy_over_bound,
    day_trace,
    lower_bound,
    markdown,
    packed,
    pod_body,
    replica_set_body,
    summarize,
    templates,
)
from driver.allocator.lifetimes import EXPECTED_DURATION
from driver.scheduling.opt_in import MOVABLE_ANNOTATION, OPT_IN_LABEL, OPT_IN_VALUE


def test_the_day_is_seeded_sorted_and_busier_at_its_peaks_than_at_night():
    trace = day_trace(2000, 1000.0, seed=7)
    assert trace == day_trace(2000, 1000.0, seed=7) != day_trace(2000, 1000.0, seed=8)
    assert [a.at_s for a in trace] == sorted(a.at_s for a in trace)
    assert len({a.name for a in trace}) == 2000 and all(0 <= a.at_s <= 1000 for a in trace)
    night = sum(1 for a in trace if a.at_s < 100)
    morning = sum(1 for a in trace if 250 <= a.at_s < 350)
    afternoon = sum(1 for a in trace if 600 <= a.at_s < 700)
    assert morning > afternoon > 3 * night
    assert {a.shape.memory_gi for a in trace if not a.shape.gpus} == set(SHARE_SIZES_GI)
    assert {a.shape.gpus for a in trace if a.shape.gpus} == {1, 2, 4, 8}
    assert all(40 <= a.run_s <= 200 for a in trace)


def test_the_bound_counts_gpus_and_shares_memory_and_compute():
    assert lower_bound([]) == 0 == packed([])
    assert lower_bound([Shape(gpus=8)] * 2) == 2 == packed([Shape(gpus=8)] * 2)
    assert lower_bound([Shape(gpus=8), Shape(gpus=1)]) == 2
    # 16 shares of 39Gi: two to a GPU, one node; a 10Gi share beside 8 whole GPUs needs a second.
    assert lower_bound([Shape(memory_gi=39)] * 16) == 1 == packed([Shape(memory_gi=39)] * 16)
    assert lower_bound([Shape(gpus=8), Shape(memory_gi=10)]) == 2 == packed([Shape(gpus=8), Shape(memory_gi=10)])
    # 81 shares of 1Gi: memory would take one GPU, compute (10 each, 10 to a GPU) takes 9 GPUs.
    assert lower_bound([Shape(memory_gi=1)] * 81) == 2
    # Four whole GPUs fit beside four, not beside five: the bound says 2 either way, packing 2 or 3.
    assert packed([Shape(gpus=5), Shape(gpus=5), Shape(gpus=4)]) == 3
    assert lower_bound([Shape(gpus=5), Shape(gpus=5), Shape(gpus=4)]) == 2


def test_the_bound_never_exceeds_a_packing_that_holds_the_pods():
    rng = random.Random(3)
    for _ in range(200):
        shapes = [
            Shape(gpus=rng.choice([1, 2, 4, 8])) if rng.random() < 0.4 else Shape(memory_gi=rng.choice(SHARE_SIZES_GI))
            for _ in range(rng.randrange(1, 60))
        ]
        bound, nodes = lower_bound(shapes), packed(shapes)
        assert 1 <= bound <= nodes
        assert nodes * GPUS_PER_NODE >= sum(s.gpus for s in shapes)


def test_the_table_has_a_row_per_figure_and_a_column_per_path():
    day = {
        "path": "kube-scheduler", "pods": 2, "pods_run": 2, "wait_p50_s": 1.0, "wait_p99_s": 2.0,
        "pods_on_new_nodes": 1, "wait_new_node_p50_s": 2.0, "wait_new_node_p99_s": 2.0,
        "wait_new_node_max_s": 2.0, "wait_existing_node_p50_s": 1.0, "wait_existing_node_p99_s": 1.0,
        "provisioning_p50_s": 0.5, "provisioning_p99_s": 0.5, "node_start_p50_s": 0.2, "node_start_p99_s": 0.2,
        "pods_beyond_round_and_start": 0, "claims_allocated_by": {"kube-scheduler": 2},
        "nodes_added": 1, "nodes_removed": 1, "nodes_removed_after_day": 1,
        "nodes_left": 0, "node_seconds": {"existing": 12, "used": 10, "packed": 10, "bound": 10, "kept": 10},
        "existing_over_bound_pct": 20.0, "used_over_bound_pct": 0.0, "used_over_packed_pct": 0.0,
        "busy_over_bound_pct": {"existing": 20.0, "used": 0.0},
        "peak": {"existing": 1, "used": 1, "packed": 1, "bound": 1}, "drain_s": 30.0,
    }  # fmt: skip
    lines = markdown({"scheduler": day, "controller": {**day, "path": "fgpu-controller"}}).splitlines()
    assert lines[0] == "| | kube-scheduler | fgpu-controller |"
    assert len(lines) == 2 + len(ROWS)
    assert "| existing over the lower bound | 20.0% | 20.0% |" in lines
    assert "| claims allocated by | kube-scheduler 2 | kube-scheduler 2 |" in lines


def test_claims_say_their_pods_run_time_only_when_asked():
    trace = day_trace(30, 100.0, seed=1)
    by_shape, of_pod = templates("day", trace, opt_in=True, lifetimes=False)
    assert set(by_shape) == {a.shape.key for a in trace} and of_pod == {a.name: a.shape.key for a in trace}
    assert all("annotations" not in t["spec"]["metadata"] for t in by_shape.values())
    assert all(t["spec"]["metadata"]["labels"] == {OPT_IN_LABEL: OPT_IN_VALUE} for t in by_shape.values())
    per_pod, of_pod = templates("day", trace, opt_in=True, lifetimes=True)
    assert of_pod == {a.name: a.name for a in trace}
    for arrival in trace:
        said = per_pod[arrival.name]["spec"]["metadata"]["annotations"][EXPECTED_DURATION]
        assert said == f"{math.ceil(arrival.run_s)}s"
    plain, _ = templates("day", trace, opt_in=False, lifetimes=False)
    assert all(t["spec"]["metadata"] == {} for t in plain.values())


def test_busy_counts_only_the_samples_near_the_peak():
    # t, existing, used, bound, packed: the tail (bound 1, 4 nodes used) is left out.
    rows = [[0, 1, 1, 1, 1], [1, 11, 10, 10, 10], [2, 12, 11, 8, 8], [3, 5, 4, 1, 1]]
    assert busy_over_bound(rows) == {"existing": 27.8, "used": 16.7}
    assert busy_over_bound([]) == {"existing": None, "used": None}


def _arrival_pod(name: str, node: str, phase: str = "Running", **meta: str) -> dict:
    metadata = {"name": name, "labels": {ARRIVAL_LABEL: "p0001"}, **meta}
    return {"metadata": metadata, "spec": {"nodeName": node}, "status": {"phase": phase}}


def test_an_arrival_runs_from_its_first_pod_and_follows_its_pods_as_they_move():
    observed = Observed()
    observed.on_pod("MODIFIED", _arrival_pod("p0001-a", "n1"))
    first = observed.pod_running["p0001"]
    observed.on_pod("MODIFIED", _arrival_pod("p0001-a", "n1", deletionTimestamp="2026-12-05T00:00:00Z"))  # evicted
    assert "p0001" not in observed.where
    observed.on_pod("ADDED", _arrival_pod("p0001-b", "n2", phase="Pending"))
    assert "p0001" not in observed.where
    observed.on_pod("MODIFIED", _arrival_pod("p0001-b", "n2"))
    observed.on_pod("DELETED", _arrival_pod("p0001-a", "n1"))  # the old pod's end, seen late, moves nothing
    assert observed.where["p0001"] == ("p0001-b", "n2")
    assert (observed.pod_running["p0001"], observed.pod_node["p0001"]) == (first, "n1")  # its wait, its first node
    assert observed.pods_run["p0001"] == {"p0001-a", "p0001-b"}  # one move


def test_a_movable_replica_is_a_replica_set_of_one_pod_the_controller_may_move():
    arrival = day_trace(1, 10, seed=1)[0]
    body = replica_set_body(arrival, "mps10", gated=True)
    template = body["spec"]["template"]
    assert body["metadata"]["name"] == arrival.name and body["spec"]["replicas"] == 1
    assert template["metadata"]["labels"] == body["spec"]["selector"]["matchLabels"] == {ARRIVAL_LABEL: arrival.name}
    assert template["metadata"]["annotations"][MOVABLE_ANNOTATION] == "true"
    assert "name" not in template["metadata"] and template["spec"]["schedulingGates"]
    assert MOVABLE_ANNOTATION not in pod_body(arrival, "mps10", gated=True)["metadata"]["annotations"]


def test_a_pod_beyond_a_round_and_its_node_start_is_named_with_where_its_wait_went():
    fast, slow = Arrival("p0001", 0.0, 10.0, Shape(gpus=1)), Arrival("p0002", 0.0, 10.0, Shape(memory_gi=10))
    observed = Observed(
        pod_created={"p0001": 100.0, "p0002": 100.0},
        pod_running={"p0001": 103.0, "p0002": 109.0},
        pod_node={"p0001": "n1", "p0002": "n2"},
        node_added={"n1": 101.0, "n2": 102.5},
        node_usable={"n1": 102.0, "n2": 103.5},
        node_published={"n1": 102.0, "n2": 103.5},
    )
    day = summarize("fgpu-controller", [fast, slow], observed, [], start=100.0, day_end=120.0)
    assert day["pods_beyond_round_and_start"] == 1  # 9 s against 5 s and a 1 s start
    assert day["beyond_round_and_start"] == [
        {"arrival": "p0002", "shape": "mps10", "wait_s": 9.0, "to_node_created_s": 2.5, "node_start_s": 1.0}
    ]
