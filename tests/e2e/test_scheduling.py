"""End to end on the real node: kube-scheduler allocates from the plugin's slices, kubelet prepares."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest

from testbed.claims_api import gpu_request
from testbed.node_plugin import NodePlugin
from testbed.workloads import pod, wait_for, wait_running
from tests.support.pools import complete_pool

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]


@pytest.fixture
def plugin(real_node) -> Iterator[NodePlugin]:
    plugin = NodePlugin.on(real_node).start_registered()
    try:
        yield plugin
    finally:
        plugin.remove()


def template(name: str, selector: str) -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [gpu_request(selector=selector)]}}},
    }


def test_pod_gets_a_gpu_by_cel_selector(plugin, real_node, resource_api, core_api):
    wait_for(lambda: complete_pool(resource_api, real_node.name))
    suffix = uuid.uuid4().hex[:6]
    selector = (
        'device.attributes["gpu.fgpu.dev"].productName == "NVIDIA H100 80GB HBM3" && '
        'device.capacity["gpu.fgpu.dev"].memory.compareTo(quantity("40Gi")) >= 0'
    )
    resource_api.create_namespaced_resource_claim_template("default", template(f"one-h100-{suffix}", selector))
    core_api.create_namespaced_pod("default", pod(f"trainer-{suffix}", real_node.name, f"one-h100-{suffix}"))
    bound = wait_running(core_api, f"trainer-{suffix}")
    claim_name = bound.status.resource_claim_statuses[0].resource_claim_name
    claim = resource_api.read_namespaced_resource_claim(claim_name, "default")
    (result,) = claim.status.allocation.devices.results
    assert result.driver == "gpu.fgpu.dev" and result.pool == real_node.name
    spec_path = plugin.cdi_dir / f"k8s.gpu.fgpu.dev-claim_{claim.metadata.uid}.json"
    spec = json.loads(spec_path.read_text())
    index = int(result.device.removeprefix("gpu-"))
    assert spec["devices"][0]["name"] == f"{claim.metadata.uid}-{result.device}"  # the CDI ID kubelet got
    # Mock GPUs: the container's /dev/nvidiaN is the host's /dev/null (real_node tests read it inside).
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": f"/dev/nvidia{index}", "hostPath": "/dev/null"}
    ]

    # A restart keeps the prepared claim.
    plugin.restart()
    checkpoint = json.loads((plugin.state_dir / "checkpoint.json").read_text())
    assert claim.metadata.uid in checkpoint["claims"]

    core_api.delete_namespaced_pod(f"trainer-{suffix}", "default", grace_period_seconds=1)
    wait_for(lambda: not spec_path.exists(), timeout=60)


def test_unsatisfiable_claim_stays_pending_with_the_schedulers_reason(plugin, real_node, resource_api, core_api):
    wait_for(lambda: complete_pool(resource_api, real_node.name))
    suffix = uuid.uuid4().hex[:6]
    selector = 'device.capacity["gpu.fgpu.dev"].memory.compareTo(quantity("1Ti")) >= 0'
    resource_api.create_namespaced_resource_claim_template("default", template(f"huge-{suffix}", selector))
    core_api.create_namespaced_pod("default", pod(f"huge-{suffix}", real_node.name, f"huge-{suffix}"))

    def unschedulable_message() -> str | None:
        status = core_api.read_namespaced_pod(f"huge-{suffix}", "default").status
        for condition in status.conditions or []:
            if condition.type == "PodScheduled" and condition.status == "False" and condition.message:
                return condition.message
        return None

    message = wait_for(unschedulable_message, timeout=30)
    assert "cannot allocate all claims" in message
    assert not list(plugin.cdi_dir.glob("*.json"))
    core_api.delete_namespaced_pod(f"huge-{suffix}", "default", grace_period_seconds=0)
