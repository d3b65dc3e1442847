"""A node's prepared state checked whole: checkpoint, MIG instances, CDI specs, MPS daemons and their tmpfs agree."""

from __future__ import annotations

import json
import os

from driver.nvml.session import NvmlSession
from partitioner import tmpfs
from testbed.plugin_process import PluginUnderTest

MIG_KINDS = ("mig", "mig-mps")


def mps_daemons(plugin: PluginUnderTest) -> set[str]:
    running = set()
    for pid_file in (plugin.state_dir / "mps").glob("*/pipe/nvidia-cuda-mps-control.pid"):
        try:
            os.kill(int(pid_file.read_text()), 0)
        except (ProcessLookupError, ValueError):
            continue
        running.add(pid_file.parent.parent.name)
    return running


def check_consistent(plugin: PluginUnderTest, session: NvmlSession) -> dict:
    """The invariants; returns the prepared claims."""
    checkpoint = json.loads((plugin.state_dir / "checkpoint.json").read_text())["claims"]
    assert all(c["state"] == "PrepareCompleted" for c in checkpoint.values()), checkpoint
    owned_mig = {
        (d["gpu_index"], d["mig_profile_id"], d["mig_start"])
        for c in checkpoint.values()
        for d in c["devices"]
        if d["kind"] in MIG_KINDS
    }
    existing = {(i, r.profile_id, r.start) for i in range(8) for r in session.gpu_instances(i)}
    assert existing == owned_mig
    specs = {
        p.name.removeprefix("k8s.gpu.fgpu.dev-claim_").removesuffix(".json") for p in plugin.cdi_dir.glob("*.json")
    }
    assert specs == set(checkpoint)
    # A GPU's daemon by its UUID, a partition's by its MIG device's.
    mps_gpus = {d["gpu_uuid"] for c in checkpoint.values() for d in c["devices"] if d["kind"] == "mps"}
    mps_gpus |= {d["mig_uuid"] for c in checkpoint.values() for d in c["devices"] if d["kind"] == "mig-mps"}
    assert mps_daemons(plugin) == mps_gpus
    mps_dirs = {p.name for p in (plugin.state_dir / "mps").glob("*")} if (plugin.state_dir / "mps").exists() else set()
    assert mps_dirs == mps_gpus
    mounted = {p.parent.name for p in (plugin.state_dir / "mps").glob("*/shm") if tmpfs.is_mounted(p)}
    assert mounted == mps_gpus
    return checkpoint
