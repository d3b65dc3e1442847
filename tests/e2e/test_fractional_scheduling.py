"""End to end on the real node: kube-scheduler allocates MIG placements, MPS shares and time-sliced
shares from our slices; kubelet prepares them and the pods run; the mock's MIG layout, the fake MPS
daemon and the CDI files match; deleting the pods returns the GPUs to idle."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest

from driver.nvml.session import NvmlSession
from testbed.node_plugin import NodePlugin
from testbed.workloads import claim_template, pod, wait_for, wait_running
from tests.support.node_state import check_consistent, mps_daemons
from tests.support.pools import complete_pool

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]


@pytest.fixture
def node(real_node, cluster, resource_api) -> Iterator[tuple[NodePlugin, NvmlSession]]:
    plugin = NodePlugin.on(real_node).start_registered()
    try:
        wait_for(lambda: complete_pool(resource_api, real_node.name))
        yield plugin, plugin.gpus()
    finally:
        plugin.remove()


def test_mig_mps_and_timeslice_pods(node, real_node, resource_api, core_api):
    plugin, session = node
    suffix = uuid.uuid4().hex[:6]
    templates = {
        "mig": claim_template(
            f"mig-{suffix}", "mig.gpu.fgpu.dev", selector='device.attributes["gpu.fgpu.dev"].profile == "3g.40gb"'
        ),
        "mps": claim_template(f"mps-{suffix}", "mps.gpu.fgpu.dev", capacity={"memory": "10Gi", "compute": "25"}),
        "mps2": claim_template(f"mps2-{suffix}", "mps.gpu.fgpu.dev", capacity={"memory": "30Gi", "compute": "50"}),
        "ts": claim_template(f"ts-{suffix}", "timeslice.gpu.fgpu.dev", capacity={"memory": "4Gi"}),
    }
    pair = claim_template(
        f"pair-{suffix}", "mig.gpu.fgpu.dev", selector='device.attributes["gpu.fgpu.dev"].profile == "1g.10gb"'
    )
    request = pair["spec"]["spec"]["devices"]["requests"][0]
    pair["spec"]["spec"]["devices"]["requests"] = [request, {**request, "name": "second"}]
    pair["spec"]["spec"]["devices"]["constraints"] = [{"matchAttribute": "gpu.fgpu.dev/parentUUID"}]
    templates["pair"] = pair
    for kind, template in templates.items():
        resource_api.create_namespaced_resource_claim_template("default", template)
        core_api.create_namespaced_pod("default", pod(f"{kind}-{suffix}", real_node.name, template["metadata"]["name"]))
    for kind in templates:
        wait_running(core_api, f"{kind}-{suffix}")

    def allocation(kind: str):
        status = core_api.read_namespaced_pod(f"{kind}-{suffix}", "default").status
        claim = resource_api.read_namespaced_resource_claim(
            status.resource_claim_statuses[0].resource_claim_name, "default"
        )
        return claim, claim.status.allocation.devices.results[0]

    mig_claim, mig = allocation("mig")
    assert "-mig-3g40gb-" in mig.device
    gpu_index = int(mig.device.split("-")[1])
    pair_claim, _ = allocation("pair")
    pair_devices = [r.device for r in pair_claim.status.allocation.devices.results]
    assert len({d.split("-mig-")[0] for d in pair_devices}) == 1  # matchAttribute parentUUID: one GPU
    profile_ids = {"3g40gb": 9, "1g10gb": 19}
    expected = sorted(
        (int(d.split("-")[1]), profile_ids[d.split("-")[3]], int(d.rsplit("-", 1)[1]))
        for d in [mig.device, *pair_devices]
    )
    assert sorted((i, r.profile_id, r.start) for i in range(8) for r in session.gpu_instances(i)) == expected

    mps_claim, mps = allocation("mps")
    mps2_claim, mps2 = allocation("mps2")
    assert mps.device == mps2.device and mps.device.endswith("-mps")  # two claims share one GPU under MPS
    assert mps.consumed_capacity == {"memory": "10Gi", "compute": "25", "clients": "1"}  # clients: its default
    spec = json.loads((plugin.cdi_dir / f"k8s.gpu.fgpu.dev-claim_{mps_claim.metadata.uid}.json").read_text())
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25" in spec["devices"][0]["containerEdits"]["env"]
    assert len(mps_daemons(plugin)) == 1

    ts_claim, ts = allocation("ts")
    assert ts.device.endswith("-ts")
    smi = json.loads((plugin.state_dir / "mock-tools" / "nvidia-smi.json").read_text())
    assert list(smi.values()) == [{"timeslice": 0}]  # the class asks for the Default interval
    prepared = check_consistent(plugin, session)
    assert set(prepared) == {c.metadata.uid for c in (mig_claim, pair_claim, mps_claim, mps2_claim, ts_claim)}

    for kind in templates:
        core_api.delete_namespaced_pod(f"{kind}-{suffix}", "default", grace_period_seconds=1)
    wait_for(lambda: not list(plugin.cdi_dir.glob("*.json")), timeout=60)
    assert check_consistent(plugin, session) == {}
    assert session.gpu_instances(gpu_index) == []
