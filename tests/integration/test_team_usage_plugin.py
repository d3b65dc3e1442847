"""The plugin as a real process on mock GPUs: its GPU-seconds and idle claims follow what
`fgpu mock usage` makes NVML report, and `fgpu status --idle` / `--by namespace` read them from its
metrics endpoint over HTTP, as an operator would."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest

from driver.nvml.session import MOCK_STATE_ENV
from testbed.claims_api import create_allocated_claim, create_claim
from testbed.cluster.harness import free_port
from tests.support import ROOT

pytestmark = pytest.mark.cluster


def fgpu(*args: str, env: dict[str, str]) -> dict[str, Any]:
    run = subprocess.run([sys.executable, "-m", "driver.cli", *args], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout) if run.stdout.strip() else {}


def test_usage_metrics_follow_the_mock_and_fgpu_status_reports_them(start_plugin, resource_api, tmp_path):
    state = tmp_path / "gpus.json"
    port = free_port()
    plugin = start_plugin(extra_args=[f"--metrics-port={port}", "--metrics-tenant-labels"],
                          extra_env={MOCK_STATE_ENV: str(state)})  # fmt: skip
    plugin.register()
    trainer = create_claim(resource_api, devices=[("gpu", "gpu-1")])
    notebook = create_allocated_claim(resource_api, [{"request": "gpu", "device": "gpu-4-mig-3g40gb-0"}])
    assert not [r.error for r in plugin.prepare([trainer, notebook]).values() if r.error]
    env = {"PATH": "/usr/bin:/bin", "NVML": "mock:dgx-h100", MOCK_STATE_ENV: str(state)}
    metrics = f"--metrics=http://127.0.0.1:{port}/metrics"
    try:
        fgpu("mock", "usage", "--gpu=1", "--utilization=90", env=env)  # the trainer computes
        # Each scrape takes a sample: this one sees both claims held (if the plugin's own samples,
        # 5 s apart, have not yet), so that 3 s later the notebook has been idle for 3 s.
        fgpu("status", "--idle=1h", metrics, "-o", "json", env=env)
        time.sleep(3)
        idle = fgpu("status", "--idle=2s", metrics, "-o", "json", env=env)["idleClaims"]
        assert [(c["claim"], c["kind"]) for c in idle] == [(f"default/{notebook['name']}", "mig")]

        # A process computing on the notebook's MIG device is use (GPM measures its H100 instance
        # busy: 30% of the GPU's SMs is 66% of a 3g.40gb's); the trainer's GPU goes quiet.
        (gi_id,) = json.loads(state.read_text())["gpus"][4]["gpu_instances"]
        fgpu("mock", "usage", "--gpu=4", "--pid=4242", f"--gi={gi_id}", "--ci=0", "--sm=30", env=env)
        fgpu("mock", "usage", "--gpu=1", "--utilization=0", env=env)
        time.sleep(3)
        idle = fgpu("status", "--idle=2s", metrics, "-o", "json", env=env)["idleClaims"]
        assert [(c["claim"], c["kind"]) for c in idle] == [(f"default/{trainer['name']}", "whole")]

        hours = {
            (u["namespace"], u["kind"]): u["gpuHours"]
            for u in fgpu("status", "--by=namespace", metrics, "-o", "json", env=env)["namespaces"]
        }
        assert set(hours) == {("default", "whole"), ("default", "mig")}
        assert hours[("default", "whole")] > 5 / 3600  # held over the test's 6 s and more
        # The 3g.40gb counts half a GPU over the same time (one sample apart at most: prepared together).
        assert hours[("default", "mig")] == pytest.approx(
            hours[("default", "whole")] / 2, abs=0.5 * 5 / 3600
        )  # half a GPU for one 5 s sample
    finally:
        assert not [e for e in plugin.unprepare([trainer, notebook]).values() if e]
