"""Gating pods without claims for the controller to place (POST /place-pods, driver/admission/mutate.py):
kube-apiserver sends only the pods of namespaces labelled gpu.fgpu.dev/place-pods=fgpu (the chart's
namespaceSelector); of those, exactly the pods without claims that fgpu may place get the gate. A pod
with claims, bound already, a DaemonSet's, in kube-system, another scheduler's or in a PodGroup,
and a pod gated already, are admitted as they came. On the real apiserver: tests/e2e/test_placed_pods.py."""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import threading
from typing import Any

import pytest

from driver.admission import certs
from driver.admission.lifetimes import Lifetimes
from driver.admission.mutate import place_pods
from driver.admission.server import WebhookServer, tls_context
from driver.admission.settings import WebhookSettings
from driver.scheduling.opt_in import SCHEDULING_GATE, placement_exempt

GATE = {"name": SCHEDULING_GATE}


def pod(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "web-"},
            "spec": {"containers": [{"name": "c", "image": "x"}], **spec}}  # fmt: skip


def review(obj: dict[str, Any], namespace: str = "web", operation: str = "CREATE", kind: str = "Pod") -> dict[str, Any]:
    request = {"uid": "u-1", "kind": {"group": "", "version": "v1", "kind": kind}, "operation": operation,
               "namespace": namespace, "object": obj}  # fmt: skip
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


def patch_of(answer: dict[str, Any]) -> list[dict[str, Any]] | None:
    response = answer["response"]
    assert response["allowed"] is True and response["uid"] == "u-1"
    if "patch" not in response:
        return None
    assert response["patchType"] == "JSONPatch"
    return json.loads(base64.b64decode(response["patch"]))


def test_a_pod_without_claims_is_gated():
    assert patch_of(place_pods(review(pod()))) == [{"op": "add", "path": "/spec/schedulingGates", "value": [GATE]}]
    others = pod(schedulingGates=[{"name": "theirs"}])
    assert patch_of(place_pods(review(others))) == [{"op": "add", "path": "/spec/schedulingGates/-", "value": GATE}]
    assert patch_of(place_pods(review(pod(resourceClaims=[])))) is not None  # an empty list is no claim


DAEMONSET = {"kind": "DaemonSet", "name": "d", "uid": "u", "apiVersion": "apps/v1", "controller": True}
LEFT_ALONE = {
    "with claims": (pod(resourceClaims=[{"name": "g", "resourceClaimName": "c"}]), "web"),
    "bound": (pod(nodeName="n1"), "web"),
    "another scheduler's": (pod(schedulerName="volcano"), "web"),
    "in a PodGroup": (pod(schedulingGroup={"podGroupName": "g"}), "web"),
    "in kube-system": (pod(), "kube-system"),
    "gated already": (pod(schedulingGates=[GATE]), "web"),
    "a DaemonSet's": ({**pod(), "metadata": {"generateName": "d-", "ownerReferences": [DAEMONSET]}}, "web"),
}


@pytest.mark.parametrize("case", list(LEFT_ALONE))
def test_pods_fgpu_does_not_place_are_admitted_as_they_came(case):
    obj, namespace = LEFT_ALONE[case]
    assert patch_of(place_pods(review(obj, namespace))) is None


def test_only_a_pods_create_is_gated():
    assert patch_of(place_pods(review(pod(), operation="UPDATE"))) is None
    assert patch_of(place_pods(review({"metadata": {"name": "x"}, "spec": {}}, kind="ConfigMap"))) is None


def test_why_a_pod_is_exempt_is_said():
    assert placement_exempt({"metadata": {"namespace": "kube-system"}, "spec": {}}) == "in kube-system"
    assert placement_exempt({"metadata": {"namespace": "web"}, "spec": {"nodeName": "n1"}}) == "spec.nodeName is set"
    assert placement_exempt({"metadata": {"namespace": "web"}, "spec": {"schedulerName": "default-scheduler"}}) is None


def test_the_server_answers_place_pods_without_gate_pods(tmp_path):
    """The path reads nothing from the API, so it is served without --gate-pods (no claim reader)."""
    hosts = certs.service_hosts("fgpu-webhook", "fgpu-system", ["127.0.0.1"])
    bundle = certs.issue("x", hosts, Lifetimes(validity_s=3600, renew_before_s=60, ca_validity_s=7200))
    settings = WebhookSettings("gpu.fgpu.dev", "127.0.0.1", 0, tls_secret="s", namespace="n", hosts=hosts)
    server = WebhookServer(settings, tls_context(bundle.cert, bundle.key))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (tmp_path / "ca.crt").write_bytes(bundle.ca_bundle)
        context = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
        answers = {}
        for path in ("/place-pods", "/mutate"):
            connection = http.client.HTTPSConnection("127.0.0.1", server.server_port, context=context, timeout=5)
            connection.request("POST", path, json.dumps(review(pod())), {"Content-Type": "application/json"})
            answer = connection.getresponse()
            answers[path] = (answer.status, answer.read())
            connection.close()
        assert answers["/mutate"][0] == 404  # without --gate-pods
        status, body = answers["/place-pods"]
        assert status == 200 and patch_of(json.loads(body)) is not None
    finally:
        server.shutdown()
        server.server_close()
