"""Kueue's manager (sigs.k8s.io/kueue, built by build.sh) against the test control plane, as a
process on the host like the other components: its CRDs installed, its webhooks (Kueue's own
kinds and batch Jobs) called by kube-apiserver at https://127.0.0.1:<port>, with a certificate
made here, and the Configuration a test gives (examples/kueue/configuration.yaml: the DRA
mappings) completed with where it serves.

Kueue keeps its certificate in a Secret and renews it itself (internal certificate management,
cert-controller; without it, Kueue reads its metrics certificate from /etc/kueue on the host): we
put ours there first, valid for its Service's name (what Kueue checks) and for 127.0.0.1 (what
kube-apiserver dials), long enough that Kueue keeps it. In a cluster kubelet mounts that Secret as
Kueue's certificate directory, and Kueue waits for the files there before it starts: we write them
as that mount would. Kueue then writes the CA into the webhook configurations' and CRDs' caBundle.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import subprocess
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
import kubernetes.dynamic
import yaml
from kubernetes.dynamic.exceptions import NotFoundError

from testbed.cluster.harness import Cluster, free_port, poll_until, spawn, stop_process

NAMESPACE = "kueue-system"
SERVICE = "kueue-webhook-service"  # Kueue derives its webhook configurations' names from it
SECRET = "kueue-webhook-server-cert"
WEBHOOK_CONFIGURATIONS = {
    "MutatingWebhookConfiguration": "kueue-mutating-webhook-configuration",
    "ValidatingWebhookConfiguration": "kueue-validating-webhook-configuration",
}
CA_NAME = "kueue-ca"  # cert-controller accepts a CA only with this name among its own
# cert-controller renews what expires within 90 days; ours outlive any test run by far.
CA_VALIDITY_DAYS = 3650
SERVING_VALIDITY_DAYS = 365
START_TIMEOUT_S = 90


def _webhook_is_ours(webhook: dict[str, Any]) -> bool:
    """Kueue's own kinds and batch Jobs: the webhooks of integrations not on here would take
    every Pod, Deployment and StatefulSet of the other tests."""
    path = webhook["clientConfig"]["service"]["path"]
    return "kueue-x-k8s-io" in path or path.endswith("-batch-v1-job")


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def certificate_secret(directory: Path) -> dict[str, Any]:
    """Kueue's Secret with a CA and a serving certificate made here. RSA keys in PKCS#1 (what
    cert-controller parses: driver/admission/certs.py's ECDSA keys it refuses), the CA named
    kueue-ca in its SANs (it checks the CA by that name), both valid past its 90-day renewal."""
    directory.mkdir(parents=True, exist_ok=True)
    path = {name: str(directory / name) for name in ("ca.crt", "ca.key", "tls.crt", "tls.key", "tls.csr", "tls.ext")}
    _openssl("genrsa", "-traditional", "-out", path["ca.key"], "2048")
    _openssl("req", "-x509", "-new", "-key", path["ca.key"], "-days", str(CA_VALIDITY_DAYS), "-subj", f"/CN={CA_NAME}",
             "-addext", f"subjectAltName=DNS:{CA_NAME}", "-out", path["ca.crt"])  # fmt: skip
    _openssl("genrsa", "-traditional", "-out", path["tls.key"], "2048")
    _openssl("req", "-new", "-key", path["tls.key"], "-subj", f"/CN={SERVICE}", "-out", path["tls.csr"])
    Path(path["tls.ext"]).write_text(
        f"subjectAltName=DNS:{SERVICE}.{NAMESPACE}.svc,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"
    )
    _openssl("x509", "-req", "-in", path["tls.csr"], "-CA", path["ca.crt"], "-CAkey", path["ca.key"],
             "-CAcreateserial", "-days", str(SERVING_VALIDITY_DAYS), "-extfile", path["tls.ext"],
             "-out", path["tls.crt"])  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": SECRET, "namespace": NAMESPACE},
        "stringData": {name: Path(path[name]).read_text() for name in ("ca.crt", "ca.key", "tls.crt", "tls.key")},
    }


def webhook_configurations(manifests: str, port: int) -> list[dict[str, Any]]:
    """Kueue's webhook configurations, ours only, pointed at the manager on the host; Kueue
    fills in the caBundle."""
    configurations = []
    for document in yaml.safe_load_all(manifests):
        webhooks = []
        for webhook in filter(_webhook_is_ours, document["webhooks"]):
            path = webhook["clientConfig"]["service"]["path"]
            webhooks.append({**webhook, "clientConfig": {"url": f"https://127.0.0.1:{port}{path}"}})
        name = WEBHOOK_CONFIGURATIONS[document["kind"]]
        configurations.append({**document, "metadata": {"name": name}, "webhooks": webhooks})
    return configurations


def converted_crds(kustomization: str) -> set[str]:
    """The CRDs Kueue's own install gives a conversion webhook (its kustomization's patches
    webhook_in_<plural>.yaml): its certificate manager injects the CA there too, and waits for it."""
    patches = [p["path"] for p in yaml.safe_load(kustomization).get("patches") or ()]
    return {
        f"{Path(path).stem.removeprefix('webhook_in_')}.kueue.x-k8s.io"
        for path in patches
        if Path(path).stem.startswith("webhook_in_")
    }


def with_conversion(crd: dict[str, Any], port: int) -> dict[str, Any]:
    conversion = {
        "strategy": "Webhook",
        "webhook": {"clientConfig": {"url": f"https://127.0.0.1:{port}/convert"}, "conversionReviewVersions": ["v1"]},
    }
    return {**crd, "spec": {**crd["spec"], "conversion": conversion}}


def manager_configuration(user: dict[str, Any], workdir: Path, webhook_port: int, health_port: int) -> dict:
    """The user's Configuration with where this manager serves, keeps its certificate and that it
    runs alone (no leader election)."""
    configuration = copy.deepcopy(user)
    configuration.update(
        namespace=NAMESPACE,
        health={"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        metrics={"bindAddress": "0"},
        webhook={"port": webhook_port, "host": "127.0.0.1", "certDir": str(workdir / "certs")},
        leaderElection={"leaderElect": False},
        internalCertManagement={"enable": True, "webhookServiceName": SERVICE, "webhookSecretName": SECRET},
    )
    # The visibility API server would listen on 0.0.0.0:8082 and needs an APIService: not used here.
    configuration["featureGates"] = {**configuration.get("featureGates", {}), "VisibilityOnDemand": False}
    return configuration


@dataclass
class KueueManager:
    cluster: Cluster
    configuration: dict[str, Any]  # a config.kueue.x-k8s.io/v1beta2 Configuration
    workdir: Path
    process: subprocess.Popen[bytes] | None = None
    _created: list[tuple[str, str, str]] = field(default_factory=list)  # apiVersion, kind, name

    def start(self) -> KueueManager:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> KueueManager:
        assert self.cluster.binaries is not None
        config_dir = self.cluster.binaries / "kueue-config"
        self.workdir.mkdir(parents=True, exist_ok=True)
        client = self.cluster.api_client()
        core = kubernetes.client.CoreV1Api(client)
        self._apply(client, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}, created=True)
        webhook_port, health_port = free_port(), free_port()
        converted = converted_crds((config_dir / "crd-kustomization.yaml").read_text())
        for path in sorted((config_dir / "crds").glob("*.yaml")):
            crd = yaml.safe_load(path.read_text())
            crd = with_conversion(crd, webhook_port) if crd["metadata"]["name"] in converted else crd
            self._apply(client, crd, created=True)
        self._wait_for_crds(client)
        core.delete_collection_namespaced_secret(NAMESPACE, field_selector=f"metadata.name={SECRET}")
        secret = certificate_secret(self.workdir / "pki")
        self._apply(client, secret)
        cert_dir = self.workdir / "certs"  # the Secret's mount in a cluster
        cert_dir.mkdir(mode=0o700, exist_ok=True)
        for name in ("tls.crt", "tls.key"):
            (cert_dir / name).write_text(secret["stringData"][name])
        for configuration in webhook_configurations((config_dir / "webhooks.yaml").read_text(), webhook_port):
            self._apply(client, configuration, created=True)
        config_file = self.workdir / "configuration.yaml"
        config = manager_configuration(self.configuration, self.workdir, webhook_port, health_port)
        config_file.write_text(yaml.safe_dump(config))
        logs = self.workdir / "kueue.log"
        argv = [str(self.cluster.binaries / "kueue"), f"--config={config_file}", "--zap-log-level=3"]
        self.process = spawn(argv, logs, env={"KUBECONFIG": str(self.cluster.kubeconfig), "PATH": "/usr/bin:/bin"})
        started = datetime.datetime.now()

        def alive() -> None:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"kueue exited with {self.process.returncode}:\n{logs.read_text()[-3000:]}")

        readyz = f"http://127.0.0.1:{health_port}/readyz"
        poll_until("kueue's readiness", lambda: urllib.request.urlopen(readyz, timeout=2).status == 200,
                   START_TIMEOUT_S, alive)  # fmt: skip
        poll_until("kueue's webhooks", lambda: self._webhooks_answer(client), START_TIMEOUT_S, alive)
        print(f"kueue up in {(datetime.datetime.now() - started).total_seconds():.1f}s ({logs})")
        return self

    def _apply(self, client: kubernetes.client.ApiClient, obj: dict[str, Any], created: bool = False) -> None:
        """Server-side apply: what a failed start left is replaced. `created`: stop() takes it out."""
        dynamic = kubernetes.dynamic.DynamicClient(client, cache_file=self.cluster.discovery_cache)
        resource = dynamic.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
        dynamic.server_side_apply(resource, obj, field_manager="fgpu-testbed", force_conflicts=True)
        if created:
            self._created.append((obj["apiVersion"], obj["kind"], obj["metadata"]["name"]))

    @staticmethod
    def _wait_for_crds(client: kubernetes.client.ApiClient) -> None:
        extensions = kubernetes.client.ApiextensionsV1Api(client)

        def established() -> bool:
            crds = [c for c in extensions.list_custom_resource_definition().items if c.spec.group == "kueue.x-k8s.io"]
            return bool(crds) and all(
                any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or ()) for crd in crds
            )

        poll_until("kueue's CRDs", established, START_TIMEOUT_S, lambda: None)

    @staticmethod
    def _webhooks_answer(client: kubernetes.client.ApiClient) -> bool:
        """A dry-run ResourceFlavor passes Kueue's webhooks once kube-apiserver reaches them with
        the caBundle Kueue wrote."""
        custom = kubernetes.client.CustomObjectsApi(client)
        flavor = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "probe"}}
        custom.create_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "resourceflavors", flavor, dry_run="All")
        return True

    def stop(self) -> None:
        """Takes out what start() added, newest first, and then stops the manager: the cluster
        outlives this module. The webhook configurations go first (with Kueue gone they would refuse
        every Job), then the CRDs, while Kueue runs to remove its finalizers from what is left
        (their conversion webhooks would point at nothing), and its namespace."""
        client = self.cluster.api_client()
        dynamic = kubernetes.dynamic.DynamicClient(client, cache_file=self.cluster.discovery_cache)
        for api_version, kind, name in reversed(self._created):
            with contextlib.suppress(NotFoundError):
                dynamic.resources.get(api_version=api_version, kind=kind).delete(name=name)

        def exists(api_version: str, kind: str, name: str) -> bool:
            try:
                dynamic.resources.get(api_version=api_version, kind=kind).get(name=name)
            except NotFoundError:
                return False
            return True

        def gone() -> bool:
            return not any(exists(*created) for created in self._created)

        try:
            poll_until("kueue's objects gone", gone, START_TIMEOUT_S, lambda: None)
        finally:
            self._created.clear()
            if self.process is not None:
                stop_process(self.process)
                self.process = None
