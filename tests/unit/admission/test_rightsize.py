"""Automatic sizing at claim create (driver/admission/rightsize.py, driver/sizing/initial.py): a claim
made from a template in an opted-in namespace or template gets the recommended share size, the
original in an annotation and a warning; a pinned template, a namespace not opted in, a short
history, anything but a CREATE and every error leave it as it came; an out-of-memory raises at once
and nothing shrinks in the cool-down; a burst reads the histories once. On the real apiserver:
tests/integration/test_rightsize_webhook.py."""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import replace
from typing import Any

import pytest

from driver.admission.rightsize import Rightsizer, rightsize
from driver.kube.errors import KubeUnavailableError
from driver.sizing import store
from driver.sizing.history import DAY_S, ClaimRecord, Sample, UsageHistory, Workload, record
from driver.sizing.initial import ORIGINAL_ANNOTATION, RIGHTSIZE, mode, original_size
from driver.sizing.owner import POD_CLAIM_NAME
from driver.sizing.sizes import Size

H100 = "NVIDIA H100 80GB HBM3"
SHARE = Size("mps", 10240, 25)
NOW = 2 * DAY_S
WHOLE = "gpu.fgpu.dev"
POD = {
    "metadata": {
        "name": "web-abc-xyz",
        "uid": "pod-uid",
        "labels": {"pod-template-hash": "abc"},
        "ownerReferences": [{"kind": "ReplicaSet", "name": "web-abc", "controller": True}],
    },
    "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}]},
}


def history(memory: int = 2048, days: float = 2, size: Size = SHARE, oom_at: int | None = None, **changes: Any):
    base = ClaimRecord("u1", "ns", "c-u1", Workload("Deployment", "web"), "t", "gpu", 0, H100, size)
    samples = [Sample("u1", t, memory, 8.0, oom=t == oom_at) for t in range(int(NOW - days * DAY_S), NOW, 60)]
    return record(UsageHistory(60), [replace(base, **changes)], samples)


def device(kind: str, profile: str | None = None) -> dict[str, Any]:
    """A device as a ResourceSlice publishes it: what sizing reads of it."""
    attributes = {"type": {"string": kind}, "productName": {"string": H100}}
    return {"name": f"gpu-0-{kind}", "attributes": attributes | ({"profile": {"string": profile}} if profile else {})}


EVERYTHING = [device("gpu"), device("mps"), device("timeslice"), device("mig", "1g.10gb"), device("mig", "3g.40gb")]


class Api:
    def __init__(
        self, histories: list[UsageHistory], labels: dict[str, str] | None = None, error=None,
        devices: list[dict[str, Any]] = EVERYTHING,
    ) -> None:  # fmt: skip
        self.configmaps = [store.configmap(f"node-{i}", "fgpu", h) for i, h in enumerate(histories)]
        self.labels = {RIGHTSIZE: "initial"} if labels is None else labels
        self.error = error
        self.slices = [{"spec": {"driver": "gpu.fgpu.dev", "devices": devices}}]
        self.reads: list[str] = []

    def read_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads.append(f"pod {namespace}/{name}")
        return POD if name == POD["metadata"]["name"] else None

    def read_namespace(self, name: str) -> dict[str, Any] | None:
        self.reads.append(f"namespace {name}")
        return {"metadata": {"name": name, "labels": self.labels}}

    def list_usage_histories(self, namespace: str) -> list[dict[str, Any]]:
        self.reads.append(f"histories {namespace}")
        if self.error:
            raise self.error
        return self.configmaps

    def list_driver_slices(self, driver: str) -> list[dict[str, Any]]:
        self.reads.append(f"slices {driver}")
        return self.slices


def claim(requests: dict[str, str] | None = None, annotations: dict[str, str] | None = None, **exactly: Any):
    capacity = {"requests": {"memory": "10Gi", "compute": "25"} if requests is None else requests}
    return {
        "metadata": {
            "generateName": "web-abc-xyz-gpu-",
            "annotations": {POD_CLAIM_NAME: "gpu", **(annotations or {})},
            "ownerReferences": [{"kind": "Pod", "name": "web-abc-xyz", "uid": "pod-uid", "controller": True}],
        },
        "spec": {
            "devices": {
                "requests": [
                    {"name": "gpu", "exactly": {"deviceClassName": "mps.gpu.fgpu.dev", "capacity": capacity, **exactly}}
                ]
            }
        },
    }


def review(obj: dict[str, Any], api: Api, operation: str = "CREATE", sizer: Rightsizer | None = None) -> dict:
    document = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": "r1", "kind": {"kind": "ResourceClaim"}, "operation": operation, "namespace": "ns",
                    "object": obj},
    }  # fmt: skip
    response = rightsize(document, sizer or Rightsizer(api, "fgpu", clock=lambda: NOW))["response"]
    assert response["allowed"] is True  # never a refusal
    return response


def patched(response: dict[str, Any]) -> list[dict[str, Any]]:
    return json.loads(base64.b64decode(response["patch"])) if "patch" in response else []


def test_a_claim_of_an_opted_in_namespace_is_sized_annotated_and_warned() -> None:
    response = review(claim(), Api([history()]))
    assert patched(response) == [
        {"op": "add", "path": "/spec/devices/requests/0/exactly/capacity",
         "value": {"requests": {"memory": "2560Mi", "compute": "9"}}},
        {"op": "add", "path": "/metadata/annotations/gpu.fgpu.dev~1rightsize-original",
         "value": '{"gpu":{"compute":"25","memory":"10Gi"}}'},
    ]  # fmt: skip
    sized, quota = response["warnings"]
    assert "request gpu sized mps 10Gi 25% -> mps 2560Mi 9% (fits the observed use" in sized
    assert ORIGINAL_ANNOTATION in sized and all(len(w) <= 256 for w in response["warnings"])
    assert "counts 2560Mi of Kueue quota gpu.fgpu.dev/share-memory, not 10Gi" in quota


def test_a_template_annotated_initial_is_sized_without_reading_its_namespace() -> None:
    api = Api([history()], labels={})
    assert patched(review(claim(annotations={RIGHTSIZE: "initial"}), api))
    assert not any(read.startswith("namespace") for read in api.reads)


@pytest.mark.parametrize(
    ("annotations", "labels"),
    [({RIGHTSIZE: "off"}, {RIGHTSIZE: "initial"}), ({}, {}), ({}, {RIGHTSIZE: "off"}), ({}, {RIGHTSIZE: "yes"})],
    ids=["pinned-template", "namespace-not-opted-in", "namespace-off", "namespace-unknown-mode"],
)
def test_a_pinned_template_or_a_namespace_not_opted_in_is_untouched(annotations, labels) -> None:
    api = Api([history()], labels=labels)
    assert review(claim(annotations=annotations), api) == {"uid": "r1", "allowed": True}
    assert not any(read.startswith(("pod", "histories")) for read in api.reads)


def test_a_short_history_or_a_pinned_history_leaves_the_claim_as_its_template_made_it(caplog) -> None:
    caplog.set_level(logging.INFO, "fgpu.webhook")
    # The claims seen so far were sized already: the history's "current" is not the template's.
    for old in (history(days=0.5, size=Size("mps", 2560, 9)), history(pinned=True)):
        assert "patch" not in review(claim(), Api([old]))
    assert "history too short" in caplog.text and "pinned" in caplog.text


def test_an_out_of_memory_raises_the_next_claim_at_once_and_the_cool_down_never_shrinks() -> None:
    ran_out = history(memory=2560, size=Size("mps", 2560, 9), original=SHARE, oom_at=NOW - 120)
    # Sized to 2.5Gi, ran out: the template's 10Gi is the size again, so a new claim stays as it is.
    assert "patch" not in review(claim(), Api([ran_out]))
    # A template at 2Gi that ran out: its new claims are raised at once (past the size that ran out).
    small = history(memory=2048, size=Size("mps", 2048, 25), oom_at=NOW - 120)
    ops = patched(review(claim({"memory": "2Gi", "compute": "25"}), Api([small])))
    assert ops[0]["value"]["requests"] == {"memory": "3072Mi", "compute": "25"}  # compute: never below its own
    # A template raised by hand to 20Gi during the cool-down is not shrunk to the recommendation.
    assert "patch" not in review(claim({"memory": "20Gi", "compute": "25"}), Api([ran_out]))


@pytest.mark.parametrize("operation", ["UPDATE", "DELETE", "CONNECT"])
def test_only_a_create_is_sized(operation: str) -> None:
    api = Api([history()])
    assert "patch" not in review(claim(), api, operation)
    assert api.reads == []


@pytest.mark.parametrize(
    "obj",
    [
        {**claim(), "metadata": {**claim()["metadata"], "annotations": {}}},  # not made from a template
        claim(annotations={ORIGINAL_ANNOTATION: "{}"}),  # sized already
        {**claim(), "metadata": {**claim()["metadata"], "ownerReferences": []}},  # no pod
        {**claim(), "metadata": {**claim()["metadata"], "ownerReferences": [
            {"kind": "Pod", "name": "web-abc-xyz", "uid": "another", "controller": True}]}},  # pod re-created
        claim(requests={"memory": "lots"}),  # malformed
        claim(requests={"memory": "2560Mi", "compute": "9"}),  # already the right size
        {**claim(), "spec": {"devices": {"requests": [{"name": "gpu", "firstAvailable": []}]}}},
        {**claim(), "spec": {"devices": {"requests": [{"name": "other", "exactly": {}}]}}},  # no history
        {**claim(), "spec": "garbage"},
    ],
    ids=["no-template", "sized-already", "no-pod", "pod-recreated", "malformed", "right-size", "first-available",
         "no-history", "garbage"],
)  # fmt: skip
def test_anything_else_is_admitted_unchanged(obj: dict[str, Any]) -> None:
    assert review(obj, Api([history()])) == {"uid": "r1", "allowed": True}


def test_an_unreadable_history_admits_unchanged_and_is_not_read_again_by_every_claim_of_a_burst(caplog) -> None:
    api = Api([history()], error=KubeUnavailableError("connection refused"))
    sizer = Rightsizer(api, "fgpu", clock=lambda: NOW)
    for _ in range(5):
        assert "patch" not in review(claim(), api, sizer=sizer)
    assert api.reads.count("histories fgpu") == 1 and api.reads.count("namespace ns") == 1
    assert "admitted unsized: connection refused" in caplog.text
    corrupt = Api([history()])
    corrupt.configmaps[0]["binaryData"][store.DATA_KEY] = "bm90IGd6aXA="
    assert "patch" not in review(claim(), corrupt)


def test_a_burst_reads_the_histories_once_then_again_after_a_minute() -> None:
    api, now = Api([history()]), [NOW]
    sizer = Rightsizer(api, "fgpu", clock=lambda: now[0])
    for _ in range(10):
        assert patched(review(claim(), api, sizer=sizer))
    now[0] += 61
    review(claim(), api, sizer=sizer)
    assert api.reads.count("histories fgpu") == api.reads.count("slices gpu.fgpu.dev") == 2


def test_the_mode_and_the_original_size_as_the_plugin_reads_it() -> None:
    assert mode({RIGHTSIZE: "off"}, {RIGHTSIZE: "initial"}) == "off"
    assert mode({}, {RIGHTSIZE: "initial"}) == mode({RIGHTSIZE: "initial"}, {}) == "initial"
    assert mode({}, {}) == "off"
    annotations = {ORIGINAL_ANNOTATION: '{"gpu":{"compute":"25","memory":"10Gi"}}'}
    # The format of a share sized in place (and of every claim sized before kinds changed).
    assert original_size(annotations, "gpu", Size("mps", 2560, 9), H100) == SHARE
    assert original_size(annotations, "other", Size("mps", 2560, 9), H100) is None
    assert original_size({ORIGINAL_ANNOTATION: "not json"}, "gpu", SHARE, H100) is None
    assert original_size({}, "gpu", SHARE, H100) is None
    unknown_class = {ORIGINAL_ANNOTATION: '{"gpu":{"deviceClassName":"other.example.com"}}'}
    assert original_size(unknown_class, "gpu", SHARE, H100) is None


def kind_claim(device_class: str, selectors: list[dict[str, Any]] | None = None, **exactly: Any) -> dict[str, Any]:
    """A claim of the template `t` asking for another kind than a share."""
    obj = claim(deviceClassName=device_class, **exactly)
    request = obj["spec"]["devices"]["requests"][0]["exactly"]
    del request["capacity"]
    if selectors is not None:
        request["selectors"] = selectors
    return obj


def pin(attribute: str, value: str) -> dict[str, Any]:
    return {"cel": {"expression": f'device.attributes["gpu.fgpu.dev"].{attribute} == "{value}"'}}


def test_a_whole_gpu_moves_to_a_mig_partition_the_original_request_kept_and_read_back() -> None:
    asked = [pin("productName", H100)]
    response = review(kind_claim(WHOLE, asked), Api([history(size=Size("whole"))]))
    ops = patched(response)
    base = "/spec/devices/requests/0/exactly"
    assert ops[:2] == [
        {"op": "replace", "path": f"{base}/deviceClassName", "value": "mig.gpu.fgpu.dev"},
        {"op": "add", "path": f"{base}/selectors", "value": [pin("profile", "1g.10gb")]},
    ]
    original = ops[2]["value"]
    assert json.loads(original) == {"gpu": {"deviceClassName": WHOLE, "selectors": asked}}
    # The node plugin restores this after an out-of-memory: the whole GPU, not a partition's size.
    annotations = {ORIGINAL_ANNOTATION: original}
    assert original_size(annotations, "gpu", Size("mig", profile="1g.10gb"), H100) == Size("whole")
    sized, quota = response["warnings"]
    assert "request gpu sized whole -> mig 1g.10gb" in sized
    assert "moves to Kueue quota gpu.fgpu.dev/mig-slices (1) from gpu.fgpu.dev/gpus (1)" in quota


def test_a_whole_gpu_without_mig_moves_to_an_mps_share_pinned_to_its_product() -> None:
    l4 = "NVIDIA L4"
    devices = [{"name": "gpu-0-mps", "attributes": {"type": {"string": "mps"}, "productName": {"string": l4}}}]
    response = review(kind_claim(WHOLE), Api([history(size=Size("whole"), gpu=l4)], devices=devices))
    base = "/spec/devices/requests/0/exactly"
    assert patched(response)[:3] == [
        {"op": "replace", "path": f"{base}/deviceClassName", "value": "mps.gpu.fgpu.dev"},
        {"op": "add", "path": f"{base}/selectors", "value": [pin("productName", l4)]},
        {"op": "add", "path": f"{base}/capacity", "value": {"requests": {"memory": "2560Mi", "compute": "9"}}},
    ]
    assert (
        "moves to Kueue quota gpu.fgpu.dev/share-memory (2560Mi) from gpu.fgpu.dev/gpus (1)" in response["warnings"][1]
    )


def test_a_mig_partition_shrinks_to_a_smaller_profile() -> None:
    two_g = Size("mig", profile="2g.20gb")
    response = review(kind_claim("mig.gpu.fgpu.dev", [pin("profile", "2g.20gb")]), Api([history(size=two_g)]))
    ops = patched(response)
    assert ops[0] == {"op": "add", "path": "/spec/devices/requests/0/exactly/selectors",
                      "value": [pin("profile", "1g.10gb")]}  # fmt: skip
    assert original_size({ORIGINAL_ANNOTATION: ops[1]["value"]}, "gpu", Size("mig", profile="1g.10gb"), H100) == two_g
    assert "now counts 1 of Kueue quota gpu.fgpu.dev/mig-slices, not 2" in response["warnings"][1]


@pytest.mark.parametrize(
    ("devices", "changes", "why"),
    [
        ([device("gpu"), device("mps"), device("mig", "3g.40gb")], {}, "no node publishes mig 1g.10gb of " + H100),
        (EVERYTHING, {"count": 2}, "it asks for more than one device"),
        (EVERYTHING, {"allocationMode": "All"}, "it asks for more than one device"),
        (EVERYTHING, {"adminAccess": True}, "it asks for admin access"),
    ],
    ids=["not-offered", "count-2", "all", "admin-access"],
)
def test_a_move_to_a_kind_not_offered_or_not_plainly_safe_is_skipped(caplog, devices, changes, why) -> None:
    caplog.set_level(logging.INFO, "fgpu.webhook")
    api = Api([history(size=Size("whole"))], devices=devices)
    assert review(kind_claim(WHOLE, **changes), api) == {"uid": "r1", "allowed": True}
    assert f"recommended mig 1g.10gb, not made: {why}" in caplog.text


def test_a_move_is_skipped_where_a_constraint_names_the_request_or_the_offers_cannot_be_read(caplog) -> None:
    caplog.set_level(logging.INFO, "fgpu.webhook")
    constrained = kind_claim(WHOLE)
    constrained["spec"]["devices"]["constraints"] = [{"matchAttribute": "gpu.fgpu.dev/uuid"}]
    assert "patch" not in review(constrained, Api([history(size=Size("whole"))]))
    assert "not made: a constraint of the claim applies to it" in caplog.text
    assert "patch" not in review(kind_claim(WHOLE), SlicesUnreadable([history(size=Size("whole"))]))
    assert "the offers are not known (ResourceSlices of gpu.fgpu.dev not read: refused)" in caplog.text
    assert patched(review(claim(), SlicesUnreadable([history()])))  # a share is still sized in place


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ('device.attributes["gpu.fgpu.dev"].architecture == "Hopper"', "attributes.architecture"),
        ('device.driver == "gpu.fgpu.dev"', "driver"),
        ('device.attributes["gpu.fgpu.dev"]["productName"] == "x"', "attributes"),
    ],
    ids=["an-attribute", "the-driver", "read-whole"],
)
def test_a_move_that_would_drop_what_the_selectors_ask_is_skipped(caplog, expression: str, why: str) -> None:
    caplog.set_level(logging.INFO, "fgpu.webhook")
    asked = [pin("productName", H100), {"cel": {"expression": expression}}]
    assert "patch" not in review(kind_claim(WHOLE, asked), Api([history(size=Size("whole"))]))
    assert f"its selectors ask for {why}, which the new size's selector would drop" in caplog.text


def test_a_move_drops_the_product_and_the_sizes_the_selectors_ask() -> None:
    """examples/whole-gpu.yaml: an H100 with at least 64Gi; the product is pinned again, the size
    is what sizing replaces."""
    expression = (
        'device.attributes["gpu.fgpu.dev"].productName.startsWith("NVIDIA H100") && '
        'device.capacity["gpu.fgpu.dev"].memory.compareTo(quantity("64Gi")) >= 0'
    )
    ops = patched(review(kind_claim(WHOLE, [{"cel": {"expression": expression}}]), Api([history(size=Size("whole"))])))
    assert ops[1]["value"] == [pin("profile", "1g.10gb")]


class SlicesUnreadable(Api):
    def list_driver_slices(self, driver: str) -> list[dict[str, Any]]:
        raise KubeUnavailableError("refused")
