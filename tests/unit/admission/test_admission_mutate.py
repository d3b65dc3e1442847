"""Pod gating at create (driver/admission/mutate.py): a pod of an opt-in claim, named or from a
template, gets fgpu's scheduling gate as a JSON patch; any other pod, a missing claim or template,
and an API server that cannot be read: admitted unchanged, never refused. On the real apiserver:
tests/integration/test_admission_webhook.py."""

from __future__ import annotations

import base64
import json
import logging
from typing import Any

import pytest

from driver.admission.mutate import gate_patch, mutate
from driver.admission.review import ReviewError
from driver.kube.errors import KubeUnavailableError
from driver.scheduling.opt_in import OPT_IN_LABEL, OPT_IN_VALUE, SCHEDULING_GATE

OPT_IN = {OPT_IN_LABEL: OPT_IN_VALUE}
GATE = {"name": SCHEDULING_GATE}


class Reader:
    def __init__(self, claims: dict[str, Any] | None = None, templates: dict[str, Any] | None = None,
                 error: Exception | None = None) -> None:  # fmt: skip
        self.claims, self.templates, self.error = claims or {}, templates or {}, error
        self.reads: list[str] = []

    def read_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads.append(f"claim {namespace}/{name}")
        if self.error:
            raise self.error
        return self.claims.get(name)

    def read_claim_template(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads.append(f"template {namespace}/{name}")
        if self.error:
            raise self.error
        return self.templates.get(name)


def labelled(labels: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": "c", "labels": labels}, "spec": {}}


def template(labels: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": "t"}, "spec": {"metadata": {"labels": labels}, "spec": {}}}


def pod(*refs: dict[str, str], gates: list[dict[str, str]] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "c", "image": "x"}], "resourceClaims": list(refs)}
    if gates is not None:
        spec["schedulingGates"] = gates
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "job-"}, "spec": spec}


def admission(obj: dict[str, Any], operation: str = "CREATE") -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u-1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "operation": operation,
            "namespace": "team",
            "object": obj,
        },
    }


def apply_adds(obj: dict[str, Any], patch: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 "add" (the only op the webhook sends), on a copy."""
    obj = json.loads(json.dumps(obj))
    for op in patch:
        assert op["op"] == "add"
        *parents, last = op["path"].lstrip("/").split("/")
        target: Any = obj
        for key in parents:
            target = target[key]
        if last == "-":
            target.append(op["value"])
        else:
            assert last not in target  # "add" of a member replaces: the webhook never overwrites a list
            target[last] = op["value"]
    return obj


def patched(obj: dict[str, Any], reader: Reader) -> dict[str, Any] | None:
    """The pod as kube-apiserver stores it after the answer; None when no patch came."""
    response = mutate(admission(obj), reader)["response"]
    assert response["allowed"] is True and response["uid"] == "u-1" and "status" not in response
    if "patch" not in response:
        return None
    assert response["patchType"] == "JSONPatch"
    return apply_adds(obj, json.loads(base64.b64decode(response["patch"])))


def test_a_pod_of_an_opt_in_template_is_gated_from_the_template_s_claim_labels() -> None:
    reader = Reader(templates={"t": template(OPT_IN)})
    after = patched(pod({"name": "gpu", "resourceClaimTemplateName": "t"}), reader)
    assert after is not None and after["spec"]["schedulingGates"] == [GATE]
    assert reader.reads == ["template team/t"]  # the request's namespace: a pod's may be empty at create


def test_a_pod_naming_an_opt_in_claim_is_gated_after_its_own_gates() -> None:
    reader = Reader(claims={"shared": labelled(OPT_IN)})
    after = patched(pod({"name": "gpu", "resourceClaimName": "shared"}, gates=[{"name": "other.io/wait"}]), reader)
    assert after is not None and after["spec"]["schedulingGates"] == [{"name": "other.io/wait"}, GATE]


def test_one_opt_in_claim_among_others_gates_the_pod() -> None:
    reader = Reader(claims={"plain": labelled({})}, templates={"t": template(OPT_IN)})
    refs = ({"name": "a", "resourceClaimName": "plain"}, {"name": "b", "resourceClaimTemplateName": "t"})
    after = patched(pod(*refs), reader)
    assert after is not None and after["spec"]["schedulingGates"] == [GATE]


@pytest.mark.parametrize(
    "reader",
    [
        Reader(templates={"t": template({OPT_IN_LABEL: "kube-scheduler"})}),  # another value
        Reader(templates={"t": {"metadata": {"labels": OPT_IN}, "spec": {"spec": {}}}}),  # on the template only
        Reader(),  # not found: created later, or never
    ],
    ids=["other-value", "label-on-template-itself", "not-found"],
)
def test_a_pod_without_an_opt_in_claim_is_admitted_unchanged(reader: Reader, caplog) -> None:
    caplog.set_level(logging.INFO, "fgpu.webhook")
    assert patched(pod({"name": "gpu", "resourceClaimTemplateName": "t"}), reader) is None
    assert "pod team/job-* not gated: ResourceClaimTemplate team/t not" in caplog.text


def test_a_pod_that_has_the_gate_already_is_left_alone() -> None:
    reader = Reader(claims={"c": labelled(OPT_IN)})
    assert patched(pod({"name": "gpu", "resourceClaimName": "c"}, gates=[GATE]), reader) is None
    assert reader.reads == []
    assert gate_patch(pod(gates=[GATE])) == []


def test_an_api_server_that_cannot_be_read_admits_without_the_gate(caplog) -> None:
    reader = Reader(error=KubeUnavailableError("connection refused"))
    assert patched(pod({"name": "gpu", "resourceClaimName": "c"}), reader) is None
    assert "admitted without the scheduling gate: cannot read its claims: connection refused" in caplog.text


def test_only_pod_creates_are_gated_and_a_bad_review_is_an_error() -> None:
    reader = Reader(claims={"c": labelled(OPT_IN)})
    answer = mutate(admission(pod({"name": "gpu", "resourceClaimName": "c"}), operation="UPDATE"), reader)
    assert answer["response"] == {"uid": "u-1", "allowed": True}
    assert patched(pod(), reader) is None  # no claims at all (the chart's matchConditions send none)
    with pytest.raises(ReviewError):
        mutate({"apiVersion": "admission.k8s.io/v1beta1", "request": {"uid": "x"}}, reader)
