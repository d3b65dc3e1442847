"""`make bench`'s prepare-latency command in its small form: the plugin as a process on an in-memory
API, real gRPC over its socket, one caller for a second (its figures belong in BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import ROOT


def test_the_memory_mode_serves_and_reports_one_line_per_run():
    command = [sys.executable, "-m", "bench.prepare_latency", "--api", "memory", "--callers", "1", "--seconds", "1"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    [line] = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert line["api"] == "memory" and line["callers"] == 1
    assert line["claims_per_s"] > 0 and 0 < line["prepare_p50_ms"] <= line["prepare_p99_ms"]
