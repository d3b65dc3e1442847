"""Publishing only what prepare can make real, on the plugin process against the real apiserver:
an A100 with MIG mode off publishes no MIG device and the log says why; once an admin switches MIG
mode on and resets the GPU (here through the mock's shared state), its slices follow without a
restart. `fgpu status` says why each GPU offers less."""

from __future__ import annotations

import json
from pathlib import Path

import pynvml
import pytest

from driver.nvml.machine import load_machine
from driver.nvml.mock import MockNvml
from driver.nvml.session import MOCK_STATE_ENV
from testbed.cluster.host_state import short_temp_dir
from testbed.workloads import wait_for
from tests.support.cli import status
from tests.support.pools import complete_pool

pytestmark = pytest.mark.cluster
NODE = "node-offer"


def kinds_of_gpu(resource_api, index: int) -> set[str]:
    devices = [d for s in complete_pool(resource_api, NODE) for d in s.spec.devices or []]
    return {d.attributes["type"].string for d in devices if d.attributes["index"].int == index}


def not_offered(cluster) -> dict[int, str | None]:
    """GPU index -> notOffered, as `fgpu status -o json` reports the node."""
    run = status(f"--kubeconfig={cluster.kubeconfig}", f"--node={NODE}", "-o", "json")
    assert run.returncode == 0, run.stderr
    (node,) = json.loads(run.stdout)["nodes"]
    return {gpu["index"]: gpu["notOffered"] for gpu in node["gpus"]}


def test_an_a100_switched_to_mig_and_reset_publishes_mig_without_a_restart(
    cluster, core_api, start_plugin, resource_api
):
    if not core_api.list_node(field_selector=f"metadata.name={NODE}").items:
        cluster.add_node(NODE)
    root = short_temp_dir("offer")
    state = Path(root) / "gpus.json"
    plugin = start_plugin(node=NODE, root=root, nvml="mock:dgx-a100-40gb", extra_env={MOCK_STATE_ENV: str(state)})
    assert wait_for(lambda: kinds_of_gpu(resource_api, 2)) == {"gpu", "mps", "timeslice"}
    assert "GPU 2 (NVIDIA A100-SXM4-40GB) offers no mig: MIG mode is off" in plugin.logs()
    assert not_offered(cluster)[2] == "mig: MIG mode off, switching needs a GPU reset"

    admin = MockNvml(load_machine("dgx-a100-40gb"), state)  # nvidia-smi -i 2 -mig 1, then -r
    admin.nvmlInit()
    assert admin.nvmlDeviceSetMigMode(admin.nvmlDeviceGetHandleByIndex(2), 1) == pynvml.NVML_ERROR_RESET_REQUIRED
    admin.reset_gpu(2)
    assert wait_for(lambda: kinds_of_gpu(resource_api, 2) == {"mig"} or None)
    assert kinds_of_gpu(resource_api, 1) == {"gpu", "mps", "timeslice"}
    assert "GPU 2: MIG mode is on now; GPU 2 (NVIDIA A100-SXM4-40GB) offers no mps, timeslice, whole" in plugin.logs()
    notes = not_offered(cluster)
    assert notes[2] == "mps,timeslice,whole: MIG mode on, switching needs a GPU reset"
    assert notes[1] == "mig: MIG mode off, switching needs a GPU reset"
