"""End to end: kube-scheduler allocates MIG placements, MPS shares and time-sliced shares from our
slices; the kubelet stand-in prepares them; the mock's MIG layout, the fake MPS daemon and the CDI
files match; deleting the pods returns the GPUs to idle."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest

from driver.nvml.machine import load_machine
from driver.nvml.mock import MockNvml
from driver.nvml.session import MOCK_STATE_ENV, NvmlSession
from tests.claims_api import pod_with_claim
from tests.cluster.kubelet_standin import KubeletStandIn
from tests.integration.test_crash_safety import check_consistent, mps_daemons
from tests.integration.test_plugin_process import complete_pool, wait_for
from tests.node_env import fake_tools_env, stop_fake_daemons
from tests.plugin_process import PluginUnderTest

pytestmark = pytest.mark.e2e


@pytest.fixture
def node(cluster, resource_api) -> Iterator[tuple[PluginUnderTest, KubeletStandIn, NvmlSession]]:
    plugin = PluginUnderTest(node="node-b", kubeconfig=str(cluster.kubeconfig))
    state = plugin.root / "gpus.json"
    plugin.extra_env = {**fake_tools_env(plugin.root), MOCK_STATE_ENV: str(state)}
    plugin.start()
    kubelet = KubeletStandIn("node-b", str(cluster.kubeconfig), plugin.registrar_dir).start()
    wait_for(lambda: complete_pool(resource_api, "node-b"))
    try:
        yield plugin, kubelet, NvmlSession(MockNvml(load_machine("dgx-h100"), state))
    finally:
        kubelet.stop()
        plugin.stop()
        stop_fake_daemons(plugin.root)


def claim_template(name: str, device_class: str, selector: str | None = None, capacity: dict | None = None) -> dict:
    exactly: dict = {"deviceClassName": device_class}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}},
    }


def test_mig_mps_and_timeslice_pods(node, resource_api, core_api):
    plugin, kubelet, session = node
    suffix = uuid.uuid4().hex[:6]
    templates = {
        "mig": claim_template(
            f"mig-{suffix}", "mig.gpu.fgpu.dev", 'device.attributes["gpu.fgpu.dev"].profile == "3g.40gb"'
        ),
        "mps": claim_template(f"mps-{suffix}", "mps.gpu.fgpu.dev", capacity={"memory": "10Gi", "compute": "25"}),
        "mps2": claim_template(f"mps2-{suffix}", "mps.gpu.fgpu.dev", capacity={"memory": "30Gi", "compute": "50"}),
        "ts": claim_template(f"ts-{suffix}", "timeslice.gpu.fgpu.dev", capacity={"memory": "4Gi"}),
    }
    pair = claim_template(
        f"pair-{suffix}", "mig.gpu.fgpu.dev", 'device.attributes["gpu.fgpu.dev"].profile == "1g.10gb"'
    )
    request = pair["spec"]["spec"]["devices"]["requests"][0]
    pair["spec"]["spec"]["devices"]["requests"] = [request, {**request, "name": "second"}]
    pair["spec"]["spec"]["devices"]["constraints"] = [{"matchAttribute": "gpu.fgpu.dev/parentUUID"}]
    templates["pair"] = pair
    uids = {}
    for kind, template in templates.items():
        resource_api.create_namespaced_resource_claim_template("default", template)
        uids[kind] = core_api.create_namespaced_pod(
            "default", pod_with_claim(f"{kind}-{suffix}", template["metadata"]["name"], "node-b")
        ).metadata.uid
    for pod_uid in uids.values():
        wait_for(lambda u=pod_uid: kubelet.prepared.get(u), timeout=60)

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
    smi = json.loads((plugin.root / "fake-smi.json").read_text())
    assert list(smi.values()) == [{"timeslice": 0}]  # the class asks for the Default interval
    prepared = check_consistent(plugin, session)
    assert set(prepared) == {c.metadata.uid for c in (mig_claim, pair_claim, mps_claim, mps2_claim, ts_claim)}

    for kind in uids:
        core_api.delete_namespaced_pod(f"{kind}-{suffix}", "default")
    for pod_uid in uids.values():
        wait_for(lambda u=pod_uid: u not in kubelet.prepared, timeout=60)
    assert check_consistent(plugin, session) == {}
    assert session.gpu_instances(gpu_index) == []
    assert not kubelet.errors, kubelet.errors
