"""Gated pods of claims that fit nowhere are marked unschedulable for node autoscalers, and keep
their gate; once a node with room appears, the claim is placed there and the gate lifted."""

from __future__ import annotations

from typing import Any

from tests.support.controller_cluster import claims_in, fake_cluster, gated_pod, gates, opt_in_claim


def scheduled_conditions(api: Any, pod: str) -> list[dict[str, Any]]:
    found = api.store["pods"][f"ml/{pod}"]
    return [c for c in (found.get("status") or {}).get("conditions") or [] if c["type"] == "PodScheduled"]


def test_a_pod_whose_claim_fits_nowhere_looks_unschedulable_and_stays_gated(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    api.put("claims", opt_in_claim("big", 9))  # 9 GPUs: no dgx-h100 has them
    api.put("pods", gated_pod("p", "big"))
    controller = replicas(api)
    controller.run_pass()

    (condition,) = scheduled_conditions(api, "p")
    assert condition["status"] == "False" and condition["reason"] == "Unschedulable"
    assert condition["message"].startswith("fgpu: claim big: ")
    assert gates(api, "p") == ["gpu.fgpu.dev/allocation"]
    assert "allocation" not in (claims_in(api)["big"].get("status") or {})
    version = api.store["pods"]["ml/p"]["metadata"]["resourceVersion"]
    controller.run_pass()  # the same reason: not written again
    assert api.store["pods"]["ml/p"]["metadata"]["resourceVersion"] == version


def test_a_pod_whose_claim_fits_is_never_marked(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    api.put("claims", opt_in_claim("small", 1))
    api.put("pods", gated_pod("p", "small"))
    replicas(api).run_pass()
    assert scheduled_conditions(api, "p") == []
    assert gates(api, "p") == []
