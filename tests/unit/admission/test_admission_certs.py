"""The webhook's own certificates (driver/admission/certs.py, rotation.py) without a cluster: what a
certificate names and how long it lives, when it is renewed, replicas agreeing on one Secret through
an API stand-in that answers as kube-apiserver does (AlreadyExists, Conflict on a stale
resourceVersion), the caBundle written only where it differs, and a running server handing out a
new certificate without a restart. On the real apiserver: tests/integration/test_admission_webhook.py."""

from __future__ import annotations

import argparse
import base64
import copy
import datetime
import http.client
import socket
import ssl
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from driver.admission import certs
from driver.admission.lifetimes import Lifetimes, duration
from driver.admission.rotation import MUTATING, VALIDATING, CaBundlePublisher, MountedFiles, Rotator, SelfManaged
from driver.admission.server import WebhookServer, tls_context
from driver.admission.settings import WebhookSettings
from driver.kube.errors import ConflictError

HOSTS = certs.service_hosts("fgpu-webhook", "fgpu-system", ["127.0.0.1"])
SHORT = Lifetimes(validity_s=60, renew_before_s=20, ca_validity_s=3600)
T0 = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.UTC)


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


class FakeApi:
    """One Secret and one configuration, with kube-apiserver's answers to create and update races."""

    def __init__(self, webhooks: Sequence[str] = ("a.gpu.fgpu.dev", "b.gpu.fgpu.dev")) -> None:
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self.version = 0
        self.configuration: dict[str, Any] | None = {
            "metadata": {"name": "fgpu-webhook"},
            "webhooks": [{"name": name, "clientConfig": {"service": {"name": "s"}}} for name in webhooks],
        }
        self.mutating: dict[str, Any] | None = None  # a MutatingWebhookConfiguration, when a test adds one
        self.patches: list[list[str]] = []
        self.before_write: list[Any] = []  # callables run before a create or replace lands: races
        self.lock = threading.Lock()

    def _race(self) -> None:
        while self.before_write:
            self.before_write.pop(0)()

    def read_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        with self.lock:
            found = self.secrets.get((namespace, name))
            return copy.deepcopy(found)

    def create_secret(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        self._race()
        with self.lock:
            key = (namespace, body["metadata"]["name"])
            if key in self.secrets:
                raise ConflictError("conflict: AlreadyExists")
            self.version += 1
            stored = copy.deepcopy(body)
            stored["metadata"]["resourceVersion"] = str(self.version)
            self.secrets[key] = stored
            return copy.deepcopy(stored)

    def replace_secret(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        self._race()
        with self.lock:
            current = self.secrets[(namespace, name)]
            if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                raise ConflictError("conflict: the object has been modified")
            self.version += 1
            stored = copy.deepcopy(body)
            stored["metadata"]["resourceVersion"] = str(self.version)
            self.secrets[(namespace, name)] = stored
            return copy.deepcopy(stored)

    def read_webhook_configuration(self, name: str, kind: str = VALIDATING) -> dict[str, Any] | None:
        return copy.deepcopy(self.mutating if kind == MUTATING else self.configuration)

    def patch_ca_bundle(self, name: str, webhooks: Sequence[str], ca_bundle: bytes, kind: str = VALIDATING) -> None:
        configuration = self.mutating if kind == MUTATING else self.configuration
        assert configuration is not None
        self.patches.append(list(webhooks))
        for webhook in configuration["webhooks"]:
            if webhook["name"] in webhooks:
                webhook["clientConfig"]["caBundle"] = base64.b64encode(ca_bundle).decode()

    def secret_bundle(self) -> certs.Bundle:
        (secret,) = self.secrets.values()
        bundle = certs.Bundle.from_secret_data({k: base64.b64decode(v) for k, v in secret["data"].items()})
        assert bundle is not None
        return bundle


def manager(api: FakeApi, clock: list[datetime.datetime], lifetimes: Lifetimes = SHORT) -> SelfManaged:
    return SelfManaged(api, "fgpu-system", "fgpu-webhook-certs", HOSTS, lifetimes, "fgpu-webhook",
                       clock=lambda: clock[0])  # fmt: skip


def cert_of(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


# --- certificates ---------------------------------------------------------------------------------


def test_a_serving_certificate_names_the_service_and_is_signed_by_the_ca(tmp_path: Path) -> None:
    bundle = certs.issue("fgpu-webhook-certs", HOSTS, SHORT, now=T0)
    cert = cert_of(bundle.cert)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [
        "fgpu-webhook", "fgpu-webhook.fgpu-system", "fgpu-webhook.fgpu-system.svc"
    ]  # fmt: skip
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert cert.not_valid_after_utc == at(60)
    ca = cert_of(bundle.ca_bundle)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ca.not_valid_after_utc == at(3600)
    assert certs.trusts(bundle.ca_bundle, bundle.cert)
    assert certs.renewal_reason(bundle, HOSTS, SHORT, at(0)) is None
    # Python's own TLS stack takes the pair, and verifies the chain for the Service's name.
    (tmp_path / "ca.crt").write_bytes(bundle.ca_bundle)
    client = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
    assert client.verify_mode == ssl.CERT_REQUIRED
    tls_context(bundle.cert, bundle.key)


def test_renewal_reasons() -> None:
    bundle = certs.issue("n", HOSTS, SHORT, now=T0)
    assert certs.renewal_reason(bundle, HOSTS, SHORT, at(39)) is None
    assert "tls.crt expires" in (certs.renewal_reason(bundle, HOSTS, SHORT, at(41)) or "")
    assert "not for" in (certs.renewal_reason(bundle, ("other",), SHORT, at(0)) or "")
    other = certs.issue("n", HOSTS, SHORT, now=T0)
    assert "not signed by the CA" in (certs.renewal_reason(
        certs.Bundle(bundle.ca_bundle, bundle.ca_key, other.cert, other.key), HOSTS, SHORT, at(0)) or "")  # fmt: skip
    assert "tls.key is not the key" in (certs.renewal_reason(
        certs.Bundle(bundle.ca_bundle, bundle.ca_key, bundle.cert, other.key), HOSTS, SHORT, at(0)) or "")  # fmt: skip
    assert "unreadable" in (certs.renewal_reason(certs.Bundle(b"x", b"y", b"z", b"w"), HOSTS, SHORT) or "")
    # The CA is renewed once a new serving certificate (60 s, renewed at 20 s left) would outlive it.
    late = certs.issue("n", HOSTS, SHORT, previous=bundle, now=at(3600 - 100))
    assert late.ca_key == bundle.ca_key and certs.renewal_reason(late, HOSTS, SHORT, at(3600 - 81)) is None
    assert "the CA expires" in (certs.renewal_reason(late, HOSTS, SHORT, at(3600 - 79)) or "")


def test_a_renewal_keeps_the_ca_until_it_runs_short_then_trusts_old_and_new() -> None:
    first = certs.issue("n", HOSTS, SHORT, now=T0)
    renewed = certs.issue("n", HOSTS, SHORT, previous=first, now=at(45))
    assert (renewed.ca_bundle, renewed.ca_key) == (first.ca_bundle, first.ca_key) and renewed.cert != first.cert
    rotated = certs.issue("n", HOSTS, SHORT, previous=renewed, now=at(3600 - 70))
    cas = x509.load_pem_x509_certificates(rotated.ca_bundle)
    assert len(cas) == 2 and cas[1] == cert_of(first.ca_bundle) and rotated.ca_key != first.ca_key
    # Both the certificate still served elsewhere and the new one are trusted by the new caBundle.
    assert certs.trusts(rotated.ca_bundle, renewed.cert) and certs.trusts(rotated.ca_bundle, rotated.cert)
    assert certs.renewal_reason(rotated, HOSTS, SHORT, at(3600 - 70)) is None
    # An expired old CA leaves the bundle at the next renewal.
    later = certs.issue("n", HOSTS, SHORT, previous=rotated, now=at(3600 + 5))
    assert len(x509.load_pem_x509_certificates(later.ca_bundle)) == 1


@pytest.mark.parametrize(
    ("text", "seconds"), [("8760h", 8760 * 3600), ("30s", 30), ("1h30m", 5400), ("90d", 90 * 86400), ("2.5", 2.5)]
)
def test_durations(text: str, seconds: float) -> None:
    assert duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-5s", "5x", "h", "1h 30m", "inf"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="is not a duration"):
        duration(text)


def test_lifetimes_that_do_not_fit_together() -> None:
    with pytest.raises(ValueError, match="renewal margin"):
        Lifetimes(60, 60, 3600).check()
    with pytest.raises(ValueError, match="CA's validity"):
        Lifetimes(60, 20, 80).check()
    settings = WebhookSettings("gpu.fgpu.dev", "127.0.0.1", 8443, tls_secret="s", namespace="ns", hosts=HOSTS)
    settings.check()
    with pytest.raises(ValueError, match="not both"):
        WebhookSettings("d", "a", 1, cert_file=Path("c"), tls_secret="s", namespace="n", hosts=HOSTS).check()
    with pytest.raises(ValueError, match="needs --namespace"):
        WebhookSettings("d", "a", 1, tls_secret="s", hosts=HOSTS).check()


# --- the Secret: made once, renewed once, by whichever replica comes first ---------------------------


def test_the_first_start_makes_the_secret_and_writes_every_caBundle() -> None:
    api, clock = FakeApi(), [T0]
    bundle, written = manager(api, clock).sync()
    assert written and api.patches == [["a.gpu.fgpu.dev", "b.gpu.fgpu.dev"]]
    assert api.secret_bundle() == bundle
    (secret,) = api.secrets.values()
    assert secret["type"] == "kubernetes.io/tls" and set(secret["data"]) == {"ca.crt", "ca.key", "tls.crt", "tls.key"}
    # A second replica, or a restart, serves the same certificate and writes nothing.
    again, written = manager(api, clock).sync()
    assert again == bundle and not written and len(api.patches) == 1


def test_two_replicas_racing_to_create_agree_on_the_winners_secret() -> None:
    api, clock = FakeApi(), [T0]
    first, second = manager(api, clock), manager(api, clock)
    won: list[certs.Bundle] = []
    # The second replica reads "absent" too, but its create lands first: the first one's fails
    # with AlreadyExists and it reads the winner's.
    api.before_write.append(lambda: won.append(second.sync()[0]))
    bundle, _ = first.sync()
    assert bundle == won[0] == api.secret_bundle()


def test_renewal_before_expiry_and_a_renewal_race_agree() -> None:
    api, clock = FakeApi(), [T0]
    first, second = manager(api, clock), manager(api, clock)
    original, _ = first.sync()
    clock[0] = at(39)
    assert first.sync()[0] == original  # 21 s left: not yet
    clock[0] = at(41)
    renewed: list[certs.Bundle] = []
    api.before_write.append(lambda: renewed.append(second.sync()[0]))  # renews first; ours conflicts
    bundle, _ = first.sync()
    assert bundle == renewed[0] == api.secret_bundle() and bundle.cert != original.cert
    assert bundle.ca_bundle == original.ca_bundle  # same CA: the caBundle needs no change
    assert cert_of(bundle.cert).not_valid_after_utc == at(41 + 60)


def test_a_secret_without_the_ca_key_is_replaced() -> None:
    api, clock = FakeApi(), [T0]
    bundle = certs.issue("x", HOSTS, SHORT, now=T0)
    data = {k: base64.b64encode(v).decode() for k, v in bundle.secret_data().items() if k != "ca.key"}
    api.secrets[("fgpu-system", "fgpu-webhook-certs")] = {"metadata": {"resourceVersion": "7"}, "data": data}
    served, _ = manager(api, clock).sync()
    assert served.ca_key and api.secret_bundle() == served


def test_a_wiped_caBundle_is_written_again_and_a_missing_configuration_waits() -> None:
    api, clock = FakeApi(), [T0]
    managed = manager(api, clock)
    managed.sync()
    assert api.configuration is not None
    del api.configuration["webhooks"][1]["clientConfig"]["caBundle"]  # e.g. a PUT of the rendered object
    assert managed.sync()[1] and api.patches[-1] == ["b.gpu.fgpu.dev"]
    api.configuration = None
    assert managed.sync()[1] is False


def test_the_caBundle_goes_into_the_mutating_configuration_too_which_may_be_absent() -> None:
    api, clock = FakeApi(), [T0]
    managed = SelfManaged(api, "fgpu-system", "fgpu-webhook-certs", HOSTS, SHORT, "fgpu-webhook",
                          clock=lambda: clock[0], mutating="fgpu-webhook")  # fmt: skip
    bundle, written = managed.sync()  # no MutatingWebhookConfiguration (yet): the validating one is written
    assert written and api.patches == [["a.gpu.fgpu.dev", "b.gpu.fgpu.dev"]]
    api.mutating = {
        "metadata": {"name": "fgpu-webhook"},
        "webhooks": [{"name": "pods.gpu.fgpu.dev", "clientConfig": {}}],
    }
    assert managed.sync()[1] and api.patches[-1] == ["pods.gpu.fgpu.dev"]
    assert api.mutating["webhooks"][0]["clientConfig"]["caBundle"] == base64.b64encode(bundle.ca_bundle).decode()
    assert managed.sync()[1] is False  # both current: nothing written


def test_mounted_files_publish_their_ca_to_both_configurations(tmp_path: Path) -> None:
    bundle = certs.issue("x", HOSTS, SHORT)
    for name, data in bundle.secret_data().items():
        (tmp_path / name).write_bytes(data)
    api = FakeApi(("a.gpu.fgpu.dev",))
    api.mutating = {"metadata": {"name": "m"}, "webhooks": [{"name": "pods.gpu.fgpu.dev", "clientConfig": {}}]}
    files = MountedFiles(tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "ca.crt",
                         CaBundlePublisher(api, "fgpu-webhook", "m"))  # fmt: skip
    assert files.sync()[1] and api.patches == [["a.gpu.fgpu.dev"], ["pods.gpu.fgpu.dev"]]


def test_mounted_files_publish_their_ca(tmp_path: Path) -> None:
    bundle = certs.issue("x", HOSTS, SHORT)
    for name, data in bundle.secret_data().items():
        (tmp_path / name).write_bytes(data)
    api = FakeApi()
    files = MountedFiles(tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "ca.crt",
                         CaBundlePublisher(api, "fgpu-webhook"))  # fmt: skip
    served, written = files.sync()
    assert served.cert == bundle.cert and written and len(api.patches) == 1
    assert files.sync()[1] is False


# --- the running server takes a new certificate without a restart ----------------------------------


def peer_certificate(port: int, ca_bundle: bytes, tmp_path: Path) -> bytes:
    cafile = tmp_path / f"ca-{port}.crt"
    cafile.write_bytes(ca_bundle)
    context = ssl.create_default_context(cafile=str(cafile))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="fgpu-webhook.fgpu-system.svc") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return ssl.DER_cert_to_PEM_cert(der).encode()


@pytest.fixture
def server() -> Iterator[WebhookServer]:
    bundle = certs.issue("x", HOSTS, SHORT)
    settings = WebhookSettings("gpu.fgpu.dev", "127.0.0.1", 0, tls_secret="s", namespace="n", hosts=HOSTS)
    running = WebhookServer(settings, tls_context(bundle.cert, bundle.key))
    thread = threading.Thread(target=running.serve_forever, daemon=True)
    thread.start()
    yield running
    running.shutdown()
    running.server_close()


def test_the_rotator_swaps_the_served_certificate_in_place(server: WebhookServer, tmp_path: Path) -> None:
    api, clock = FakeApi(), [datetime.datetime.now(datetime.UTC)]
    rotator = Rotator(manager(api, clock), server.set_certificate, interval_s=3600, settle_s=0)
    rotator.first()
    port = server.server_address[1]
    first = api.secret_bundle()
    assert cert_of(peer_certificate(port, first.ca_bundle, tmp_path)) == cert_of(first.cert)
    clock[0] += datetime.timedelta(seconds=45)  # inside the renewal margin
    rotator._round()
    second = api.secret_bundle()
    assert second.cert != first.cert
    assert cert_of(peer_certificate(port, second.ca_bundle, tmp_path)) == cert_of(second.cert)
    assert server.socket.fileno() >= 0  # the same listening socket throughout


def test_a_kept_alive_connection_closes_after_a_renewal(server: WebhookServer, tmp_path: Path) -> None:
    # kube-apiserver keeps connections open: one made with the old certificate is closed after its
    # next answer, so the next review comes over a new handshake with the new certificate.
    api, clock = FakeApi(), [datetime.datetime.now(datetime.UTC)]
    rotator = Rotator(manager(api, clock), server.set_certificate, interval_s=3600, settle_s=0)
    rotator.first()
    first = api.secret_bundle()
    (tmp_path / "ca.crt").write_bytes(first.ca_bundle)
    context = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
    connection = http.client.HTTPSConnection("127.0.0.1", server.server_address[1], context=context, timeout=5)
    connection.request("GET", "/healthz")
    answer = connection.getresponse()
    assert answer.read() == b"ok\n" and answer.getheader("Connection") is None
    clock[0] += datetime.timedelta(seconds=45)
    rotator._round()
    connection.request("GET", "/healthz")
    answer = connection.getresponse()
    assert answer.read() == b"ok\n" and answer.getheader("Connection") == "close"
    connection.close()
