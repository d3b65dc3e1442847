"""Claims prepared again after a reboot or a GPU reset: an allocated claim of one device, its
prepare (which must succeed), the fake nvidia-smi's time-slice state, and a simulated reboot."""

from __future__ import annotations

import json
from pathlib import Path

from driver.claims.refs import ClaimRef
from testbed.fakes import InMemoryKubeApi, allocated_claim, result
from testbed.node_env import NodeEnv
from testbed.reboot import clear_volatile_state
from tests.support.configs import timeslice_interval

LONG = {"source": "FromClass", "requests": [], **timeslice_interval("Long")}  # the class's: only a class sets it


def claim(api: InMemoryKubeApi, name: str, device: str, config=None, memory: str | None = None) -> ClaimRef:
    entry = result(device)
    if memory:
        entry = {**entry, "shareID": f"share-{name}", "consumedCapacity": {"memory": memory}}
    api.claims[("default", name)] = allocated_claim("default", name, f"uid-{name}", [entry], config)
    return ClaimRef("default", name, f"uid-{name}")


def prepared(env: NodeEnv, api: InMemoryKubeApi, ref: ClaimRef):
    outcome = env.preparer.prepare([ref])[ref.uid]
    assert outcome.error == "", outcome.error
    return outcome


def timeslice(tmp_path: Path, gpu_uuid: str) -> int:
    state = json.loads((tmp_path / "fake-smi.json").read_text())
    return state.get(gpu_uuid, {}).get("timeslice", 0)


def reboot(env: NodeEnv, tmp_path: Path) -> None:
    clear_volatile_state(env.session.nvml, tmp_path / "fake-smi.json", env.cdi.cdi_dir, [tmp_path])
