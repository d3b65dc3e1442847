"""Where the webhook's serving certificate comes from, and how a new one reaches the running server.

- `SelfManaged` (the chart's default): the CA and serving certificate live in a Secret the webhook
  makes itself, create-if-absent, so that replicas started together agree (one create wins, the
  others read the winner's); renewed before expiry by whichever replica sees it first (an update
  conditioned on the Secret's resourceVersion: the loser of a race reads the winner's); the CAs
  copied into the caBundle of every webhook of the ValidatingWebhookConfiguration (and of the
  MutatingWebhookConfiguration that gates pods, when there is one).
- `MountedFiles` (cert-manager, or a Secret the operator gives): PEM files read again when they
  change (kubelet updates a mounted Secret in place); optionally a CA file copied into the caBundle.

Both are polled (`interval_s`): each round reads the Secret or files and the configuration, writes
what differs, and hands a changed certificate to `serve` (the server swaps its TLS context; open
connections keep theirs, new handshakes get the new certificate). A configuration whose caBundle was
wiped (a GitOps tool replacing the object, or an upgrade from a chart that rendered it) is written
again on the next round.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import kubernetes

from driver.admission import certs
from driver.kube.client import translated_errors
from driver.kube.errors import ConflictError, KubeConfigError, KubeError, NotFoundError
from driver.sizing import store

LOG = logging.getLogger("fgpu.webhook")
FIELD_MANAGER = "fgpu-webhook"
STRATEGIC_MERGE = "application/strategic-merge-patch+json"
# A certificate of a CA the caBundle did not hold before is served only after kube-apiserver had
# this long to see the new caBundle (its informer): meanwhile the old certificate, still valid, serves.
CA_SETTLE_S = 3.0
# One round's reads and writes, when an update lost a race: read again and decide again.
ROUNDS = 5

Serve = Callable[[bytes, bytes], None]  # (certificate PEM, key PEM)


HISTORY_PAGE = 8  # usage-history ConfigMaps a page (each up to 1 MiB)
MAX_HISTORIES = 2000  # nodes' histories read for automatic sizing, at most
VALIDATING = "ValidatingWebhookConfiguration"
MUTATING = "MutatingWebhookConfiguration"


class CertApi(Protocol):
    """What certificate management needs from the API server: one Secret, its configurations
    (`kind`: VALIDATING or MUTATING)."""

    def read_secret(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    def create_secret(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]: ...
    def replace_secret(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]: ...
    def read_webhook_configuration(self, name: str, kind: str = VALIDATING) -> dict[str, Any] | None: ...
    def patch_ca_bundle(self, name: str, webhooks: Sequence[str], ca_bundle: bytes, kind: str = VALIDATING) -> None: ...


class ClientCertApi:
    """CertApi over the official client: kubeconfig, or the pod's service account. Also the
    ClaimReader of pod gating (driver/admission/mutate.py) and the RightsizeApi of automatic sizing
    (driver/admission/rightsize.py)."""

    def __init__(self, kubeconfig: str | None, timeout_s: float = 10.0) -> None:
        configuration = kubernetes.client.Configuration()
        try:
            if kubeconfig:
                kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
            else:
                kubernetes.config.load_incluster_config(client_configuration=configuration)
        except (kubernetes.config.ConfigException, OSError) as err:
            where = kubeconfig or "the in-cluster service account (no --kubeconfig given)"
            raise KubeConfigError(f"cannot load the Kubernetes client configuration from {where}: {err}") from err
        configuration.retries = False
        client = kubernetes.client.ApiClient(configuration)
        self._core = kubernetes.client.CoreV1Api(client)
        self._admission = kubernetes.client.AdmissionregistrationV1Api(client)
        self._resource = kubernetes.client.ResourceV1Api(client)
        self._timeout = timeout_s

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        with translated_errors():
            response = method(*args, _preload_content=False, _request_timeout=self._timeout, **kwargs)
        return json.loads(response.data) if response.data else None

    def read_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call(self._core.read_namespaced_secret, name, namespace)
        except NotFoundError:
            return None

    def create_secret(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call(self._core.create_namespaced_secret, namespace, body, field_manager=FIELD_MANAGER)

    def replace_secret(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call(self._core.replace_namespaced_secret, name, namespace, body, field_manager=FIELD_MANAGER)

    def _read(self, method: Any, *args: str) -> dict[str, Any] | None:
        try:
            return self._call(method, *args)
        except NotFoundError:
            return None

    def read_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._read(self._resource.read_namespaced_resource_claim, name, namespace)

    def read_claim_template(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._read(self._resource.read_namespaced_resource_claim_template, name, namespace)

    def read_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._read(self._core.read_namespaced_pod, name, namespace)

    def read_namespace(self, name: str) -> dict[str, Any] | None:
        return self._read(self._core.read_namespace, name)

    def list_usage_histories(self, namespace: str) -> list[dict[str, Any]]:
        """The node plugins' usage-history ConfigMaps (driver/sizing/store.py), a page of a few at a
        time (each up to 1 MiB) and at most MAX_HISTORIES of them: a bounded read."""
        items: list[dict[str, Any]] = []
        token = ""
        while len(items) < MAX_HISTORIES:
            page = self._call(self._core.list_namespaced_config_map, namespace, limit=HISTORY_PAGE, _continue=token,
                              label_selector=f"{store.COMPONENT_LABEL}={store.COMPONENT}")  # fmt: skip
            items.extend(page.get("items") or ())
            token = (page.get("metadata") or {}).get("continue") or ""
            if not token:
                return items
        LOG.warning("usage history: more than %d ConfigMaps in %s; sizing reads the first", MAX_HISTORIES, namespace)
        return items[:MAX_HISTORIES]

    def list_driver_slices(self, driver: str) -> list[dict[str, Any]]:
        """Every node's ResourceSlices of `driver` (automatic sizing's offers: once a minute)."""
        page = self._call(self._resource.list_resource_slice, field_selector=f"spec.driver={driver}")
        return list(page.get("items") or ())

    def read_webhook_configuration(self, name: str, kind: str = VALIDATING) -> dict[str, Any] | None:
        if kind == MUTATING:
            return self._read(self._admission.read_mutating_webhook_configuration, name)
        return self._read(self._admission.read_validating_webhook_configuration, name)

    def patch_ca_bundle(self, name: str, webhooks: Sequence[str], ca_bundle: bytes, kind: str = VALIDATING) -> None:
        encoded = base64.b64encode(ca_bundle).decode()
        # Strategic merge: the webhooks list merges by name, so only caBundle is written (and owned
        # by this field manager: a server-side apply of the chart's manifests leaves it alone).
        patch = {"webhooks": [{"name": w, "clientConfig": {"caBundle": encoded}} for w in webhooks]}
        method = (self._admission.patch_mutating_webhook_configuration if kind == MUTATING
                  else self._admission.patch_validating_webhook_configuration)  # fmt: skip
        self._call(method, name, patch, field_manager=FIELD_MANAGER, _content_type=STRATEGIC_MERGE)


def _decoded(secret: dict[str, Any]) -> dict[str, bytes]:
    return {key: base64.b64decode(value) for key, value in (secret.get("data") or {}).items()}


def stale_webhooks(configuration: dict[str, Any], ca_bundle: bytes) -> list[str]:
    """The names of the configuration's webhooks whose caBundle is not `ca_bundle`."""
    encoded = base64.b64encode(ca_bundle).decode()
    return [
        w["name"]
        for w in configuration.get("webhooks") or []
        if (w.get("clientConfig") or {}).get("caBundle") != encoded
    ]


@dataclass
class CaBundlePublisher:
    """Keeps every webhook of the ValidatingWebhookConfiguration `name` trusting `ca_bundle`, and of
    the MutatingWebhookConfiguration `mutating` when one is named."""

    api: CertApi
    name: str
    mutating: str = ""
    _missing_logged: set[str] = field(default_factory=set)

    def publish(self, ca_bundle: bytes) -> bool:
        """Writes the caBundle where it differs; True when it wrote. A failure is logged and tried
        again on the next round: the certificate is served meanwhile."""
        targets = [(VALIDATING, self.name)] + ([(MUTATING, self.mutating)] if self.mutating else [])
        written = False
        for kind, name in targets:
            try:
                written = self._publish(kind, name, ca_bundle) or written
            except KubeError as err:
                LOG.warning("caBundle of %s %s not written: %s", kind, name, err)
        return written

    def _publish(self, kind: str, name: str, ca_bundle: bytes) -> bool:
        configuration = self.api.read_webhook_configuration(name, kind)
        if configuration is None:
            if kind not in self._missing_logged:
                LOG.warning("%s %s not found: its caBundle is written once it exists", kind, name)
                self._missing_logged.add(kind)
            return False
        self._missing_logged.discard(kind)
        stale = stale_webhooks(configuration, ca_bundle)
        if stale:
            self.api.patch_ca_bundle(name, stale, ca_bundle, kind)
            LOG.info("caBundle of %s %s written (%s)", kind, name, ", ".join(stale))
        return bool(stale)


def fingerprint(pem: bytes) -> str:
    return hashlib.sha256(pem).hexdigest()[:16]


class SelfManaged:
    """The CA and serving certificate in the Secret `namespace/secret`, made and renewed here."""

    def __init__(
        self,
        api: CertApi,
        namespace: str,
        secret: str,
        hosts: Sequence[str],
        lifetimes: certs.Lifetimes,
        configuration: str = "",
        clock: Callable[[], datetime.datetime] | None = None,
        mutating: str = "",
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.secret = secret
        self.hosts = tuple(hosts)
        self.lifetimes = lifetimes
        self.publisher = CaBundlePublisher(api, configuration, mutating) if configuration else None
        self.clock = clock or (lambda: datetime.datetime.now(datetime.UTC))

    def _secret_body(self, bundle: certs.Bundle, resource_version: str = "") -> dict[str, Any]:
        metadata: dict[str, Any] = {
            "name": self.secret,
            "namespace": self.namespace,
            "labels": {"app.kubernetes.io/managed-by": FIELD_MANAGER},
            "annotations": {"gpu.fgpu.dev/certificate-hosts": ",".join(self.hosts)},
        }
        if resource_version:
            metadata["resourceVersion"] = resource_version
        data = {key: base64.b64encode(value).decode() for key, value in bundle.secret_data().items()}
        return {"apiVersion": "v1", "kind": "Secret", "metadata": metadata, "type": "kubernetes.io/tls", "data": data}

    def current(self) -> certs.Bundle:
        """The bundle to serve: the Secret's, made or renewed first where needed."""
        for _ in range(ROUNDS):
            secret = self.api.read_secret(self.namespace, self.secret)
            if secret is None:
                bundle = certs.issue(self.secret, self.hosts, self.lifetimes, now=self.clock())
                try:
                    self.api.create_secret(self.namespace, self._secret_body(bundle))
                except ConflictError:  # another replica made it first: serve what it made
                    LOG.info("Secret %s/%s made by another replica; reading it", self.namespace, self.secret)
                    continue
                LOG.info("Secret %s/%s made: a new CA and serving certificate, valid until %s",
                         self.namespace, self.secret, f"{bundle.serving_not_after():%Y-%m-%dT%H:%M:%SZ}")  # fmt: skip
                return bundle
            stored = certs.Bundle.from_secret_data(_decoded(secret))
            reason = "keys missing" if stored is None else certs.renewal_reason(stored, self.hosts, self.lifetimes,
                                                                                 self.clock())  # fmt: skip
            if reason is None and stored is not None:
                return stored
            bundle = certs.issue(self.secret, self.hosts, self.lifetimes, previous=stored, now=self.clock())
            body = self._secret_body(bundle, secret["metadata"]["resourceVersion"])
            try:
                self.api.replace_secret(self.namespace, self.secret, body)
            except ConflictError:  # another replica renewed it first: serve what it wrote
                LOG.info("Secret %s/%s renewed by another replica; reading it", self.namespace, self.secret)
                continue
            LOG.info("Secret %s/%s renewed (%s): serving certificate valid until %s", self.namespace, self.secret,
                     reason, f"{bundle.serving_not_after():%Y-%m-%dT%H:%M:%SZ}")  # fmt: skip
            return bundle
        raise ConflictError(f"Secret {self.namespace}/{self.secret} kept changing while it was read")

    def sync(self) -> tuple[certs.Bundle, bool]:
        """(the bundle to serve, whether its caBundle was written just now)."""
        bundle = self.current()
        written = self.publisher.publish(bundle.ca_bundle) if self.publisher else False
        return bundle, written


class MountedFiles:
    """A certificate and key from files (a mounted Secret), read again when they change; a CA file,
    when given, copied into the configuration's caBundle."""

    def __init__(self, cert_file: Path, key_file: Path, ca_file: Path | None = None,
                 publisher: CaBundlePublisher | None = None) -> None:  # fmt: skip
        self.cert_file = cert_file
        self.key_file = key_file
        self.ca_file = ca_file
        self.publisher = publisher

    def sync(self) -> tuple[certs.Bundle, bool]:
        cert, key = self.cert_file.read_bytes(), self.key_file.read_bytes()
        written = False
        ca = b""
        if self.ca_file is not None:
            ca = self.ca_file.read_bytes()
            if self.publisher is not None and ca.strip():
                written = self.publisher.publish(ca)
        return certs.Bundle(ca, b"", cert, key), written


class CertificateSource(Protocol):
    def sync(self) -> tuple[certs.Bundle, bool]: ...


class Rotator:
    """Polls a source and hands a changed certificate to the server."""

    def __init__(self, source: CertificateSource, serve: Serve, interval_s: float,
                 settle_s: float = CA_SETTLE_S) -> None:  # fmt: skip
        self.source = source
        self.serve = serve
        self.interval_s = interval_s
        self.settle_s = settle_s
        self.stopped = threading.Event()
        self._served: bytes = b""
        self._trusted: bytes = b""  # the caBundle last published or seen
        self._thread: threading.Thread | None = None

    def first(self, retry: bool = True) -> None:
        """The first certificate, before the server listens: retried until it comes (or stop());
        without `retry` an error is raised (files the operator gave that cannot be read)."""
        delay = 1.0
        while not self.stopped.is_set():
            try:
                self._round(first=True)
                return
            except (KubeError, OSError, ValueError) as err:
                if not retry:
                    raise
                LOG.error("no serving certificate yet, retrying in %.0fs: %s", delay, err)
                self.stopped.wait(delay)
                delay = min(delay * 2, 30.0)
        raise InterruptedError("stopped before a serving certificate was had")

    def _round(self, first: bool = False) -> None:
        bundle, written = self.source.sync()
        if bundle.cert == self._served:
            self._trusted = bundle.ca_bundle or self._trusted
            return
        new_ca = bool(bundle.ca_bundle) and not certs.trusts(self._trusted, bundle.cert)
        if not first and written and new_ca:
            # kube-apiserver trusts the new CA once it has seen the caBundle just written.
            self.stopped.wait(self.settle_s)
        self.serve(bundle.cert, bundle.key)
        LOG.info("serving certificate %s (valid until %s)", fingerprint(bundle.cert),
                 f"{bundle.serving_not_after():%Y-%m-%dT%H:%M:%SZ}")  # fmt: skip
        self._served = bundle.cert
        self._trusted = bundle.ca_bundle or self._trusted

    def run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            try:
                self._round()
            except (KubeError, OSError, ValueError) as err:
                LOG.warning("certificate check failed, retrying in %.0fs: %s", self.interval_s, err)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="webhook-certificates", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
