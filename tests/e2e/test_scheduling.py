"""End to end: kube-scheduler allocates from the plugin's slices, the kubelet stand-in prepares."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest

from tests.claims_api import gpu_request, pod_with_claim
from tests.cluster.kubelet_standin import KubeletStandIn
from tests.integration.test_plugin_process import complete_pool, wait_for
from tests.plugin_process import PluginUnderTest

pytestmark = pytest.mark.e2e


@pytest.fixture
def node_a(start_plugin, cluster) -> Iterator[tuple[PluginUnderTest, KubeletStandIn]]:
    plugin = start_plugin(node="node-a")
    kubelet = KubeletStandIn("node-a", str(cluster.kubeconfig), plugin.registrar_dir).start()
    try:
        yield plugin, kubelet
    finally:
        kubelet.stop()


def template(name: str, selector: str) -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [gpu_request(selector=selector)]}}},
    }


def test_pod_gets_a_gpu_by_cel_selector(node_a, resource_api, core_api):
    plugin, kubelet = node_a
    wait_for(lambda: complete_pool(resource_api, "node-a"))  # kubelet deleted them at start; back again
    suffix = uuid.uuid4().hex[:6]
    selector = (
        'device.attributes["gpu.fgpu.dev"].productName == "NVIDIA H100 80GB HBM3" && '
        'device.capacity["gpu.fgpu.dev"].memory.compareTo(quantity("40Gi")) >= 0'
    )
    resource_api.create_namespaced_resource_claim_template("default", template(f"one-h100-{suffix}", selector))
    created = core_api.create_namespaced_pod(
        "default", pod_with_claim(f"trainer-{suffix}", f"one-h100-{suffix}", "node-a")
    )
    uid = created.metadata.uid

    prepared = wait_for(lambda: kubelet.prepared.get(uid), timeout=30)
    bound = core_api.read_namespaced_pod(f"trainer-{suffix}", "default")
    assert bound.spec.node_name == "node-a"
    claim_name = bound.status.resource_claim_statuses[0].resource_claim_name
    claim = resource_api.read_namespaced_resource_claim(claim_name, "default")
    (result,) = claim.status.allocation.devices.results
    assert result.driver == "gpu.fgpu.dev" and result.pool == "node-a"
    assert prepared.cdi_ids == [f"k8s.gpu.fgpu.dev/claim={claim.metadata.uid}-{result.device}"]
    spec_path = plugin.cdi_dir / f"k8s.gpu.fgpu.dev-claim_{claim.metadata.uid}.json"
    spec = json.loads(spec_path.read_text())
    index = int(result.device.removeprefix("gpu-"))
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [{"path": f"/dev/nvidia{index}"}]
    wait_for(lambda: core_api.read_namespaced_pod(f"trainer-{suffix}", "default").status.phase == "Running")

    # A restart keeps the prepared claim.
    plugin.stop()
    plugin.start()
    checkpoint = json.loads((plugin.plugin_dir / "checkpoint.json").read_text())
    assert claim.metadata.uid in checkpoint["claims"]

    core_api.delete_namespaced_pod(f"trainer-{suffix}", "default")
    wait_for(lambda: uid not in kubelet.prepared, timeout=30)
    assert not spec_path.exists()
    assert not kubelet.errors, kubelet.errors


def test_unsatisfiable_claim_stays_pending_with_the_schedulers_reason(node_a, resource_api, core_api):
    plugin, kubelet = node_a
    wait_for(lambda: complete_pool(resource_api, "node-a"))
    suffix = uuid.uuid4().hex[:6]
    selector = 'device.capacity["gpu.fgpu.dev"].memory.compareTo(quantity("1Ti")) >= 0'
    resource_api.create_namespaced_resource_claim_template("default", template(f"huge-{suffix}", selector))
    core_api.create_namespaced_pod("default", pod_with_claim(f"huge-{suffix}", f"huge-{suffix}", "node-a"))

    def unschedulable_message() -> str | None:
        status = core_api.read_namespaced_pod(f"huge-{suffix}", "default").status
        for condition in status.conditions or []:
            if condition.type == "PodScheduled" and condition.status == "False" and condition.message:
                return condition.message
        return None

    message = wait_for(unschedulable_message, timeout=30)
    assert "cannot allocate all claims" in message
    assert not list(plugin.cdi_dir.glob("*.json"))
    assert not kubelet.prepared
    core_api.delete_namespaced_pod(f"huge-{suffix}", "default", grace_period_seconds=0)
