"""The admission review of opaque configs (driver/admission/review.py): prepare's rules, each bad
field named, other drivers' configs left alone. On the real apiserver: tests/integration/test_admission_webhook.py."""

from __future__ import annotations

from typing import Any

import pytest

from driver.admission.review import ReviewError, config_errors, review

DRIVER = "gpu.fgpu.dev"
GOOD = {"apiVersion": "gpu.fgpu.dev/v1alpha1", "kind": "ShareConfig", "sharing": {"strategy": "MPS"}}
MPS_150 = {**GOOD, "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 150}}}


def opaque(parameters: Any, driver: str = DRIVER, **extra: Any) -> dict[str, Any]:
    return {"opaque": {"driver": driver, "parameters": parameters}, **extra}


def claim(*configs: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "c"}, "spec": {"devices": {"requests": [], "config": list(configs)}}}


def admission(kind: str, obj: dict[str, Any], uid: str = "u-1") -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": uid, "kind": {"group": "resource.k8s.io", "version": "v1", "kind": kind}, "object": obj},
    }


def test_a_good_config_is_allowed() -> None:
    answer = review(admission("ResourceClaim", claim(opaque(GOOD))), DRIVER)
    assert answer["response"] == {"uid": "u-1", "allowed": True}
    assert (answer["apiVersion"], answer["kind"]) == ("admission.k8s.io/v1", "AdmissionReview")


def test_a_bad_config_is_denied_with_its_field_named() -> None:
    answer = review(admission("ResourceClaim", claim(opaque(GOOD), opaque(MPS_150))), DRIVER)
    response = answer["response"]
    assert response["allowed"] is False and response["status"]["code"] == 422
    assert response["status"]["message"] == (
        "ResourceClaim c: spec.devices.config[1].opaque.parameters: "
        "opaque config: sharing.mps.activeThreadPercentage must be 1..100, got 150"
    )


@pytest.mark.parametrize(
    ("parameters", "error"),
    [
        ({**GOOD, "apiVersion": "v2"}, "apiVersion must be gpu.fgpu.dev/v1alpha1, got 'v2'"),
        ({**GOOD, "kind": "Gpu"}, "kind must be one of GpuConfig, ShareConfig, MigDeviceConfig, got 'Gpu'"),
        ({**GOOD, "extra": 1}, "unknown field config.extra"),
        ({**GOOD, "sharing": {"strategy": "Shared"}}, "sharing.strategy must be MPS or TimeSlicing, got 'Shared'"),
        ({**GOOD, "sharing": {"strategy": "MPS", "mps": {"pinnedMemoryLimit": "lots"}}}, "pinnedMemoryLimit"),
        (
            {**GOOD, "sharing": {"strategy": "MPS", "mps": {"pinnedMemoryLimit": "1e999999999"}}},
            "sharing.mps.pinnedMemoryLimit: invalid quantity '1e999999999': exponent out of range",
        ),
        (
            {**GOOD, "sharing": {"strategy": "MPS", "mps": {"pinnedMemoryLimit": "512Ki"}}},
            "sharing.mps.pinnedMemoryLimit must be at least 1Mi",
        ),
        (
            {**GOOD, "sharing": {"strategy": "MPS", "mps": {"pinnedMemoryLimit": True}}},
            "sharing.mps.pinnedMemoryLimit must be a quantity, got True",
        ),
        (
            {**GOOD, "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": True}}},
            "sharing.mps.activeThreadPercentage must be 1..100, got True",
        ),
        ({**GOOD, "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Eternal"}}}, "interval"),
        ({**GOOD, "kind": "MigDeviceConfig"}, "field sharing is not valid for MigDeviceConfig"),
        ("a string", "config must be an object"),
        (None, "config must be an object"),
    ],
)
def test_every_rule_of_prepare_applies(parameters: Any, error: str) -> None:
    [message] = config_errors("ResourceClaim", claim(opaque(parameters)), DRIVER)
    assert message.startswith("spec.devices.config[0].opaque.parameters: opaque config: ") and error in message


def test_every_bad_config_of_an_object_is_named_in_one_line() -> None:
    message = review(admission("ResourceClaim", claim(opaque(MPS_150), opaque("x"))), DRIVER)["response"]["status"]
    assert "config[0]" in message["message"] and "config[1]" in message["message"]
    assert "\n" not in message["message"]


def test_templates_and_device_classes_are_checked_where_they_keep_configs() -> None:
    template = {"metadata": {"name": "t"}, "spec": {"spec": claim(opaque(MPS_150))["spec"]}}
    device_class = {"metadata": {"name": "k"}, "spec": {"selectors": [], "config": [opaque(MPS_150)]}}
    assert config_errors("ResourceClaimTemplate", template, DRIVER)[0].startswith("spec.spec.devices.config[0].")
    assert config_errors("DeviceClass", device_class, DRIVER)[0].startswith("spec.config[0].")
    denied = review(admission("DeviceClass", device_class), DRIVER)["response"]
    assert denied["status"]["message"].startswith("DeviceClass k: spec.config[0]")


TIMESLICE = {**GOOD, "sharing": {"strategy": "TimeSlicing"}}
LONG = {**GOOD, "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}}
CLAIM_TENANCY = {**GOOD, "sharing": {"strategy": "MPS", "tenancy": "Shared"}}


def test_a_claim_may_not_set_what_only_its_class_sets() -> None:
    # The interval is the whole GPU's and the tenancy says whom a GPU is shared with: an
    # administrator's, from the DeviceClass. Prepare refuses them too; the webhook at create.
    template = {"metadata": {"name": "t"}, "spec": {"spec": claim(opaque(TIMESLICE), opaque(LONG))["spec"]}}
    denied = review(admission("ResourceClaimTemplate", template), DRIVER)["response"]
    assert denied["status"]["message"] == (
        "ResourceClaimTemplate t: spec.spec.devices.config[1].opaque.parameters: "
        "opaque config: sharing.timeSlicing.interval is set by the device class only; remove it from the claim"
    )
    assert config_errors("ResourceClaim", claim(opaque(CLAIM_TENANCY)), DRIVER) == [
        "spec.devices.config[0].opaque.parameters: "
        "opaque config: sharing.tenancy is set by the device class only; remove it from the claim"
    ]
    # Even the class's own value: the class is not known here, and repeating it gains nothing.
    default = {**GOOD, "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Default"}}}
    assert "sharing.timeSlicing.interval" in config_errors("ResourceClaim", claim(opaque(default)), DRIVER)[0]


def test_a_class_sets_the_interval_and_a_claim_may_leave_it_unset() -> None:
    device_class = {"metadata": {"name": "k"}, "spec": {"config": [opaque(LONG), opaque(CLAIM_TENANCY)]}}
    assert review(admission("DeviceClass", device_class), DRIVER)["response"]["allowed"] is True
    empty = {**GOOD, "sharing": {"strategy": "TimeSlicing", "timeSlicing": {}}}  # changes nothing
    assert config_errors("ResourceClaim", claim(opaque(TIMESLICE), opaque(empty)), DRIVER) == []
    assert config_errors("ResourceClaim", claim(opaque(LONG, driver="gpu.nvidia.com")), DRIVER) == []


def test_other_drivers_configs_and_other_kinds_are_not_ours_to_judge() -> None:
    assert config_errors("ResourceClaim", claim(opaque("garbage", driver="gpu.nvidia.com")), DRIVER) == []
    assert config_errors("ResourceClaim", claim({"opaque": None}, {}), DRIVER) == []
    assert config_errors("ResourceClaim", {"metadata": {}, "spec": {"devices": {}}}, DRIVER) == []
    assert config_errors("Pod", claim(opaque(MPS_150)), DRIVER) == []
    # The driver name is the deployment's: another name, other configs.
    assert config_errors("ResourceClaim", claim(opaque(MPS_150)), "gpu.example.com") == []


def test_a_generated_name_is_named_when_there_is_no_name_yet() -> None:
    obj = claim(opaque(MPS_150))
    obj["metadata"] = {"generateName": "pod-gpu-"}
    assert review(admission("ResourceClaim", obj), DRIVER)["response"]["status"]["message"].startswith(
        "ResourceClaim pod-gpu-: "
    )


@pytest.mark.parametrize(
    "document",
    [
        None,
        {},
        {"apiVersion": "admission.k8s.io/v1", "request": {}},
        {"apiVersion": "admission.k8s.io/v1beta1", "request": {"uid": "u"}},
    ],
)
def test_what_is_not_an_admission_review_is_refused(document: Any) -> None:
    with pytest.raises(ReviewError):
        review(document, DRIVER)
