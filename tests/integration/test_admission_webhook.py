"""`fgpu webhook` as a process behind the real kube-apiserver, configured by the chart's own
ValidatingWebhookConfiguration (its rules and matchConditions; only the address is the test's: a
URL on this host instead of the in-cluster Service, which tests/e2e/test_install.py uses).
A bad gpu.fgpu.dev config is refused at create with its field named; good ones, other drivers'
and updates of claims pass; with the webhook down, failurePolicy Ignore admits and Fail refuses
only objects that carry a gpu.fgpu.dev config."""

from __future__ import annotations

import base64
import json
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client import AdmissionregistrationV1Api, ApiException, ResourceV1Api

from testbed.cluster.harness import Cluster, free_port
from testbed.workloads import unique
from tests.support import ROOT
from tests.support.chart import find, render

pytestmark = pytest.mark.cluster

DRIVER = "gpu.fgpu.dev"
NS = "default"
SHARE = {"apiVersion": "gpu.fgpu.dev/v1alpha1", "kind": "ShareConfig", "sharing": {"strategy": "MPS"}}
BAD_SHARE = {**SHARE, "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 150}}}
MERGE_PATCH = "application/merge-patch+json"
BAD_FIELD = "spec.devices.config[0].opaque.parameters: opaque config: sharing.mps.activeThreadPercentage must be 1..100"


@dataclass
class Webhook:
    cluster: Cluster
    process: subprocess.Popen[bytes]
    port: int
    config_name: str

    def set_failure_policy(self, policy: str) -> None:
        admission = AdmissionregistrationV1Api(self.cluster.api_client())
        config = admission.read_validating_webhook_configuration(self.config_name)
        for webhook in config.webhooks:
            webhook.failure_policy = policy
        admission.replace_validating_webhook_configuration(self.config_name, config)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def claim_with(*parameters: Any, driver: str = DRIVER) -> dict[str, Any]:
    request = {"name": "gpu", "exactly": {"deviceClassName": "mps.gpu.fgpu.dev"}}
    configs = [{"requests": ["gpu"], "opaque": {"driver": driver, "parameters": p}} for p in parameters]
    return {"metadata": {"name": unique("claim")}, "spec": {"devices": {"requests": [request], "config": configs}}}


def refusal(create: Callable[[], Any]) -> str:
    """The apiserver's message when `create` is refused; fails the test when it is admitted."""
    with pytest.raises(ApiException) as refused:
        create()
    return json.loads(refused.value.body)["message"]


def serve(cluster: Cluster, port: int) -> subprocess.Popen[bytes]:
    assert cluster.pki is not None
    cluster.pki.sign_server("webhook", "fgpu-webhook", "IP:127.0.0.1")
    command = [sys.executable, "-m", "driver.cli", "webhook", "--bind-address=127.0.0.1", f"--port={port}",
               f"--tls-cert-file={cluster.pki.path('webhook.crt')}",
               f"--tls-private-key-file={cluster.pki.path('webhook.key')}"]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT)
    context = ssl.create_default_context(cafile=cluster.pki.path("ca.crt"))
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", context=context, timeout=2) as answer:
                assert answer.read() == b"ok\n"
                return process
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise AssertionError(f"fgpu webhook did not serve (exit {process.poll()})") from None
            time.sleep(0.2)


def chart_configuration(cluster: Cluster, port: int, name: str) -> dict[str, Any]:
    """The chart's ValidatingWebhookConfiguration, pointed at this host's webhook."""
    assert cluster.pki is not None
    config = find(render(), "ValidatingWebhookConfiguration")
    config["metadata"] = {"name": name}
    ca_bundle = base64.b64encode(Path(cluster.pki.path("ca.crt")).read_bytes()).decode()
    for webhook in config["webhooks"]:
        webhook["clientConfig"] = {"url": f"https://127.0.0.1:{port}/validate", "caBundle": ca_bundle}
    return config


@pytest.fixture(scope="module")
def webhook(cluster: Cluster) -> Iterator[Webhook]:
    port = free_port()
    process = serve(cluster, port)
    admission = AdmissionregistrationV1Api(cluster.api_client())
    name = unique("fgpu-webhook-test")
    try:
        admission.create_validating_webhook_configuration(chart_configuration(cluster, port, name))
        resource = ResourceV1Api(cluster.api_client())
        # The apiserver picks the configuration up from its informer: until then a bad claim passes.
        deadline = time.monotonic() + 30
        while True:
            bad = claim_with(BAD_SHARE)
            try:
                resource.create_namespaced_resource_claim(NS, bad)
            except ApiException as err:
                assert err.status == 422, err.body
                break
            resource.delete_namespaced_resource_claim(bad["metadata"]["name"], NS)
            assert time.monotonic() < deadline, "the webhook configuration never took effect"
            time.sleep(0.3)
        yield Webhook(cluster, process, port, name)
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=10)
        admission.delete_validating_webhook_configuration(name)


def test_a_bad_claim_is_refused_with_its_field_named_and_nothing_is_created(webhook, resource_api) -> None:
    claim = claim_with(SHARE, BAD_SHARE)
    message = refusal(lambda: resource_api.create_namespaced_resource_claim(NS, claim))
    assert message.startswith('admission webhook "resourceclaims.gpu.fgpu.dev" denied the request: ResourceClaim')
    assert BAD_FIELD.replace("config[0]", "config[1]") in message and "config[0]" not in message
    with pytest.raises(ApiException) as missing:
        resource_api.read_namespaced_resource_claim(claim["metadata"]["name"], NS)
    assert missing.value.status == 404


def test_good_claims_other_drivers_configs_and_claim_updates_pass(webhook, resource_api) -> None:
    good = claim_with(SHARE)
    theirs = claim_with({"anything": "goes"}, driver="gpu.nvidia.com")
    for claim in (good, theirs):
        resource_api.create_namespaced_resource_claim(NS, claim)
    # A claim's spec cannot change; its metadata can (finalizers), and is never held up by the webhook.
    # By PUT, as kube-scheduler and the controller write: kube-apiserver 1.37 refuses a merge patch
    # of a claim with an opaque config ("spec: field is immutable"), webhook or not.
    stored = resource_api.read_namespaced_resource_claim(good["metadata"]["name"], NS)
    stored.metadata.labels = {"fgpu.test/updated": "yes"}
    resource_api.replace_namespaced_resource_claim(good["metadata"]["name"], NS, stored)
    for claim in (good, theirs):
        resource_api.delete_namespaced_resource_claim(claim["metadata"]["name"], NS)


def test_templates_and_device_classes_are_checked(webhook, resource_api) -> None:
    template = {"metadata": {"name": unique("template")}, "spec": {"spec": claim_with(BAD_SHARE)["spec"]}}
    message = refusal(lambda: resource_api.create_namespaced_resource_claim_template(NS, template))
    assert "ResourceClaimTemplate" in message and BAD_FIELD.replace("spec.devices", "spec.spec.devices") in message

    name = unique("fgpu-test-class")
    selector = {"cel": {"expression": f'device.driver == "{DRIVER}"'}}
    config = {"opaque": {"driver": DRIVER, "parameters": SHARE}}
    device_class = {"metadata": {"name": name}, "spec": {"selectors": [selector], "config": [config]}}
    resource_api.create_device_class(device_class)
    try:
        bad = {"spec": {"config": [{"opaque": {"driver": DRIVER, "parameters": BAD_SHARE}}]}}
        message = refusal(lambda: resource_api.patch_device_class(name, bad, _content_type=MERGE_PATCH))
        assert f"DeviceClass {name}: spec.config[0].opaque.parameters" in message
        labels = {"metadata": {"labels": {"fgpu.test/updated": "yes"}}}
        resource_api.patch_device_class(name, labels, _content_type=MERGE_PATCH)
    finally:
        resource_api.delete_device_class(name)


def test_an_outage_admits_with_ignore_and_with_fail_refuses_only_our_configs(webhook, resource_api) -> None:
    webhook.stop()
    admitted = claim_with(BAD_SHARE)  # Ignore (the chart's default): prepare refuses it later
    resource_api.create_namespaced_resource_claim(NS, admitted)
    resource_api.delete_namespaced_resource_claim(admitted["metadata"]["name"], NS)

    webhook.set_failure_policy("Fail")
    deadline = time.monotonic() + 30
    while True:  # the apiserver's informer takes the change up
        good = claim_with(SHARE)
        try:
            resource_api.create_namespaced_resource_claim(NS, good)
        except ApiException as err:
            assert 'failed calling webhook "resourceclaims.gpu.fgpu.dev"' in json.loads(err.body)["message"]
            break
        resource_api.delete_namespaced_resource_claim(good["metadata"]["name"], NS)
        assert time.monotonic() < deadline, "failurePolicy Fail never took effect"
        time.sleep(0.3)
    unconfigured = claim_with()  # no gpu.fgpu.dev config: not sent to the webhook at all
    resource_api.create_namespaced_resource_claim(NS, unconfigured)
    resource_api.delete_namespaced_resource_claim(unconfigured["metadata"]["name"], NS)
