"""The claims' status.devices: written after prepare, removed after unprepare, repaired by the
reconciler, other drivers' entries left alone; with the in-memory API's server-side apply."""

from __future__ import annotations

from datetime import datetime

import pytest

from testbed.fakes import result
from tests.support.claim_status import NIC_ENTRY, add_claim, status_devices


def share(device: str, memory: str, compute: str | None = None, request: str = "gpu") -> dict:
    entry = result(device, request=request)
    entry["shareID"] = f"0000-{device}-{memory}"
    entry["consumedCapacity"] = {"memory": memory, **({"compute": compute} if compute else {})}
    return entry


@pytest.mark.root  # mounts an MPS tmpfs / uses kubelet's directories
def test_prepare_reports_each_device_and_unprepare_removes_only_ours(node):
    api, env = node
    ref = add_claim(
        api,
        "mixed",
        [
            result("gpu-0", request="whole"),
            result("gpu-2-mig-3g40gb-4", request="mig"),
            share("gpu-1-mps", "10Gi", "25", request="mps"),
            share("gpu-3-ts", "4Gi", request="ts"),
        ],
    )
    assert env.preparer.prepare([ref])[ref.uid].error == ""
    entries = status_devices(api, ref)
    assert set(entries) == {"gpu-0", "gpu-2-mig-3g40gb-4", "gpu-1-mps", "gpu-3-ts", "eth1"}
    assert entries["eth1"] == NIC_ENTRY
    gpus = {gpu.index: gpu.uuid for gpu in env.gpus}
    assert entries["gpu-0"]["data"] == {"kind": "whole", "gpuUUID": gpus[0], "gpuIndex": 0}
    assert "shareID" not in entries["gpu-0"]
    mig = entries["gpu-2-mig-3g40gb-4"]["data"]["mig"]
    (instance,) = env.session.gpu_instances(2)
    assert mig == {
        "uuid": instance.compute_instances[0][1],
        "profile": "3g.40gb",
        "placement": {"start": 4, "size": 4},
        "gpuInstanceID": instance.gi_id,
        "computeInstanceID": instance.compute_instances[0][0],
    }
    mps = entries["gpu-1-mps"]
    assert mps["shareID"] == "0000-gpu-1-mps-10Gi"
    assert mps["data"]["mps"] == {
        "pinnedMemoryLimitBytes": 10 * 2**30,
        "activeThreadPercentage": 25,
        "pipeDirectory": "/tmp/nvidia-mps",
    }
    assert entries["gpu-3-ts"]["data"] == {
        "kind": "timeslice",
        "gpuUUID": gpus[3],
        "gpuIndex": 3,
        "timeSlice": {"interval": "Default"},
    }
    (ready,) = entries["gpu-0"]["conditions"]
    assert ready["type"] == "Ready" and ready["status"] == "True" and ready["reason"] == "Prepared"
    assert ready["observedGeneration"] == 1
    assert datetime.strptime(ready["lastTransitionTime"], "%Y-%m-%dT%H:%M:%SZ")
    assert set(api.status_owners[("default", "mixed")]) == {"net-driver", "gpu.fgpu.dev/node-a"}

    assert env.preparer.unprepare([ref]) == {ref.uid: ""}
    assert status_devices(api, ref) == {"eth1": NIC_ENTRY}
