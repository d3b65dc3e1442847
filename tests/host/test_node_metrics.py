"""The plugin's metrics after prepares and unprepares through the driver, over mock NVML and the
in-memory API: kubelet's calls go through the DRA service as kubelet's would."""

from __future__ import annotations

import pytest

from driver.claims.refs import ClaimRef
from driver.node.kubelet.dra_service import DraV1Service
from driver.node.metrics import ClaimHolders, NodeCollector, node_registry
from driver.nvml.mock import SIMULATED_MPS_GPU_PERCENT
from testbed.fakes import InMemoryKubeApi, allocated_claim, result
from testbed.node_env import NodeEnv
from tests.support.dra_calls import Samples, prepare, unprepare

MIB = 2**20


def add_claim(api: InMemoryKubeApi, name: str, results: list[dict], pods: tuple[str, ...] = ()) -> ClaimRef:
    claim = allocated_claim("team", name, f"uid-{name}", results)
    claim["status"]["reservedFor"] = [{"resource": "pods", "name": pod, "uid": f"pod-{pod}"} for pod in pods]
    api.claims[("team", name)] = claim
    return ClaimRef("team", name, f"uid-{name}")


def mps_share(device: str) -> dict:
    return {**result(device), "shareID": f"share-{device}", "consumedCapacity": {"memory": "4Gi", "compute": "20"}}


@pytest.fixture
def plugin(node: tuple[InMemoryKubeApi, NodeEnv]) -> tuple[InMemoryKubeApi, NodeEnv, DraV1Service, Samples]:
    api, env = node
    collector = NodeCollector("node-a", env.claims, env.session, env.gpus, ClaimHolders(api), tenant_labels=True)
    return api, env, DraV1Service(env.preparer, lambda uids, answered: None), Samples(node_registry(collector))


@pytest.mark.root  # mounts an MPS tmpfs / uses kubelet's directories
def test_node_state_and_usage_by_the_pod_holding_the_device(plugin):
    api, env, service, samples = plugin
    refs = [
        add_claim(api, "whole", [result("gpu-0")], pods=("trainer",)),
        add_claim(api, "mig", [result("gpu-2-mig-1g10gb-0")], pods=("notebook",)),
        add_claim(api, "mps-a", [mps_share("gpu-3-mps")], pods=("web-1", "web-2")),
        add_claim(api, "mps-b", [mps_share("gpu-3-mps")]),
    ]
    assert set(prepare(service, refs).values()) == {""}

    for kind, count in {"whole": 1, "mig": 1, "mps": 2, "timeslice": 0}.items():
        assert samples.value("fgpu_prepared_devices", node="node-a", kind=kind) == count
    gpu3 = {"gpu": env.gpus[3].uuid, "gpu_index": "3"}
    assert samples.value("fgpu_mps_clients", **gpu3) == 2
    gpu2 = {"gpu": env.gpus[2].uuid, "gpu_index": "2"}
    assert samples.value("fgpu_mig_instances", **gpu2, mig_profile="1g.10gb") == 1

    # An MPS GPU: one series per pod of each claim (a claim without pods: pod ""), NVML's load.
    holders = {
        (s["claim"], s["claim_pod"]) for s in samples.series("fgpu_gpu_utilization_ratio") if s["gpu"] == gpu3["gpu"]
    }
    assert holders == {("mps-a", "web-1"), ("mps-a", "web-2"), ("mps-b", "")}
    held = {**gpu3, "claim_namespace": "team", "claim_pod": "web-1", "claim": "mps-a"}
    assert samples.value("fgpu_gpu_utilization_ratio", **held) == SIMULATED_MPS_GPU_PERCENT / 100
    assert samples.value("fgpu_gpu_memory_total_bytes", **held) == env.gpus[3].memory_bytes
    nobody = {"gpu": env.gpus[1].uuid, "gpu_index": "1", "claim_namespace": "", "claim_pod": "", "claim": ""}
    assert samples.value("fgpu_gpu_utilization_ratio", **nobody) == 0
    assert samples.value("fgpu_gpu_memory_used_bytes", **nobody) == 0

    # A GPU in MIG mode: NVML measures no utilisation there; its MIG device's memory by its pod.
    assert not [s for s in samples.series("fgpu_gpu_utilization_ratio") if s["gpu"] == gpu2["gpu"]]
    (mig,) = samples.series("fgpu_mig_memory_total_bytes")
    (instance,) = env.session.gpu_instances(2)
    assert mig == {**gpu2, "mig": instance.compute_instances[0][1], "mig_profile": "1g.10gb"} | {
        "claim_namespace": "team",
        "claim_pod": "notebook",
        "claim": "mig",
    }
    assert samples.value("fgpu_mig_memory_total_bytes", **mig) == 9984 * MIB  # the dgx-h100 1g.10gb
    assert 0 < samples.value("fgpu_mig_memory_used_bytes", **mig) < 9984 * MIB

    assert set(unprepare(service, refs).values()) == {""}
    assert samples.value("fgpu_prepared_devices", node="node-a", kind="mps") == 0
    assert samples.value("fgpu_mps_clients", **gpu3) == 0
    assert samples.series("fgpu_mig_instances") == []
    assert samples.series("fgpu_mig_memory_used_bytes") == []


@pytest.mark.root  # mounts an MPS tmpfs / uses kubelet's directories
def test_another_instance_sharing_the_state_reports_the_same_devices(plugin):
    """Rolling update: the state-derived metrics come from the checkpoint, whichever instance
    prepared the claim."""
    api, env, service, _ = plugin
    assert prepare(service, [add_claim(api, "one", [mps_share("gpu-6-mps")], pods=("p",))]) == {"uid-one": ""}
    other = env.restart(api)
    samples = Samples(
        node_registry(
            NodeCollector("node-a", other.claims, other.session, other.gpus, ClaimHolders(api), tenant_labels=True)
        )
    )
    assert samples.value("fgpu_prepared_devices", node="node-a", kind="mps") == 1
    assert samples.value("fgpu_mps_clients", gpu=env.gpus[6].uuid, gpu_index="6") == 1
    pods = {s["claim_pod"] for s in samples.series("fgpu_gpu_memory_used_bytes") if s["claim"] == "one"}
    assert pods == {"p"}
