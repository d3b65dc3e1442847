"""`python -m bench.fleet` in its small form (its own control plane, kwok, the fleet publisher,
kube-scheduler then the controller): every pod placed on both paths, the figures reported (the
fleet-scale runs belong in BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import ROOT


def test_the_small_fleet_places_every_pod_on_both_paths_and_reports():
    command = [sys.executable, "-m", "bench.fleet", "--nodes", "4", "--pods", "20"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    fleet, scheduler, ready, controller, memory, ratio = [
        json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")
    ]
    assert fleet["slices"] == 4 * 2 and fleet["fleet_publish_s"] > 0  # dgx-h100 offering whole GPUs: 2 slices
    for phase in (scheduler, controller):
        assert phase["pods"] == 20 and phase["not_placed"] is None and phase["pods_per_s"] > 0
    # kube-scheduler's share on the controller's path: from the gate lifted to the pod bound
    assert 0 <= controller["released_to_bound_p50_s"] <= controller["released_to_bound_p99_s"]
    assert "released_to_bound_p50_s" not in scheduler
    assert ready["controller_ready_s"] > 0 and memory["controller_rss_mib"] > 0
    assert ratio["ratio_pods_per_s"] > 0
