"""The allocator kept from pass to pass (driver/controller/allocators.py): ready on a standby, told
only what changed in the slices."""

from __future__ import annotations

import json
from typing import Any

from tests.support.controller_cluster import (
    claims_in,
    devices_of,
    fake_cluster,
    gated_pod,
    opt_in_claim,
    sync,
)


def test_a_standby_keeps_its_allocator_ready_and_writes_nothing(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    api.put("claims", opt_in_claim("x", 2))
    standby = replicas(api)
    standby.leader.leading = lambda: False  # type: ignore[method-assign]
    ready = standby.keep_ready()
    assert ready is not None and not api.status_writes and not api.store["ledgers"]
    standby.leader.leading = lambda: True  # type: ignore[method-assign]  # it wins the lease
    standby.run_pass()
    assert standby.allocators.allocator() is ready  # the first pass placed on it, nothing rebuilt
    assert len(devices_of(claims_in(api)["x"])) == 2


def test_new_slices_reach_the_allocator_without_gathering_other_nodes_again(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    api.put("claims", opt_in_claim("a", 8))
    controller = replicas(api)
    controller.run_pass()
    snapshot = controller.allocators.snapshot()
    n1_pools = snapshot.pools["n1"]
    for obj in json.loads(h100_slices.replace('"n1', '"n2'))["items"]:
        api.put("slices", obj)
    unreadable = json.loads(h100_slices.replace('"n1', '"n3'))["items"][0]
    unreadable["spec"]["sharedCounters"][0]["counters"]["memory-slice-0"]["value"] = "lots"
    api.put("slices", unreadable)
    api.put("claims", opt_in_claim("b", 8))
    sync(controller)
    controller.run_pass()
    assert controller.allocators.snapshot() is snapshot and snapshot.pools["n1"] is n1_pools  # n1 untouched
    assert {pool for pool, _ in devices_of(claims_in(api)["b"])} == {"n2"}
    assert {s.pool for s in controller.informers["slices"].items()} == {"n1", "n2"}  # n3's left out


def test_the_nodes_are_gathered_again_when_one_is_relabelled_or_joins_not_when_its_status_changes(
    h100_slices, replicas
):
    api = fake_cluster(h100_slices, nodes=2)
    controller = replicas(api)
    controller.run_pass()
    snapshot = controller.allocators.snapshot()
    api.put("nodes", {"metadata": {"name": "n2", "labels": {}}, "status": {"allocatable": {"cpu": "64"}}})
    sync(controller, "nodes")
    assert controller.allocators.snapshot() is snapshot  # a status update: nothing a selector reads
    api.put("nodes", {"metadata": {"name": "n2", "labels": {"zone": "b"}}})
    sync(controller, "nodes")
    relabelled = controller.allocators.snapshot()
    assert relabelled is not snapshot and relabelled.nodes["n2"].labels == {"zone": "b"}
    api.put("nodes", {"metadata": {"name": "n3", "labels": {}}})
    sync(controller, "nodes")
    joined = controller.allocators.snapshot()
    assert joined is not relabelled and set(joined.nodes) == {"n1", "n2", "n3"}
    del api.store["nodes"]["/n3"]
    sync(controller, "nodes")
    assert set(controller.allocators.snapshot().nodes) == {"n1", "n2"}


def test_a_pod_without_claims_bound_between_passes_reaches_the_kept_allocators_view_of_its_node(h100_slices, replicas):
    # n1 and n2: 8 H100s and 200 CPUs each. Pass 1 places 16 quarter-GPU MPS claims whose pods ask
    # 5 CPUs: all on n1 (four GPUs full), the mix learned from them, n2 scored and its view kept.
    # Then kube-scheduler binds a pod without claims to n2 that leaves it 4 CPUs: too few for one
    # more such pod, so n2's 8 free GPUs are stranded. Pass 2's quarter share with a 1-CPU pod goes
    # to n2, where it takes a GPU no such pod could have used (fragmentation falls), not to n1,
    # where it would take one they could (as it would on a view still counting n2's 200 CPUs).
    api = fake_cluster(h100_slices, nodes=2)
    for node in ("n1", "n2"):
        api.put("nodes", {"metadata": {"name": node}, "status": {"allocatable": {"cpu": "200", "pods": "110"}}})
    for i in range(16):
        api.put("claims", mps_claim(f"s{i}"))
        api.put("pods", with_cpus(gated_pod(f"p{i}", f"s{i}"), "5"))
    controller = replicas(api)
    controller.run_pass()
    assert {pool for i in range(16) for pool, _ in devices_of(claims_in(api)[f"s{i}"])} == {"n1"}
    web = with_cpus({"metadata": {"name": "web", "namespace": "ml"}, "spec": {"nodeName": "n2"}}, "196")
    api.put("pods", web)
    api.put("claims", mps_claim("x"))
    api.put("pods", with_cpus(gated_pod("px", "x"), "1"))
    sync(controller, "pods", "claims")
    controller.run_pass()
    assert {pool for pool, _ in devices_of(claims_in(api)["x"])} == {"n2"}


def mps_claim(name: str) -> dict[str, Any]:
    """An opt-in claim for an MPS share of a quarter of a GPU's compute."""
    claim = opt_in_claim(name, 1)
    claim["spec"]["devices"]["requests"][0]["exactly"] = {
        "deviceClassName": "mps.gpu.fgpu.dev",
        "capacity": {"requests": {"compute": "25"}},
    }
    return claim


def with_cpus(pod: dict[str, Any], cpus: str) -> dict[str, Any]:
    pod["spec"]["containers"] = [{"name": "c", "resources": {"requests": {"cpu": cpus}}}]
    return pod


# --- PodGroups (scheduling.k8s.io/v1beta1) with a gang policy ---------------------------------
