"""`fgpu webhook` as a process behind the real kube-apiserver, configured by the chart's own
ValidatingWebhookConfiguration (its rules and matchConditions; only the address is the test's: a
URL on this host instead of the in-cluster Service, which tests/e2e/test_install.py uses).
A bad gpu.fgpu.dev config is refused at create with its field named; good ones, other drivers'
and updates of claims pass; with the webhook down, failurePolicy Ignore admits and Fail refuses
only objects that carry a gpu.fgpu.dev config. Self-managed certificates (the chart's default):
two webhooks started at once agree on one Secret; short-lived certificates renewed under load
keep every bad claim refused, without a restart; the configuration applied again as GitOps tools
do (server-side apply keeps the caBundle, a replace wipes it and the webhook writes it again)."""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client import AdmissionregistrationV1Api, ApiException, BatchV1Api, CoreV1Api, ResourceV1Api
from kubernetes.dynamic import DynamicClient

from testbed.cluster.harness import Cluster, free_port
from testbed.workloads import unique
from tests.support import ROOT
from tests.support.chart import find, render
from tests.support.webhook import pointed_at_host, serve_webhook, wait_serving

pytestmark = pytest.mark.cluster

DRIVER = "gpu.fgpu.dev"
NS = "default"
FLIPPED = {"Fail": "Ignore", "Ignore": "Fail"}  # a failurePolicy switched, whichever the chart has
SHARE = {"apiVersion": "gpu.fgpu.dev/v1alpha1", "kind": "ShareConfig", "sharing": {"strategy": "MPS"}}
BAD_SHARE = {**SHARE, "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 150}}}
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
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


def chart_configuration(cluster: Cluster, port: int, name: str) -> dict[str, Any]:
    """The chart's ValidatingWebhookConfiguration, pointed at this host's webhook."""
    return pointed_at_host(find(render(), "ValidatingWebhookConfiguration"), cluster, port, "/validate", name)


@pytest.fixture(scope="module")
def webhook(cluster: Cluster) -> Iterator[Webhook]:
    port = free_port()
    process = serve_webhook(cluster, port, "webhook")
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
    webhook.set_failure_policy("Ignore")  # the stopped webhook refuses nothing of the tests below


# --- self-managed certificates (the chart's default) ----------------------------------------------


@dataclass
class SelfManaged:
    """`fgpu webhook --tls-secret`: its own CA and serving certificate, in a Secret of the test cluster."""

    cluster: Cluster
    secret: str
    config_name: str
    processes: list[subprocess.Popen[bytes]]
    ports: list[int]
    logs: list[Path]

    def stored(self) -> dict[str, bytes]:
        secret = CoreV1Api(self.cluster.api_client()).read_namespaced_secret(self.secret, NS)
        return {key: base64.b64decode(value) for key, value in secret.data.items()}

    def served(self, port: int) -> bytes:
        """The certificate a new connection to `port` gets (PEM), verified against the Secret's CA."""
        return served_certificate(port, self.stored()["ca.crt"])

    def ca_bundles(self) -> set[str]:
        admission = AdmissionregistrationV1Api(self.cluster.api_client())
        configuration = admission.read_validating_webhook_configuration(self.config_name)
        return {w.client_config.ca_bundle for w in configuration.webhooks}

    def made_lines(self) -> list[str]:
        return [line for log in self.logs for line in log.read_text().splitlines() if "made: a new CA" in line]


def served_certificate(port: int, ca_bundle: bytes) -> bytes:
    context = ssl.create_default_context(cadata=ca_bundle.decode())
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, context.wrap_socket(
        raw, server_hostname="127.0.0.1"
    ) as tls:  # fmt: skip
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return ssl.DER_cert_to_PEM_cert(der).encode()


def self_managed_configuration(port: int, name: str) -> dict[str, Any]:
    """The chart's configuration at this host's webhook, failurePolicy Fail (a call that fails, e.g.
    on an untrusted certificate, is refused as such, never mistaken for an admission), no caBundle:
    the webhook writes it."""
    config = find(render({"webhook.failurePolicy": "Fail"}), "ValidatingWebhookConfiguration")
    config["metadata"] = {"name": name}
    for webhook in config["webhooks"]:
        webhook["clientConfig"] = {"url": f"https://127.0.0.1:{port}/validate"}
    return config


def wait_refusing(resource: ResourceV1Api, timeout_s: float = 30) -> None:
    """Until a bad claim is refused by the webhook (not by a failed call, nor admitted while the
    apiserver has not seen the configuration yet)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        bad = claim_with(BAD_SHARE)
        try:
            resource.create_namespaced_resource_claim(NS, bad)
            resource.delete_namespaced_resource_claim(bad["metadata"]["name"], NS)
            last = "admitted"
        except ApiException as err:
            last = json.loads(err.body)["message"]
            if "denied the request" in last:
                return
        time.sleep(0.3)
    raise AssertionError(f"the webhook never refused a bad claim; last: {last}")


@pytest.fixture
def self_managed(cluster: Cluster, tmp_path: Path) -> Iterator[Callable[..., SelfManaged]]:
    started: list[SelfManaged] = []
    admission = AdmissionregistrationV1Api(cluster.api_client())
    core = CoreV1Api(cluster.api_client())

    def start(count: int = 1, *flags: str, ports: list[int] | None = None) -> SelfManaged:
        ports = ports or [free_port() for _ in range(count)]
        name, secret = unique("fgpu-webhook-selfmanaged"), unique("fgpu-webhook-certs")
        admission.create_validating_webhook_configuration(self_managed_configuration(ports[0], name))
        handle = SelfManaged(cluster, secret, name, [], ports, [tmp_path / f"webhook-{p}.log" for p in ports])
        started.append(handle)
        for port, log in zip(ports, handle.logs, strict=True):  # at once: neither waits for the other
            command = [sys.executable, "-m", "driver.cli", "webhook", "--bind-address=127.0.0.1", f"--port={port}",
                       f"--tls-secret={secret}", f"--namespace={NS}", "--service-name=fgpu-webhook",
                       "--extra-san=127.0.0.1", f"--webhook-configuration={name}",
                       f"--kubeconfig={cluster.kubeconfig}", *flags]  # fmt: skip
            with log.open("wb") as out:
                handle.processes.append(subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT))
        for process, port in zip(handle.processes, ports, strict=True):
            wait_serving(process, port)
        return handle

    yield start
    for handle in started:
        for process in handle.processes:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=10)
        admission.delete_validating_webhook_configuration(handle.config_name)
        with contextlib.suppress(ApiException):
            core.delete_namespaced_secret(handle.secret, NS)


def test_two_self_managed_webhooks_started_at_once_agree_on_one_secret(self_managed, resource_api) -> None:
    webhooks = self_managed(2)
    stored = webhooks.stored()
    assert set(stored) == {"ca.crt", "ca.key", "tls.crt", "tls.key"}
    assert len(webhooks.made_lines()) == 1, [log.read_text() for log in webhooks.logs]  # one made, one read
    for port in webhooks.ports:
        assert webhooks.served(port) == stored["tls.crt"]
    # Each wrote (or found) the caBundle: every webhook of the configuration trusts the Secret's CA.
    wait_until_equal = time.monotonic() + 10
    while webhooks.ca_bundles() != {base64.b64encode(stored["ca.crt"]).decode()}:
        assert time.monotonic() < wait_until_equal, webhooks.ca_bundles()
        time.sleep(0.2)
    wait_refusing(resource_api)
    message = refusal(lambda: resource_api.create_namespaced_resource_claim(NS, claim_with(BAD_SHARE)))
    assert message.startswith('admission webhook "resourceclaims.gpu.fgpu.dev" denied the request:')


def test_self_managed_renewal_keeps_refusing_without_a_restart(self_managed, resource_api) -> None:
    # 24 s certificates renewed with 14 s left: a new one about every 10 s, checked every 3.5 s.
    webhook = self_managed(1, "--cert-validity=24s", "--cert-renew-before=14s")
    (process,), (port,) = webhook.processes, webhook.ports
    wait_refusing(resource_api)
    first = webhook.stored()
    served = {webhook.served(port)}
    deadline = time.monotonic() + 40  # past the first certificate's expiry
    refused = 0
    while time.monotonic() < deadline:
        # Every bad claim refused by the webhook itself: with failurePolicy Fail a call that failed
        # (an untrusted or expired certificate) would say "failed calling webhook" instead.
        message = refusal(lambda: resource_api.create_namespaced_resource_claim(NS, claim_with(BAD_SHARE)))
        assert "denied the request" in message and BAD_FIELD in message, message
        refused += 1
        served.add(webhook.served(port))
        time.sleep(0.5)
    assert process.poll() is None and len(served) >= 3, (refused, len(served))
    last = webhook.stored()
    assert last["tls.crt"] != first["tls.crt"] and last["ca.crt"] == first["ca.crt"]  # the CA stays
    assert webhook.served(port) == last["tls.crt"]
    assert sum("Secret" in line and "renewed" in line for line in webhook.logs[0].read_text().splitlines()) >= 2


def test_applied_again_by_a_gitops_tool_the_configuration_keeps_or_regains_its_caBundle(
    cluster, self_managed, resource_api
) -> None:
    webhook = self_managed(1)
    wait_refusing(resource_api)
    client = DynamicClient(cluster.api_client(), cache_file=cluster.discovery_cache)
    resource = client.resources.get(
        api_version="admissionregistration.k8s.io/v1", kind="ValidatingWebhookConfiguration"
    )
    desired = self_managed_configuration(webhook.ports[0], webhook.config_name)
    desired = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration", **desired}
    # Server-side apply (Flux, Argo CD with ServerSideApply): caBundle is the webhook's field, kept.
    for _ in range(2):
        client.server_side_apply(resource, body=desired, name=webhook.config_name, field_manager="gitops",
                                 force_conflicts=True)  # fmt: skip
        message = refusal(lambda: resource_api.create_namespaced_resource_claim(NS, claim_with(BAD_SHARE)))
        assert "denied the request" in message, message
    # A replace (PUT) of the rendered object wipes the caBundle: the webhook writes it again.
    live = client.get(resource, name=webhook.config_name)
    replaced = {**desired, "metadata": {"name": webhook.config_name, "resourceVersion": live.metadata.resourceVersion}}
    client.replace(resource, body=replaced)
    assert not any(webhook.ca_bundles())
    wait_refusing(resource_api, timeout_s=20)
    assert webhook.ca_bundles() == {base64.b64encode(webhook.stored()["ca.crt"]).decode()}


# --- opt-in without editing pods: the scheduling gate at pod create ----------------------------------

GATE = "gpu.fgpu.dev/allocation"


def gating_configuration(port: int, name: str) -> dict[str, Any]:
    """The chart's MutatingWebhookConfiguration at this host's webhook, failurePolicy Fail (so that a
    pod created means the webhook answered or was never asked), no caBundle: the webhook writes it."""
    config = find(render({"webhook.gatePods.failurePolicy": "Fail"}), "MutatingWebhookConfiguration")
    config["metadata"] = {"name": name}
    for webhook in config["webhooks"]:
        webhook["clientConfig"] = {"url": f"https://127.0.0.1:{port}/mutate"}
    return config


def claim_template(name: str, labels: dict[str, str], device_class: str = "gpu.fgpu.dev") -> dict[str, Any]:
    request = {"name": "gpu", "exactly": {"deviceClassName": device_class}}
    return {
        "metadata": {"name": name},
        "spec": {"metadata": {"labels": labels}, "spec": {"devices": {"requests": [request]}}},
    }


def pod_with(template: str | None) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "c", "image": "registry.k8s.io/pause:3.10"}
    spec: dict[str, Any] = {"containers": [container], "terminationGracePeriodSeconds": 0}
    if template is not None:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": template}]
        container["resources"] = {"claims": [{"name": "gpu"}]}
    return {"metadata": {"name": unique("pod")}, "spec": spec}


def create_once_served(core_api: CoreV1Api, body: Callable[[], dict[str, Any]]) -> Any:
    """The pod created once the pods' webhook answers: it writes the mutating configuration's
    caBundle too, and until kube-apiserver trusts it a pod with claims is refused (failurePolicy
    Fail)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return core_api.create_namespaced_pod(NS, body())
        except ApiException as err:
            assert time.monotonic() < deadline, f"the pods' webhook never answered: {err.body}"
            time.sleep(0.3)


def gates(pod: Any) -> list[str]:
    return [g.name for g in pod.spec.scheduling_gates or ()]


@dataclass
class PodsWebhook:
    """The chart's MutatingWebhookConfiguration pointed at `port` on this host, and what a test made
    under it (pods, claim templates), deleted after the test."""

    port: int
    name: str
    pods: list[str]
    templates: list[str]


@pytest.fixture
def pods_webhook(cluster: Cluster, resource_api: ResourceV1Api, core_api: CoreV1Api) -> Iterator[PodsWebhook]:
    admission = AdmissionregistrationV1Api(cluster.api_client())
    made = PodsWebhook(free_port(), unique("fgpu-webhook-pods"), [], [])
    admission.create_mutating_webhook_configuration(gating_configuration(made.port, made.name))
    yield made
    admission.delete_mutating_webhook_configuration(made.name)
    for name in made.pods:
        with contextlib.suppress(ApiException):
            core_api.delete_namespaced_pod(name, NS, grace_period_seconds=0)
    for name in made.templates:
        with contextlib.suppress(ApiException):
            resource_api.delete_namespaced_resource_claim_template(name, NS)


def test_pods_of_an_opt_in_template_are_gated_at_create_others_are_not_and_pods_without_claims_never_sent(
    cluster, self_managed, pods_webhook, resource_api, core_api
) -> None:
    admission = AdmissionregistrationV1Api(cluster.api_client())
    batch = BatchV1Api(cluster.api_client())
    port, mutating, pods = pods_webhook.port, pods_webhook.name, pods_webhook.pods
    opt_in, plain = unique("opt-in"), unique("plain")
    pods_webhook.templates += [opt_in, plain]
    resource_api.create_namespaced_resource_claim_template(
        NS, claim_template(opt_in, {"gpu.fgpu.dev/allocator": "fgpu"})
    )
    resource_api.create_namespaced_resource_claim_template(NS, claim_template(plain, {}))
    webhook = self_managed(1, "--gate-pods", f"--mutating-webhook-configuration={mutating}", ports=[port])
    created = create_once_served(core_api, lambda: pod_with(opt_in))
    pods.append(created.metadata.name)
    assert gates(created) == [GATE]
    ca = base64.b64encode(webhook.stored()["ca.crt"]).decode()
    assert {w.client_config.ca_bundle for w in admission.read_mutating_webhook_configuration(mutating).webhooks} == {ca}
    # The same pod already gated by its author: one gate, not two.
    gated = pod_with(opt_in)
    gated["spec"]["schedulingGates"] = [{"name": GATE}]
    pods.append(gated["metadata"]["name"])
    assert gates(core_api.create_namespaced_pod(NS, gated)) == [GATE]
    # A template without the opt-in label, and one that does not exist: admitted ungated.
    for template in (plain, unique("missing")):
        body = pod_with(template)
        pods.append(body["metadata"]["name"])
        assert gates(core_api.create_namespaced_pod(NS, body)) == []
    log = webhook.logs[0].read_text()
    assert f"gated ({GATE}): ResourceClaimTemplate {NS}/{opt_in} opts in" in log
    assert f"not gated: ResourceClaimTemplate {NS}/{plain} not opted in" in log
    assert "not found" in log
    # A Job's pods (made by kube-controller-manager, nobody editing them) are gated too.
    job = unique("job")
    template = pod_with(opt_in)
    template["spec"]["restartPolicy"] = "Never"
    batch.create_namespaced_job(NS, {"metadata": {"name": job}, "spec": {"template": {"spec": template["spec"]}}})
    deadline = time.monotonic() + 30
    while not (made := core_api.list_namespaced_pod(NS, label_selector=f"job-name={job}").items):
        assert time.monotonic() < deadline, "the Job made no pod"
        time.sleep(0.3)
    assert gates(made[0]) == [GATE]
    batch.delete_namespaced_job(job, NS, propagation_policy="Background")
    # With the webhook down (failurePolicy Fail): a pod with claims is refused, so a pod without
    # claims that is created was never sent (matchConditions).
    for process in webhook.processes:
        process.terminate()
        process.wait(timeout=10)
    message = refusal(lambda: core_api.create_namespaced_pod(NS, pod_with(opt_in)))
    assert "failed calling webhook" in message, message
    bare = pod_with(None)
    pods.append(bare["metadata"]["name"])
    assert gates(core_api.create_namespaced_pod(NS, bare)) == []


def test_pods_whose_claims_ask_for_fgpus_devices_tolerate_the_nodes_kept_for_gpu_pods(
    self_managed, pods_webhook, resource_api, core_api
) -> None:
    """`fgpu webhook --gpu-pods-toleration KEY` without --gate-pods (the chart's webhook.gpuPodsToleration
    with the controller off): the toleration, and no gate."""
    key = "gpu.fgpu.dev/gpu-pods-only"
    ours, other = unique("mps"), unique("nic")
    pods_webhook.templates += [ours, other]
    resource_api.create_namespaced_resource_claim_template(NS, claim_template(ours, {}, "mps.gpu.fgpu.dev"))
    resource_api.create_namespaced_resource_claim_template(NS, claim_template(other, {}, "nic.example.com"))
    flags = (f"--gpu-pods-toleration={key}", f"--mutating-webhook-configuration={pods_webhook.name}")
    webhook = self_managed(1, *flags, ports=[pods_webhook.port])
    created = create_once_served(core_api, lambda: pod_with(ours))
    pods_webhook.pods.append(created.metadata.name)
    assert [(t.key, t.operator, t.effect, t.value) for t in created.spec.tolerations or ()
            if t.key == key] == [(key, "Exists", "NoSchedule", None)]  # fmt: skip
    assert gates(created) == []
    bare = core_api.create_namespaced_pod(NS, pod_with(other))
    pods_webhook.pods.append(bare.metadata.name)
    assert [t for t in bare.spec.tolerations or () if t.key == key] == []
    log = webhook.logs[0].read_text()
    assert f"tolerates the taint {key}: ResourceClaimTemplate {NS}/{ours} asks for gpu.fgpu.dev's devices" in log


# --- the webhook's own RBAC: the caBundle of its configurations and nothing else --------------------


def test_the_webhooks_service_account_may_patch_the_caBundle_of_its_configuration_and_nothing_else(cluster) -> None:
    """RBAC grants a patch of the configuration by name, which could as well repoint it or switch its
    failurePolicy; the chart's admission policy keeps the webhook's patches to caBundle."""
    objects = render(namespace=NS)
    kinds = ("ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
    rbac = [o for o in objects if o["kind"] in kinds and o["metadata"]["name"].startswith("fgpu-webhook")]
    assert {o["kind"] for o in rbac} == set(kinds)
    configuration = chart_configuration(cluster, free_port(), "fgpu-webhook")  # the name RBAC grants
    admin = DynamicClient(cluster.api_client(), cache_file=cluster.discovery_cache)
    created = []
    as_webhook = cluster.api_client()
    as_webhook.set_default_header("Impersonate-User", f"system:serviceaccount:{NS}:fgpu-webhook")
    webhook_api = AdmissionregistrationV1Api(as_webhook)
    try:
        for obj in [*rbac, configuration]:
            created.append(admin.resources.get(api_version=obj["apiVersion"], kind=obj["kind"]).create(body=obj))
        encoded = base64.b64encode(b"not a CA, but the webhook's to write\n").decode()
        ca_bundle = {"webhooks": [{"name": w["name"], "clientConfig": {"caBundle": encoded}}
                                  for w in configuration["webhooks"]]}  # fmt: skip
        configurations = admin.resources.get(api_version=configuration["apiVersion"], kind=configuration["kind"])
        deadline = time.monotonic() + 30
        while True:  # the apiserver takes up the policy from its informer: until then a switch passes
            current = configurations.get(name="fgpu-webhook").to_dict()
            switched = {"webhooks": [{"name": w["name"], "failurePolicy": FLIPPED[w["failurePolicy"]]}
                                     for w in current["webhooks"]]}  # fmt: skip
            try:
                webhook_api.patch_validating_webhook_configuration("fgpu-webhook", switched, _content_type=STRATEGIC)
            except ApiException as err:
                assert err.status in (403, 422), err.body
                assert "may only write the caBundle" in err.body
                break
            assert time.monotonic() < deadline, "the admission policy never took effect"
            time.sleep(0.3)
        before = configurations.get(name="fgpu-webhook").to_dict()
        webhook_api.patch_validating_webhook_configuration("fgpu-webhook", ca_bundle, _content_type=STRATEGIC)
        written = configurations.get(name="fgpu-webhook").to_dict()
        assert {w["clientConfig"]["caBundle"] for w in written["webhooks"]} == {encoded}
        assert [w["failurePolicy"] for w in written["webhooks"]] == [w["failurePolicy"] for w in before["webhooks"]]
        with pytest.raises(ApiException) as refused:
            webhook_api.delete_validating_webhook_configuration("fgpu-webhook")
        assert refused.value.status == 403  # RBAC: no delete
    finally:
        for obj in reversed(created):
            admin.resources.get(api_version=obj.apiVersion, kind=obj.kind).delete(name=obj.metadata.name)
