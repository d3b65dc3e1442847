"""The webhook's HTTPS server (driver/admission/server.py) as anyone on the pod network meets it:
connections bounded and closed when idle, the metrics' labels never a caller's text, a malformed
Content-Length answered in one line, and with --client-ca-file no review without kube-apiserver's
client certificate (a /mutate answer tells whether a claim of any namespace exists). On the real
apiserver: tests/integration/test_admission_webhook.py."""

from __future__ import annotations

import base64
import dataclasses
import datetime
import http.client
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from prometheus_client import REGISTRY

from driver.admission import certs
from driver.admission.lifetimes import Lifetimes
from driver.admission.server import WebhookServer, client_ca_bundle, tls_context
from driver.admission.settings import WebhookSettings
from driver.common.http_server import ConnectionLimits
from driver.scheduling.opt_in import OPT_IN_LABEL, OPT_IN_VALUE

HOSTS = certs.service_hosts("fgpu-webhook", "fgpu-system", ["127.0.0.1"])
BUNDLE = certs.issue("x", HOSTS, Lifetimes(validity_s=3600, renew_before_s=60, ca_validity_s=7200))
SETTINGS = WebhookSettings("gpu.fgpu.dev", "127.0.0.1", 0, tls_secret="s", namespace="n", hosts=HOSTS, gate_pods=True)


class Reader:
    """A claim `secret` of a whole GPU that opts in, in namespace `other`; records each read."""

    def __init__(self) -> None:
        self.reads: list[str] = []

    def read_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads.append(f"{namespace}/{name}")
        request = {"name": "gpu", "exactly": {"deviceClassName": "gpu.fgpu.dev"}}
        opted_in = {"metadata": {"labels": {OPT_IN_LABEL: OPT_IN_VALUE}}, "spec": {"devices": {"requests": [request]}}}
        return opted_in if (namespace, name) == ("other", "secret") else None

    def read_claim_template(self, namespace: str, name: str) -> dict[str, Any] | None:
        return None


def client_certificate(tmp_path: Path) -> tuple[bytes, Path, Path]:
    """(a CA's PEM, the certificate and key files of a client it signed): kube-apiserver's."""
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)

    def signed(subject: str, public: Any, ca: bool) -> x509.Certificate:
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "front-proxy-ca")]))
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        return builder.sign(ca_key, hashes.SHA256())

    ca = signed("front-proxy-ca", ca_key.public_key(), ca=True).public_bytes(serialization.Encoding.PEM)
    cert_file, key_file = tmp_path / "client.crt", tmp_path / "client.key"
    cert_file.write_bytes(signed("kube-apiserver", key.public_key(), ca=False).public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    return ca, cert_file, key_file


Start = Callable[..., WebhookServer]


@pytest.fixture
def start() -> Iterator[Start]:
    servers: list[WebhookServer] = []

    def started(settings: WebhookSettings = SETTINGS, **kwargs: Any) -> WebhookServer:
        client_ca = kwargs.get("client_ca", b"")
        server = WebhookServer(settings, tls_context(BUNDLE.cert, BUNDLE.key, client_ca), **kwargs)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield started
    for server in servers:
        server.shutdown()
        server.server_close()


def client_context(tmp_path: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    (tmp_path / "server-ca.crt").write_bytes(BUNDLE.ca_bundle)
    context = ssl.create_default_context(cafile=str(tmp_path / "server-ca.crt"))
    if cert is not None:
        context.load_cert_chain(cert, key)
    return context


def connect(server: WebhookServer, context: ssl.SSLContext) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", server.server_port), timeout=5)
    return context.wrap_socket(raw, server_hostname="fgpu-webhook.fgpu-system.svc")


def post(server: WebhookServer, context: ssl.SSLContext, path: str, document: Any) -> tuple[int, bytes]:
    connection = http.client.HTTPSConnection("127.0.0.1", server.server_port, context=context, timeout=5)
    try:
        connection.request("POST", path, json.dumps(document), {"Content-Type": "application/json"})
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


def pod_review(namespace: str, claim: str, kind: Any = None) -> dict[str, Any]:
    pod = {"metadata": {"name": "p"}, "spec": {"resourceClaims": [{"name": "g", "resourceClaimName": claim}]}}
    request = {"uid": "u", "kind": kind or {"kind": "Pod"}, "namespace": namespace, "operation": "CREATE"}
    request["object"] = pod
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


def test_a_caller_chosen_kind_is_counted_as_other(start: Start, tmp_path: Path) -> None:
    server = start()
    document = pod_review("n", "c", kind={"kind": "Kind-4f1e2d"})
    assert post(server, client_context(tmp_path), "/validate", document)[0] == 200
    assert REGISTRY.get_sample_value("fgpu_webhook_reviews_total", {"kind": "Kind-4f1e2d", "result": "allowed"}) is None
    assert REGISTRY.get_sample_value("fgpu_webhook_reviews_total", {"kind": "other", "result": "allowed"})


def test_a_kind_that_is_not_an_object_is_refused_in_one_line(start: Start, tmp_path: Path) -> None:
    status, body = post(start(), client_context(tmp_path), "/validate", pod_review("n", "c", kind="Pod"))
    assert (status, body) == (400, b"request.kind must be an object (group, version, kind)\n")


def test_a_malformed_content_length_is_answered_and_the_connection_closed(start: Start, tmp_path: Path) -> None:
    with connect(start(), client_context(tmp_path)) as tls:
        tls.sendall(b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Length: 1e999999999\r\n\r\n")
        answer = tls.makefile("rb").read()
    assert answer.startswith(b"HTTP/1.1 413 ") and b"Connection: close" in answer


def test_an_idle_connection_is_closed(start: Start, tmp_path: Path) -> None:
    server = start(limits=ConnectionLimits(max_connections=4, idle_timeout_s=0.3))
    with connect(server, client_context(tmp_path)) as tls:
        started = time.monotonic()
        assert tls.recv(1) == b""  # the server closed it: nothing was sent
        assert time.monotonic() - started < 3


def test_connections_beyond_the_limit_are_closed_at_once(start: Start, tmp_path: Path) -> None:
    server = start(limits=ConnectionLimits(max_connections=2, idle_timeout_s=30))
    context = client_context(tmp_path)
    held = [connect(server, context), connect(server, context)]
    try:
        with pytest.raises((ssl.SSLError, ConnectionError)):
            connect(server, context).recv(1)
    finally:
        for tls in held:
            tls.close()
    deadline = time.monotonic() + 5
    while True:  # the slots come back when the held connections close
        try:
            connect(server, context).close()
            break
        except (ssl.SSLError, ConnectionError):
            assert time.monotonic() < deadline, "the slots of closed connections never came back"
            time.sleep(0.05)


def test_without_kube_apiservers_certificate_mutate_reveals_no_claim(start: Start, tmp_path: Path) -> None:
    ca, cert, key = client_certificate(tmp_path)
    reader = Reader()
    server = start(claims=reader, client_ca=ca)
    document = pod_review("other", "secret")
    status, body = post(server, client_context(tmp_path), "/mutate", document)
    assert (status, body) == (403, b"a client certificate of --client-ca-file is required\n")
    assert reader.reads == []  # nothing read, so nothing told
    assert post(server, client_context(tmp_path), "/validate", document)[0] == 403
    status, body = post(server, client_context(tmp_path, cert, key), "/mutate", document)
    assert status == 200 and "patch" in json.loads(body)["response"]
    connection = http.client.HTTPSConnection(
        "127.0.0.1", server.server_port, context=client_context(tmp_path), timeout=5
    )
    connection.request("GET", "/healthz")  # kubelet's probes send no certificate
    assert connection.getresponse().status == 200
    connection.close()


def test_mutate_adds_what_the_flags_say_and_counts_it(start: Start, tmp_path: Path) -> None:
    key = "gpu.fgpu.dev/gpu-pods-only"
    tolerating = dataclasses.replace(SETTINGS, gate_pods=False, gpu_pods_toleration=key)
    for settings, result in ((tolerating, "tolerated"), (SETTINGS, "gated")):
        before = REGISTRY.get_sample_value("fgpu_webhook_reviews_total", {"kind": "Pod", "result": result}) or 0
        status, body = post(
            start(settings, claims=Reader()), client_context(tmp_path), "/mutate", pod_review("other", "secret")
        )
        patch = json.loads(base64.b64decode(json.loads(body)["response"]["patch"]))
        assert status == 200 and [op["path"] for op in patch] == [
            "/spec/tolerations" if result == "tolerated" else "/spec/schedulingGates"
        ]
        assert REGISTRY.get_sample_value("fgpu_webhook_reviews_total", {"kind": "Pod", "result": result}) == before + 1


def test_a_client_ca_file_that_cannot_be_loaded_stops_the_webhook_at_start(tmp_path: Path) -> None:
    (tmp_path / "ca.crt").write_text("not a certificate\n")
    settings = dataclasses.replace(SETTINGS, client_ca_file=tmp_path / "ca.crt")
    with pytest.raises(ValueError, match=f"^--client-ca-file: cannot load {tmp_path}/ca.crt: "):
        client_ca_bundle(settings)
