"""`fgpu webhook`: the validating admission webhook over HTTPS (kube-apiserver calls only HTTPS).

POST /validate answers an AdmissionReview (driver/admission/review.py); GET /healthz is the probes'
endpoint; GET /metrics Prometheus' text format. The certificate is read at start: the chart rolls
the pods when its Secret changes.
"""

from __future__ import annotations

import json
import logging
import signal
import ssl
import threading
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest

from driver.admission.review import review

LOG = logging.getLogger("fgpu.webhook")
# etcd's request limit is 1.5 MiB: no object kube-apiserver sends is larger than this.
MAX_BODY_BYTES = 3 * 2**20
HANDSHAKE_TIMEOUT_S = 10.0
REVIEWS = Counter("fgpu_webhook_reviews_total", "Admission reviews answered", ["kind", "result"])


@dataclass(frozen=True)
class WebhookSettings:
    driver_name: str
    bind_address: str
    port: int
    cert_file: Path
    key_file: Path


def tls_context(settings: WebhookSettings) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(settings.cert_file, settings.key_file)
    except (OSError, ssl.SSLError) as err:
        raise ValueError(f"--tls-cert-file/--tls-private-key-file: cannot load {settings.cert_file}: {err}") from err
    return context


class _Handler(BaseHTTPRequestHandler):
    server: WebhookServer
    protocol_version = "HTTP/1.1"  # kube-apiserver keeps connections open between reviews

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._reply(HTTPStatus.OK, b"ok\n", "text/plain")
        elif self.path == "/metrics":
            self._reply(HTTPStatus.OK, generate_latest(), CONTENT_TYPE_LATEST)
        else:
            self._reply(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")

    def do_POST(self) -> None:
        if self.path.split("?", 1)[0] != "/validate":
            self._reply(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")
            return
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_BODY_BYTES:
            self._reply(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, b"body missing or too large\n", "text/plain")
            return
        try:
            document = json.loads(self.rfile.read(length))
            answer = review(document, self.server.driver_name)
        except ValueError as err:  # ReviewError, and malformed JSON
            LOG.warning("bad admission request from %s: %s", self.client_address[0], err)
            self._reply(HTTPStatus.BAD_REQUEST, f"{err}\n".encode(), "text/plain")
            return
        response = answer["response"]
        kind = document["request"].get("kind", {}).get("kind", "")
        REVIEWS.labels(kind=kind, result="allowed" if response["allowed"] else "denied").inc()
        if not response["allowed"]:
            LOG.info("denied: %s", response["status"]["message"])
        self._reply(HTTPStatus.OK, json.dumps(answer).encode(), "application/json")

    def _reply(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        LOG.debug("%s " + format, self.client_address[0], *args)


class WebhookServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, settings: WebhookSettings) -> None:
        self.driver_name = settings.driver_name
        self.tls = tls_context(settings)
        super().__init__((settings.bind_address, settings.port), _Handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        # The TLS handshake in the connection's own thread: a slow client cannot hold up accept().
        request.settimeout(HANDSHAKE_TIMEOUT_S)
        with self.tls.wrap_socket(request, server_side=True) as connection:
            connection.settimeout(None)
            super().finish_request(connection, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        LOG.debug("connection from %s failed", client_address[0], exc_info=True)  # e.g. a TLS handshake


def run_webhook(settings: WebhookSettings) -> None:
    """Serve until SIGTERM or SIGINT."""
    server = WebhookServer(settings)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: threading.Thread(target=server.shutdown).start())
    LOG.info("validating %s configs on https://%s:%d/validate", settings.driver_name, *server.server_address[:2])
    try:
        server.serve_forever()
    finally:
        server.server_close()
