"""How claims and pods ask for the controller (driver/scheduling/opt_in.py): the claims a pod
uses, gang labels and opt-in."""

from __future__ import annotations

from driver.allocator.model import claim_from_object
from driver.scheduling.opt_in import gang_of, known_claim_names, pending, pod_claim_names


def test_pod_claims_from_names_and_templates():
    pod = {
        "spec": {
            "resourceClaims": [
                {"name": "a", "resourceClaimName": "shared"},
                {"name": "b", "resourceClaimTemplateName": "t"},
            ]
        },
        "status": {},
    }
    assert pod_claim_names(pod) is None  # the template's claim is not made yet
    assert known_claim_names(pod) == ["shared"]
    pod["status"]["resourceClaimStatuses"] = [{"name": "b", "resourceClaimName": "pod-b-x1"}]
    assert pod_claim_names(pod) == known_claim_names(pod) == ["shared", "pod-b-x1"]


def test_gang_labels_and_opt_in():
    labels = {"gpu.fgpu.dev/allocator": "fgpu", "gpu.fgpu.dev/gang": "train", "gpu.fgpu.dev/gang-size": "4"}
    obj = {"metadata": {"name": "c", "namespace": "ns", "labels": labels}, "spec": {"devices": {"requests": []}}}
    assert pending(obj) and gang_of(claim_from_object(obj)) == ("ns/train", 4)
    obj["metadata"]["labels"] = {**labels, "gpu.fgpu.dev/gang-size": "four"}
    assert gang_of(claim_from_object(obj)) == ("ns/train", 0)
    assert not pending({**obj, "status": {"allocation": {"devices": {}}}})
    assert not pending({"metadata": {"labels": {}}})
