"""Recommendations as JSON Patches to claim templates: what each change of size writes, the test
that guards the device class, and one patch per shared template request, the largest size."""

from __future__ import annotations

from driver.sizing.history import Workload
from driver.sizing.patch import request_ops, template_patches
from driver.sizing.recommend import Observed, Recommendation, WorkloadKey
from driver.sizing.sizes import Size

H100 = "NVIDIA H100 80GB HBM3"
BASE = "/spec/spec/devices/requests/1/exactly"


def rec(current: Size, recommended: Size, owner: str = "web") -> Recommendation:
    key = WorkloadKey("ns", Workload("Deployment", owner), "tpl", "gpu")
    observed = Observed(1, 1, 1.0, 1, 1.0, 0.0, None)
    return Recommendation(key, H100, 1, current, recommended, "", 1.0, 0.0, observed)


def test_a_smaller_share_replaces_its_capacity_after_testing_the_class():
    assert request_ops(rec(Size("mps", 10240, 25), Size("mps", 2560, 9))) == [
        {"op": "test", "path": f"{BASE}/deviceClassName", "value": "mps.gpu.fgpu.dev"},
        {"op": "add", "path": f"{BASE}/capacity", "value": {"requests": {"memory": "2560Mi", "compute": "9"}}},
    ]


def test_a_whole_gpu_to_a_mig_profile_changes_class_and_selectors():
    selector = 'device.attributes["gpu.fgpu.dev"].profile == "1g.20gb"'
    assert request_ops(rec(Size("whole"), Size("mig", profile="1g.20gb")))[1:] == [
        {"op": "replace", "path": f"{BASE}/deviceClassName", "value": "mig.gpu.fgpu.dev"},
        {"op": "add", "path": f"{BASE}/selectors", "value": [{"cel": {"expression": selector}}]},
    ]


def test_a_share_grown_to_a_whole_gpu_loses_its_capacity_and_is_pinned_to_the_product():
    ops = request_ops(rec(Size("mps", 10240, 25), Size("whole")))
    assert ops[-1] == {"op": "remove", "path": f"{BASE}/capacity"}
    assert f'productName == "{H100}"' in ops[2]["value"][0]["cel"]["expression"]


def test_one_patch_per_template_request_the_largest_and_none_for_unchanged():
    small, large = Size("mps", 2560, 9), Size("mps", 4096, 9)
    unchanged = rec(Size("mps", 1024, 5), Size("mps", 1024, 5), "other")
    (patch,) = template_patches(
        [rec(Size("mps", 10240, 25), small), rec(Size("mps", 10240, 25), large, "b"), unchanged]
    )
    assert (patch.namespace, patch.template) == ("ns", "tpl")
    assert patch.patch[-1]["value"] == {"requests": {"memory": "4096Mi", "compute": "9"}}
    assert template_patches([unchanged]) == []
