"""Scheduling gates: lifted as soon as a unit is written, and only once a gang is whole."""

from __future__ import annotations

from tests.support.controller_cluster import (
    claims_in,
    fake_cluster,
    gated_pod,
    gates,
    opt_in_claim,
)


def test_gang_pods_wait_for_the_whole_gang(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    gang = {"gpu.fgpu.dev/gang": "g", "gpu.fgpu.dev/gang-size": "2"}
    first = opt_in_claim("w0", 2, **gang)
    first["status"] = {"allocation": {"devices": {"results": []}}}  # allocated earlier, its partner is not
    api.put("claims", first)
    api.put("claims", opt_in_claim("w1", 99, **gang))  # w1 cannot fit
    api.put("pods", gated_pod("p0", "w0"))
    replicas(api).run_pass()
    assert gates(api, "p0") == ["gpu.fgpu.dev/allocation", "other"]  # w0 is allocated, its gang is not whole
    assert api.status_writes == ["w0"]  # and w0 was taken back
    assert "allocation" not in claims_in(api)["w0"]["status"]


def test_pods_go_as_soon_as_their_unit_is_written(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    for name in ("a", "b"):
        api.put("claims", opt_in_claim(name, 1))
        api.put("pods", gated_pod(f"pod-{name}", name))
    api.failing_status_writes = {2}  # b's write fails: the pass ends early, a's pod went already
    replicas(api).run_pass()
    assert gates(api, "pod-a") == ["other"]
    assert gates(api, "pod-b") == ["gpu.fgpu.dev/allocation", "other"]
