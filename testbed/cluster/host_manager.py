"""What a controller manager run as a host process against the test control plane needs, whoever
built it (Kueue's in kueue_manager.py, the workload operators in operators.py): a CA and a serving
certificate for its webhooks, its webhooks called by kube-apiserver at https://127.0.0.1:<port>,
its objects applied and taken out again, and waits for its CRDs and its readiness."""

from __future__ import annotations

import base64
import contextlib
import subprocess
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
import kubernetes.dynamic
from kubernetes.dynamic.exceptions import NotFoundError

from testbed.cluster.harness import Cluster, poll_until

# Kueue's cert-controller renews what expires within 90 days; these outlive any test run by far.
CA_VALIDITY_DAYS = 3650
SERVING_VALIDITY_DAYS = 365
FIELD_MANAGER = "fgpu-testbed"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@dataclass(frozen=True)
class ServingCertificate:
    """PEM texts of a CA and of a serving certificate it signed."""

    ca_crt: str
    ca_key: str
    tls_crt: str
    tls_key: str

    @property
    def ca_bundle(self) -> str:
        """The CA as a webhook's clientConfig.caBundle takes it."""
        return base64.b64encode(self.ca_crt.encode()).decode()

    def write_serving(self, directory: Path) -> None:
        """tls.crt and tls.key, as a controller-runtime webhook server reads them from its CertDir
        (in a cluster: the Secret's mount)."""
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        (directory / "tls.crt").write_text(self.tls_crt)
        (directory / "tls.key").write_text(self.tls_key)


def serving_certificate(
    directory: Path, ca_name: str, common_name: str, dns_names: Sequence[str]
) -> ServingCertificate:
    """A CA named ca_name (also in its SANs: Kueue's cert-controller checks its CA by that name) and
    a serving certificate for dns_names and 127.0.0.1 (what kube-apiserver dials). RSA keys in PKCS#1:
    what cert-controller parses (driver/admission/certs.py's ECDSA keys it refuses)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = {name: str(directory / name) for name in ("ca.crt", "ca.key", "tls.crt", "tls.key", "tls.csr", "tls.ext")}
    _openssl("genrsa", "-traditional", "-out", path["ca.key"], "2048")
    _openssl("req", "-x509", "-new", "-key", path["ca.key"], "-days", str(CA_VALIDITY_DAYS), "-subj", f"/CN={ca_name}",
             "-addext", f"subjectAltName=DNS:{ca_name}", "-out", path["ca.crt"])  # fmt: skip
    _openssl("genrsa", "-traditional", "-out", path["tls.key"], "2048")
    _openssl("req", "-new", "-key", path["tls.key"], "-subj", f"/CN={common_name}", "-out", path["tls.csr"])
    names = ",".join([*(f"DNS:{name}" for name in dns_names), "IP:127.0.0.1"])
    Path(path["tls.ext"]).write_text(f"subjectAltName={names}\nextendedKeyUsage=serverAuth\n")
    _openssl("x509", "-req", "-in", path["tls.csr"], "-CA", path["ca.crt"], "-CAkey", path["ca.key"],
             "-CAcreateserial", "-days", str(SERVING_VALIDITY_DAYS), "-extfile", path["tls.ext"],
             "-out", path["tls.crt"])  # fmt: skip
    text = {name: Path(path[name]).read_text() for name in ("ca.crt", "ca.key", "tls.crt", "tls.key")}
    return ServingCertificate(text["ca.crt"], text["ca.key"], text["tls.crt"], text["tls.key"])


def served_from_host(webhook: dict[str, Any], port: int, ca_bundle: str | None = None) -> dict[str, Any]:
    """A webhook of a configuration written for a Service, pointed at the manager on the host at
    the same path. Without ca_bundle the manager writes it in (Kueue's cert-controller)."""
    path = webhook["clientConfig"]["service"]["path"]
    client_config: dict[str, Any] = {"url": f"https://127.0.0.1:{port}{path}"}
    if ca_bundle is not None:
        client_config["caBundle"] = ca_bundle
    return {**webhook, "clientConfig": client_config}


@dataclass
class AppliedObjects:
    """Objects a manager's start applied to the cluster; what it created, remove() takes out again,
    newest first, and waits until it is gone."""

    cluster: Cluster
    created: list[tuple[str, str, str]] = field(default_factory=list)  # apiVersion, kind, name

    def _dynamic(self) -> kubernetes.dynamic.DynamicClient:
        return kubernetes.dynamic.DynamicClient(self.cluster.api_client(), cache_file=self.cluster.discovery_cache)

    def apply(self, obj: dict[str, Any], created: bool = False) -> None:
        """Server-side apply: what a failed start left is replaced. `created`: remove() takes it out."""
        dynamic = self._dynamic()
        resource = dynamic.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
        dynamic.server_side_apply(resource, obj, field_manager=FIELD_MANAGER, force_conflicts=True)
        if created:
            self.created.append((obj["apiVersion"], obj["kind"], obj["metadata"]["name"]))

    def remove(self, timeout_s: float) -> None:
        dynamic = self._dynamic()
        for api_version, kind, name in reversed(self.created):
            with contextlib.suppress(NotFoundError):
                dynamic.resources.get(api_version=api_version, kind=kind).delete(name=name)

        def exists(api_version: str, kind: str, name: str) -> bool:
            try:
                dynamic.resources.get(api_version=api_version, kind=kind).get(name=name)
            except NotFoundError:
                return False
            return True

        def gone() -> bool:
            return not any(exists(*created) for created in self.created)

        try:
            poll_until("the objects it added gone", gone, timeout_s, lambda: None)
        finally:
            self.created.clear()


def wait_established(cluster: Cluster, crds: Sequence[str], timeout_s: float) -> None:
    """Until the named CRDs serve their kinds."""
    extensions = kubernetes.client.ApiextensionsV1Api(cluster.api_client())

    def established(name: str) -> bool:
        conditions = extensions.read_custom_resource_definition(name).status.conditions or ()
        return any(c.type == "Established" and c.status == "True" for c in conditions)

    poll_until("the CRDs", lambda: all(established(name) for name in crds), timeout_s, lambda: None)


def exited_check(name: str, process: subprocess.Popen[bytes], logs: Path) -> Callable[[], None]:
    """poll_until's `alive` for a manager: raises with its log's tail once it has exited."""

    def alive() -> None:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{logs.read_text(errors='replace')[-3000:]}")

    return alive


def wait_ready(name: str, health_port: int, timeout_s: float, alive: Callable[[], None]) -> None:
    """Until controller-runtime's /readyz answers 200 (where a manager has webhooks: their server
    listens with its certificate)."""
    readyz = f"http://127.0.0.1:{health_port}/readyz"
    poll_until(f"{name}'s readiness", lambda: urllib.request.urlopen(readyz, timeout=2).status == 200,
               timeout_s, alive)  # fmt: skip
