"""`fgpu webhook`: the validating admission webhook over HTTPS (kube-apiserver calls only HTTPS).

POST /validate answers an AdmissionReview (driver/admission/review.py); POST /mutate (with
--gate-pods) adds fgpu's scheduling gate to pods that use opt-in claims (and with
--gpu-pods-toleration the toleration of nodes kept for pods with GPUs), POST /place-pods to pods
without claims in the namespaces whose pods the controller places (driver/admission/mutate.py);
POST /rightsize (with --rightsize-history-namespace) sizes new claims (driver/admission/rightsize.py);
GET /healthz is the probes' endpoint; GET /metrics Prometheus' text format. The serving certificate comes from
driver/admission/rotation.py (a Secret the webhook manages itself, or mounted files) and is swapped
while serving: new connections get the new one, without a restart. Its flags and settings are in
driver/admission/settings.py.

Anyone on the pod network can connect (docs/admission.md, "Who may call it"): connections are
bounded and closed when idle (driver/common/http_server.py), a label of the metrics is never taken
from a request as it came, and with --client-ca-file only a client certificate of that CA (kube-
apiserver's) gets an answer from /validate and /mutate, whose answers depend on objects the caller
may not be allowed to see.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import ssl
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest

from driver.admission.gpu_pods_only import EFFECT
from driver.admission.mutate import ClaimReader, PodRules, mutate, place_pods, review_result
from driver.admission.review import CONFIG_PATHS, review
from driver.admission.rightsize import Rightsizer, rightsize
from driver.admission.rotation import CaBundlePublisher, ClientCertApi, MountedFiles, Rotator, SelfManaged
from driver.admission.settings import WebhookSettings
from driver.common.http_server import BoundedHTTPServer, ConnectionLimits

LOG = logging.getLogger("fgpu.webhook")
# etcd's request limit is 1.5 MiB: no object kube-apiserver sends is larger than this.
MAX_BODY_BYTES = 3 * 2**20
HANDSHAKE_TIMEOUT_S = 10.0
# kube-apiserver keeps a few connections per replica alive (its idle timeout is 90 s: it reconnects
# when we close first); 128 leaves room for several API servers under load, and bounds the threads
# a client that opens connections and sends nothing can hold.
LIMITS = ConnectionLimits(max_connections=128, idle_timeout_s=30.0)
REVIEWS = Counter("fgpu_webhook_reviews_total", "Admission reviews answered", ["kind", "result"])
# The `kind` label's values: the kinds this webhook is sent; anything else a caller writes is "other".
REVIEWED_KINDS = frozenset((*CONFIG_PATHS, "Pod"))


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.write(fd, data)
    return fd


def metric_kind(document: dict[str, Any]) -> str:
    """The reviewed object's kind as the metrics' `kind` label: one of REVIEWED_KINDS, or "other"."""
    kind = (document["request"].get("kind") or {}).get("kind")  # a dict: admission_request checked it
    return kind if kind in REVIEWED_KINDS else "other"


def content_length(header: str | None) -> int:
    """The header's byte count; -1 where it is not a plain decimal of at most 9 digits."""
    if header is None or not (header.isascii() and header.isdigit() and len(header) <= 9):
        return -1
    return int(header)


def tls_context(cert: bytes, key: bytes, client_ca: bytes = b"") -> ssl.SSLContext:
    """A server context for a PEM certificate (chain) and key held in memory: read through memfds,
    so that nothing is written to the (read-only) file system. With `client_ca` (PEM), a client
    certificate is asked for and, when one is sent, must be of that CA; kubelet's probes send none,
    so it is optional here and required by the handler for reviews."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if client_ca:
        context.verify_mode = ssl.CERT_OPTIONAL
        context.load_verify_locations(cadata=client_ca.decode())
    cert_fd, key_fd = _memfd("tls.crt", cert), _memfd("tls.key", key)
    try:
        context.load_cert_chain(f"/proc/self/fd/{cert_fd}", f"/proc/self/fd/{key_fd}")
    finally:
        os.close(cert_fd)
        os.close(key_fd)
    return context


class _Handler(BaseHTTPRequestHandler):
    server: WebhookServer
    protocol_version = "HTTP/1.1"  # kube-apiserver keeps connections open between reviews

    def setup(self) -> None:
        super().setup()
        self.certificate = self.server.connection_certificate()

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._reply(HTTPStatus.OK, b"ok\n", "text/plain")
        elif self.path == "/metrics":
            self._reply(HTTPStatus.OK, generate_latest(), CONTENT_TYPE_LATEST)
        else:
            self._reply(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        claims, sizer = self.server.claims, self.server.rightsizer
        # /place-pods reads nothing from the API: its answer says only what the request itself does.
        served = {
            "/validate": True,
            "/place-pods": True,
            "/mutate": claims is not None,
            "/rightsize": sizer is not None,
        }
        if not served.get(path):
            self._reply(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")
            return
        length = content_length(self.headers.get("Content-Length"))
        if not 0 < length <= MAX_BODY_BYTES:
            self._reply(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, b"Content-Length missing, malformed or too large\n",
                        "text/plain", close=True)  # fmt: skip
            return
        body = self.rfile.read(length)  # read even to refuse: the connection may carry the next request
        if self.server.client_ca and not self.connection.getpeercert():
            # Before anything is parsed or read: an answer of /mutate tells whether a claim of any
            # namespace the caller names exists and opts in, and only kube-apiserver may ask.
            self._reply(HTTPStatus.FORBIDDEN, b"a client certificate of --client-ca-file is required\n", "text/plain")
            return
        try:
            document = json.loads(body)
            if path == "/mutate" and claims is not None:
                answer = mutate(document, claims, self.server.pod_rules)
            elif path == "/rightsize" and sizer is not None:
                answer = rightsize(document, sizer)
            elif path == "/place-pods":
                answer = place_pods(document)
            else:
                answer = review(document, self.server.driver_name)  # /validate: the only other path served
        except ValueError as err:  # ReviewError, and malformed JSON
            LOG.warning("bad admission request from %s: %s", self.client_address[0], err)
            self._reply(HTTPStatus.BAD_REQUEST, f"{err}\n".encode(), "text/plain")
            return
        response = answer["response"]
        if path == "/mutate":
            result = review_result(answer)
        else:
            patched = "sized" if path == "/rightsize" else "gated"
            result = patched if "patch" in response else "allowed" if response["allowed"] else "denied"
        REVIEWS.labels(kind=metric_kind(document), result=result).inc()
        if not response["allowed"]:
            LOG.info("denied: %s", response["status"]["message"])
        self._reply(HTTPStatus.OK, json.dumps(answer).encode(), "application/json")

    def _reply(self, status: HTTPStatus, body: bytes, content_type: str, close: bool = False) -> None:
        """`close`: the request's body was not read, so the connection cannot carry another."""
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if close or self.certificate != self.server.certificate:
            # Made with a certificate since replaced: the client's next request opens a connection
            # with the new one, so a renewal reaches kube-apiserver's kept-alive connections too.
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        LOG.debug("%s " + format, self.client_address[0], *args)


class WebhookServer(BoundedHTTPServer):
    def __init__(
        self,
        settings: WebhookSettings,
        tls: ssl.SSLContext,
        claims: ClaimReader | None = None,
        client_ca: bytes = b"",
        limits: ConnectionLimits = LIMITS,
        rightsizer: Rightsizer | None = None,
    ) -> None:
        self.driver_name = settings.driver_name
        self.claims = claims  # /mutate answers only with a reader (--gate-pods, --gpu-pods-toleration)
        self.pod_rules = PodRules(settings.gate_pods, settings.gpu_pods_toleration, settings.driver_name)
        self.rightsizer = rightsizer  # /rightsize only with one (--rightsize-history-namespace)
        self.client_ca = client_ca  # reviews only for a client certificate of this CA, when given
        self._tls = (0, tls)  # (the certificate's number, its context): swapped as one
        self._connection = threading.local()  # each connection has a thread of its own
        super().__init__((settings.bind_address, settings.port), _Handler, limits)

    @property
    def certificate(self) -> int:
        """The number of the certificate served now: 0, then 1 after the first set_certificate ..."""
        return self._tls[0]

    def connection_certificate(self) -> int:
        """The number of the certificate the calling connection's handshake used."""
        return self._connection.certificate

    def set_certificate(self, cert: bytes, key: bytes) -> None:
        """Serve this certificate from the next handshake on; connections made with the old one
        close after their next answer."""
        self._tls = (self._tls[0] + 1, tls_context(cert, key, self.client_ca))

    def finish_request(self, request: Any, client_address: Any) -> None:
        # The TLS handshake in the connection's own thread: a slow client cannot hold up accept().
        request.settimeout(HANDSHAKE_TIMEOUT_S)
        self._connection.certificate, tls = self._tls
        with tls.wrap_socket(request, server_side=True) as connection:
            super().finish_request(connection, client_address)  # and from here the idle timeout

    def handle_error(self, request: Any, client_address: Any) -> None:
        LOG.debug("connection from %s failed", client_address[0], exc_info=True)  # e.g. a TLS handshake


def certificate_source(settings: WebhookSettings) -> SelfManaged | MountedFiles:
    if settings.tls_secret or settings.webhook_configuration:
        api = ClientCertApi(settings.kubeconfig)
    if settings.tls_secret:
        return SelfManaged(api, settings.namespace, settings.tls_secret, settings.hosts, settings.lifetimes,
                           settings.webhook_configuration, mutating=settings.mutating_configuration)  # fmt: skip
    assert settings.cert_file is not None and settings.key_file is not None
    publisher = (CaBundlePublisher(api, settings.webhook_configuration, settings.mutating_configuration)
                 if settings.ca_file else None)  # fmt: skip
    return MountedFiles(settings.cert_file, settings.key_file, settings.ca_file, publisher)


def client_ca_bundle(settings: WebhookSettings) -> bytes:
    """The CAs of --client-ca-file (PEM; read once, at start), or b"" without the flag."""
    if settings.client_ca_file is None:
        return b""
    try:
        bundle = settings.client_ca_file.read_bytes()
        # Loaded once here so that a bad file is refused at start, not at the first handshake.
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(cadata=bundle.decode())
    except (OSError, ValueError) as err:  # ssl.SSLError is an OSError; UnicodeDecodeError a ValueError
        raise ValueError(f"--client-ca-file: cannot load {settings.client_ca_file}: {err}") from err
    return bundle


def run_webhook(settings: WebhookSettings) -> None:
    """Serve until SIGTERM or SIGINT."""
    settings.check()
    tls: list[ssl.SSLContext] = []
    server: WebhookServer | None = None
    client_ca = client_ca_bundle(settings)

    def serve(cert: bytes, key: bytes) -> None:
        if server is None:
            tls[:] = [tls_context(cert, key, client_ca)]
        else:
            server.set_certificate(cert, key)

    rotator = Rotator(certificate_source(settings), serve, settings.check_interval_s)

    def stop(*_: object) -> None:
        rotator.stopped.set()
        if server is not None:
            threading.Thread(target=server.shutdown).start()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)
    if settings.tls_secret:
        try:
            rotator.first()  # the API server may not answer yet: retried
        except InterruptedError:
            return
    else:
        try:
            rotator.first(retry=False)
        except (OSError, ValueError) as err:  # ssl.SSLError is an OSError
            flags = "--tls-cert-file/--tls-private-key-file"
            raise ValueError(f"{flags}: cannot load {settings.cert_file}: {err}") from err
    mutates_pods = settings.gate_pods or bool(settings.gpu_pods_toleration)
    api = ClientCertApi(settings.kubeconfig) if mutates_pods or settings.rightsize_history_namespace else None
    claims = api if mutates_pods else None
    sizer = (
        Rightsizer(api, settings.rightsize_history_namespace, driver=settings.driver_name)
        if api and settings.rightsize_history_namespace
        else None
    )
    server = WebhookServer(settings, tls[0], claims, client_ca, rightsizer=sizer)
    if rotator.stopped.is_set():
        return
    rotator.start()
    LOG.info("validating %s configs on https://%s:%d/validate", settings.driver_name, *server.server_address[:2])
    if settings.gate_pods:
        LOG.info("gating pods of opt-in claims on https://%s:%d/mutate", *server.server_address[:2])
    if settings.gpu_pods_toleration:
        LOG.info("pods of %s's claims tolerate %s:%s, on https://%s:%d/mutate", settings.driver_name,
                 settings.gpu_pods_toleration, EFFECT, *server.server_address[:2])  # fmt: skip
    if sizer is not None:
        LOG.info("sizing new claims that opt in on https://%s:%d/rightsize", *server.server_address[:2])
    try:
        server.serve_forever()
    finally:
        rotator.stop()
        server.server_close()
