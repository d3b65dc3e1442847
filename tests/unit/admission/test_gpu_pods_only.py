"""Nodes kept for pods with GPUs (driver/admission/gpu_pods_only.py): which claims ask for fgpu's
devices (driver/claims/classes.py), when a pod tolerates the taint already, the patch, and the
flag's key checked as kube-apiserver checks a taint's. Through POST /mutate:
test_admission_mutate.py; on the real apiserver: tests/integration/test_admission_webhook.py."""

from __future__ import annotations

from typing import Any

import pytest

from driver.admission.gpu_pods_only import taint_key, tolerates, toleration_patch
from driver.claims.classes import MAX_REQUESTS, asks_for_ours, ours, requested_classes

DRIVER = "gpu.fgpu.dev"
KEY = "gpu.fgpu.dev/gpu-pods-only"


def spec(*requests: Any) -> dict[str, Any]:
    return {"devices": {"requests": list(requests)}}


def exactly(class_name: Any) -> dict[str, Any]:
    return {"name": "r", "exactly": {"deviceClassName": class_name}}


def test_fgpus_classes_are_known_by_name_and_others_are_not() -> None:
    assert all(ours(n, DRIVER) for n in ("gpu.fgpu.dev", "mps.gpu.fgpu.dev", "mig-1g.10gb.gpu.fgpu.dev"))
    assert not any(ours(n, DRIVER) for n in ("gpu.nvidia.com", "xgpu.fgpu.dev", "gpu.fgpu.dev.evil.io", ""))


def test_a_claim_asks_for_fgpus_devices_through_exactly_or_any_alternative() -> None:
    alternatives = [
        {"name": "a", "deviceClassName": "nic.example.com"},
        {"name": "b", "deviceClassName": "mps.gpu.fgpu.dev"},
    ]
    first_available = {"name": "r", "firstAvailable": alternatives}
    both = spec(exactly("nic.example.com"), first_available)
    assert requested_classes(both) == ["nic.example.com", "nic.example.com", "mps.gpu.fgpu.dev"]
    assert asks_for_ours(spec(first_available), DRIVER)
    assert asks_for_ours(spec(exactly("nic.example.com"), exactly("gpu.fgpu.dev")), DRIVER)
    assert not asks_for_ours(spec(exactly("nic.example.com")), DRIVER)


@pytest.mark.parametrize(
    "claim_spec",
    [None, "x", {}, {"devices": "x"}, {"devices": {"requests": {"a": 1}}}, spec("x", {"exactly": "x"}),
     spec({"exactly": {"deviceClassName": 7}}), spec({"firstAvailable": [None, {"deviceClassName": None}]})],
)  # fmt: skip
def test_a_malformed_spec_asks_for_nothing(claim_spec: Any) -> None:
    assert requested_classes(claim_spec) == []
    assert not asks_for_ours(claim_spec, DRIVER)


def test_requests_past_the_apis_limit_are_not_read() -> None:
    many = [exactly("nic.example.com")] * MAX_REQUESTS + [exactly("gpu.fgpu.dev")]
    assert not asks_for_ours(spec(*many), DRIVER)
    assert asks_for_ours(spec(*many[1:]), DRIVER)


def pod(*tolerations: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"spec": {"containers": [{"name": "c"}]}}
    if tolerations:
        body["spec"]["tolerations"] = list(tolerations)
    return body


@pytest.mark.parametrize(
    "toleration",
    [
        {"key": KEY, "operator": "Exists", "effect": "NoSchedule"},
        {"key": KEY, "operator": "Exists"},  # any effect
        {"operator": "Exists"},  # every taint
    ],
)
def test_a_pod_that_tolerates_every_value_of_the_taint_gets_nothing(toleration: dict[str, str]) -> None:
    assert tolerates(pod(toleration), KEY)
    assert toleration_patch(pod(toleration), KEY) == []


@pytest.mark.parametrize(
    "toleration",
    [
        {"key": KEY, "operator": "Equal", "value": "true", "effect": "NoSchedule"},  # one value only
        {"key": KEY, "value": "true"},  # Equal by default
        {"key": KEY, "operator": "Exists", "effect": "NoExecute"},
        {"key": "other.io/taint", "operator": "Exists"},
        "not a toleration",
    ],
)
def test_a_pod_that_may_not_tolerate_the_taint_gets_the_toleration_after_its_own(toleration: Any) -> None:
    assert not tolerates(pod(toleration), KEY)
    added = {"key": KEY, "operator": "Exists", "effect": "NoSchedule"}
    assert toleration_patch(pod(toleration), KEY) == [{"op": "add", "path": "/spec/tolerations/-", "value": added}]
    assert toleration_patch(pod(), KEY) == [{"op": "add", "path": "/spec/tolerations", "value": [added]}]


@pytest.mark.parametrize("key", ["gpu-pods-only", KEY, "a.b-c.example/x_y.Z", "a" * 63, "p/" + "a" * 63])
def test_a_taint_key_as_kube_apiserver_takes_it(key: str) -> None:
    assert taint_key(key) == key


@pytest.mark.parametrize("key", ["", "a/b/c", "/x", "x/", "Upper.io/x", "-x", "x-", "a" * 64, "a b", "a/" + "b" * 64,
                                 ("a" * 64) + ".io/x", ".".join(["a" * 60] * 5) + "/x"])  # fmt: skip
def test_a_key_kube_apiserver_would_refuse_in_every_pod_is_refused_at_start(key: str) -> None:
    with pytest.raises(ValueError, match=r"^--gpu-pods-toleration .*: not a taint key"):
        taint_key(key)
