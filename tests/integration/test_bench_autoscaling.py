"""`python -m bench.autoscaling` in its small form (its own control plane, kwok, the fleet
publisher, Karpenter, kube-scheduler then the controller): a short day of pods on both paths,
each pod Running, each path's claims allocated by it alone (never an opt-in one by kube-scheduler),
nodes added for them and removed once the day ends, never fewer nodes used than the lower bound says
the Running pods need (the figures of the medium form belong in BENCHMARKS.md). With --empty-nodes:
the controller's shares are movable replicas, and every pod made again after a move is Running and
allocated by the controller too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT

PODS = 40


def test_a_short_day_runs_every_pod_on_nodes_karpenter_adds_and_removes(tmp_path: Path):
    out, table = tmp_path / "day.json", tmp_path / "day.md"
    command = [sys.executable, "-m", "bench.autoscaling", "--pods", str(PODS), "--day-s", "30", "--empty-nodes",
               "--json", str(out), "--markdown", str(table)]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert sum(result["shapes"].values()) == PODS
    for key, path in (("scheduler", "kube-scheduler"), ("controller", "fgpu-controller")):
        day = result[key]
        assert day["path"] == path
        assert day["pods_run"] == PODS and day["pods_not_run"] == 0, day["pods_not_run_said"]
        # A moved share's pod is made again with a claim of its own, which the controller places too
        # (a pod moved before it ran is no move, but its claim was allocated: hence at least).
        allocated = sum(day["claims_allocated_by"].values())
        assert allocated >= PODS + day["pods_moved"] if key == "controller" else allocated == PODS
        assert key == "controller" or day["pods_moved"] == 0
        # Each path's claims are allocated by it alone: kube-scheduler never writes an opt-in one.
        by_scheduler = day["claims_allocated_by"].get("kube-scheduler", 0)
        assert by_scheduler == (PODS if key == "scheduler" else 0), day["claims_allocated_by"]
        assert day["nodes_added"] > 0 and day["pods_on_new_nodes"] > 0
        assert day["nodes_removed_after_day"] > 0 and day["nodes_left"] == 0
        assert day["wait_p50_s"] is not None and day["wait_p50_s"] <= day["wait_p99_s"]
        columns, rows = day["series"]["columns"], day["series"]["rows"]
        used, bound, packed, kept = (columns.index(c) for c in ("used", "bound", "packed", "kept"))
        assert rows and all(row[bound] <= row[used] and row[bound] <= row[packed] for row in rows)
        assert all(row[kept] <= row[used] for row in rows)
        assert day["used_below_bound_samples"] == 0
        seconds = day["node_seconds"]
        assert 0 < seconds["bound"] <= seconds["used"] <= seconds["existing"]
        # Only the controller's path moves pods (its shares, with --empty-nodes): elsewhere every pod keeps its node.
        assert key == "controller" or seconds["kept"] == seconds["used"]
        assert rows[-1][columns.index("existing")] == 0  # the last sample: every node gone
    lines = table.read_text().splitlines()
    assert lines[0] == "| | kube-scheduler | fgpu-controller |"
    assert f"| pods run / arrived | {PODS} / {PODS} | {PODS} / {PODS} |" in lines
