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

from driver.admission.mutate import MAX_CLAIMS_READ, PodRules, gate_patch, mutate, review_result
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


def template(labels: dict[str, str], device_class: str = "") -> dict[str, Any]:
    claim_spec = {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": device_class}}]}}
    return {"metadata": {"name": "t"}, "spec": {"metadata": {"labels": labels}, "spec": claim_spec}}


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


def patched(obj: dict[str, Any], reader: Reader, rules: PodRules = PodRules()) -> dict[str, Any] | None:
    """The pod as kube-apiserver stores it after the answer; None when no patch came."""
    response = mutate(admission(obj), reader, rules)["response"]
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
    assert "admitted unchanged: cannot read its claims: connection refused" in caplog.text


def test_only_pod_creates_are_gated_and_a_bad_review_is_an_error() -> None:
    reader = Reader(claims={"c": labelled(OPT_IN)})
    answer = mutate(admission(pod({"name": "gpu", "resourceClaimName": "c"}), operation="UPDATE"), reader)
    assert answer["response"] == {"uid": "u-1", "allowed": True}
    assert patched(pod(), reader) is None  # no claims at all (the chart's matchConditions send none)
    with pytest.raises(ReviewError):
        mutate({"apiVersion": "admission.k8s.io/v1beta1", "request": {"uid": "x"}}, reader)


KEY = "gpu.fgpu.dev/gpu-pods-only"
TOLERATION = {"key": KEY, "operator": "Exists", "effect": "NoSchedule"}
TOLERATING = PodRules(gate=False, gpu_pods_toleration=KEY)


def claim_of(device_class: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    request = {"name": "r", "exactly": {"deviceClassName": device_class}}
    return {"metadata": {"name": "c", "labels": labels or {}}, "spec": {"devices": {"requests": [request]}}}


def test_a_pod_whose_template_asks_for_our_devices_tolerates_the_nodes_kept_for_gpu_pods(caplog) -> None:
    caplog.set_level(logging.INFO, "fgpu.webhook")
    reader = Reader(templates={"t": template({}, "mps.gpu.fgpu.dev")})
    after = patched(pod({"name": "gpu", "resourceClaimTemplateName": "t"}), reader, TOLERATING)
    assert after is not None and after["spec"]["tolerations"] == [TOLERATION]
    assert "schedulingGates" not in after["spec"]  # the gate is --gate-pods' alone
    assert (
        f"pod team/job-* tolerates the taint {KEY}: ResourceClaimTemplate team/t asks for gpu.fgpu.dev's" in caplog.text
    )


def test_claims_of_other_drivers_missing_or_unreadable_give_no_toleration() -> None:
    nic = Reader(claims={"c": claim_of("nic.example.com")})
    assert patched(pod({"name": "n", "resourceClaimName": "c"}), nic, TOLERATING) is None
    assert patched(pod({"name": "n", "resourceClaimName": "c"}), Reader(), TOLERATING) is None
    down = Reader(error=KubeUnavailableError("connection refused"))
    assert patched(pod({"name": "n", "resourceClaimName": "c"}), down, TOLERATING) is None


def test_one_read_of_each_claim_gates_and_tolerates_together() -> None:
    reader = Reader(claims={"nic": claim_of("nic.example.com"), "gpu": claim_of("gpu.fgpu.dev", OPT_IN)})
    refs = [{"name": n, "resourceClaimName": n} for n in ("nic", "gpu", "nic", "more")]
    after = patched(pod(*refs), reader, PodRules(gpu_pods_toleration=KEY))
    assert after is not None and after["spec"]["schedulingGates"] == [GATE]
    assert after["spec"]["tolerations"] == [TOLERATION]
    assert reader.reads == ["claim team/nic", "claim team/gpu"]  # both answered: the rest not read


def test_a_pod_that_tolerates_already_and_is_gated_is_not_read() -> None:
    reader = Reader(claims={"c": claim_of("gpu.fgpu.dev", OPT_IN)})
    ready = pod({"name": "gpu", "resourceClaimName": "c"}, gates=[GATE])
    ready["spec"]["tolerations"] = [{"key": KEY, "operator": "Exists"}]
    assert patched(ready, reader, PodRules(gpu_pods_toleration=KEY)) is None
    assert reader.reads == []
    # Gated by its author, not tolerating yet: read for the toleration alone.
    del ready["spec"]["tolerations"]
    after = patched(ready, reader, PodRules(gpu_pods_toleration=KEY))
    assert (
        after is not None
        and after["spec"]["schedulingGates"] == [GATE]
        and after["spec"]["tolerations"] == [TOLERATION]
    )


def test_no_more_than_the_bound_of_claims_is_read_for_a_pod() -> None:
    reader = Reader()
    refs = [{"name": f"c{i}", "resourceClaimName": f"c{i}"} for i in range(MAX_CLAIMS_READ + 50)]
    assert patched(pod(*refs), reader, PodRules(gpu_pods_toleration=KEY)) is None
    assert len(reader.reads) == MAX_CLAIMS_READ


def test_the_metrics_result_says_what_the_patch_added() -> None:
    reader = Reader(claims={"c": claim_of("gpu.fgpu.dev", OPT_IN)})
    claim_pod = admission(pod({"name": "gpu", "resourceClaimName": "c"}))
    assert review_result(mutate(claim_pod, reader, TOLERATING)) == "tolerated"
    assert review_result(mutate(claim_pod, reader, PodRules(gpu_pods_toleration=KEY))) == "gated"
    assert review_result(mutate(claim_pod, reader, PodRules(gate=False))) == "allowed"
