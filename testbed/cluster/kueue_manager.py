"""Kueue's manager (sigs.k8s.io/kueue, built by build.sh) against the test control plane, as a
process on the host like the other components: its CRDs installed, its webhooks (Kueue's own
kinds and batch Jobs; with integration_webhooks those of the Configuration's integrations too, its
pod webhook for pods of a queue only) called by kube-apiserver at https://127.0.0.1:<port>, with a
certificate made here, and the Configuration a test gives (examples/kueue/configuration.yaml: the DRA
mappings) completed with where it serves.

Kueue keeps its certificate in a Secret and renews it itself (internal certificate management,
cert-controller; without it, Kueue reads its metrics certificate from /etc/kueue on the host): we
put ours there first, valid for its Service's name (what Kueue checks) and for 127.0.0.1 (what
kube-apiserver dials), long enough that Kueue keeps it. In a cluster kubelet mounts that Secret as
Kueue's certificate directory, and Kueue waits for the files there before it starts: we write them
as that mount would. Kueue then writes the CA into the webhook configurations' and CRDs' caBundle.
"""

from __future__ import annotations

import copy
import datetime
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
import yaml

from testbed.cluster.harness import Cluster, free_port, poll_until, spawn, stop_process
from testbed.cluster.host_manager import (
    AppliedObjects,
    exited_check,
    served_from_host,
    serving_certificate,
    wait_established,
    wait_ready,
)

NAMESPACE = "kueue-system"
SERVICE = "kueue-webhook-service"  # Kueue derives its webhook configurations' names from it
SECRET = "kueue-webhook-server-cert"
WEBHOOK_CONFIGURATIONS = {
    "MutatingWebhookConfiguration": "kueue-mutating-webhook-configuration",
    "ValidatingWebhookConfiguration": "kueue-validating-webhook-configuration",
}
CA_NAME = "kueue-ca"  # cert-controller accepts a CA only with this name among its own
START_TIMEOUT_S = 90


QUEUED_PODS = {"matchExpressions": [{"key": "kueue.x-k8s.io/queue-name", "operator": "Exists"}]}


def _webhook_is_ours(webhook: dict[str, Any], frameworks: Sequence[str] = ()) -> bool:
    """Kueue's own kinds and batch Jobs, and with `frameworks` (Kueue's integration names,
    `<group>/<kind>`: `jobset.x-k8s.io/jobset`, `pod`) those kinds' webhooks too: the webhooks of
    integrations not on here would take every Pod, Deployment and StatefulSet of the other tests."""
    path = webhook["clientConfig"]["service"]["path"]
    if "kueue-x-k8s-io" in path or path.endswith("-batch-v1-job"):
        return True
    core = {"pod": ("", "pod"), "deployment": ("apps", "deployment"), "statefulset": ("apps", "statefulset")}
    kinds = {tuple(name.rsplit("/", 1)) if "/" in name else core.get(name) for name in frameworks}
    return any(
        (group, resource.removesuffix("s")) in kinds
        for rule in webhook.get("rules") or ()
        for group in rule.get("apiGroups") or ()
        for resource in rule.get("resources") or ()
    )


def _only_queued_pods(webhook: dict[str, Any]) -> dict[str, Any]:
    """Kueue's pod webhooks for the pods of a queue only (a LeaderWorkerSet's pods: Kueue's LWS
    webhook puts the queue's label on its templates), so that no other test's pod reaches them."""
    rules = webhook.get("rules") or ()
    if any("pods" in (rule.get("resources") or ()) for rule in rules):
        return {**webhook, "objectSelector": QUEUED_PODS}
    return webhook


def integration_frameworks(configuration: dict[str, Any]) -> list[str]:
    """The integrations a Configuration turns on, with those they turn on implicitly (Kueue runs
    LeaderWorkerSets, Deployments and StatefulSets as pod groups: its `pod` integration)."""
    frameworks = list((configuration.get("integrations") or {}).get("frameworks") or ())
    implicit = ("leaderworkerset.x-k8s.io/leaderworkerset", "deployment", "statefulset")
    if any(name in frameworks for name in implicit) and "pod" not in frameworks:
        frameworks.append("pod")
    return frameworks


def certificate_secret(directory: Path) -> dict[str, Any]:
    """Kueue's Secret with a CA named kueue-ca and a serving certificate for its Service made here,
    both valid past cert-controller's 90-day renewal."""
    certificate = serving_certificate(directory, CA_NAME, SERVICE, [f"{SERVICE}.{NAMESPACE}.svc"])
    pem = {"ca.crt": certificate.ca_crt, "ca.key": certificate.ca_key}
    pem |= {"tls.crt": certificate.tls_crt, "tls.key": certificate.tls_key}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": SECRET, "namespace": NAMESPACE},
        "stringData": pem,
    }


def webhook_configurations(manifests: str, port: int, frameworks: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Kueue's webhook configurations, ours only (and those of `frameworks`), pointed at the manager
    on the host; Kueue fills in the caBundle."""
    configurations = []
    for document in yaml.safe_load_all(manifests):
        chosen = [w for w in document["webhooks"] if _webhook_is_ours(w, frameworks)]
        webhooks = [served_from_host(_only_queued_pods(webhook), port) for webhook in chosen]
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
    # The webhooks of the Configuration's integrations too (Kueue's webhooks suspend a JobSet,
    # TrainJob or RayJob at creation, label an LWS's pod templates and gate its pods); off, as
    # tests/e2e/test_kueue.py runs it: Kueue's own kinds and batch Jobs only.
    integration_webhooks: bool = False
    process: subprocess.Popen[bytes] | None = None
    _applied: AppliedObjects | None = field(default=None, repr=False)

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
        applied = self._applied = AppliedObjects(self.cluster)
        applied.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}, created=True)
        webhook_port, health_port = free_port(), free_port()
        converted = converted_crds((config_dir / "crd-kustomization.yaml").read_text())
        crds = [yaml.safe_load(path.read_text()) for path in sorted((config_dir / "crds").glob("*.yaml"))]
        for crd in crds:
            applied.apply(with_conversion(crd, webhook_port) if crd["metadata"]["name"] in converted else crd, True)
        wait_established(self.cluster, [crd["metadata"]["name"] for crd in crds], START_TIMEOUT_S)
        core.delete_collection_namespaced_secret(NAMESPACE, field_selector=f"metadata.name={SECRET}")
        secret = certificate_secret(self.workdir / "pki")
        applied.apply(secret)
        cert_dir = self.workdir / "certs"  # the Secret's mount in a cluster
        cert_dir.mkdir(mode=0o700, exist_ok=True)
        for name in ("tls.crt", "tls.key"):
            (cert_dir / name).write_text(secret["stringData"][name])
        frameworks = integration_frameworks(self.configuration) if self.integration_webhooks else []
        manifests = (config_dir / "webhooks.yaml").read_text()
        for configuration in webhook_configurations(manifests, webhook_port, frameworks):
            applied.apply(configuration, created=True)
        config_file = self.workdir / "configuration.yaml"
        config = manager_configuration(self.configuration, self.workdir, webhook_port, health_port)
        config_file.write_text(yaml.safe_dump(config))
        logs = self.workdir / "kueue.log"
        argv = [str(self.cluster.binaries / "kueue"), f"--config={config_file}", "--zap-log-level=3"]
        self.process = spawn(argv, logs, env={"KUBECONFIG": str(self.cluster.kubeconfig), "PATH": "/usr/bin:/bin"})
        started = datetime.datetime.now()
        alive = exited_check("kueue", self.process, logs)
        wait_ready("kueue", health_port, START_TIMEOUT_S, alive)
        poll_until("kueue's webhooks", lambda: self._webhooks_answer(client), START_TIMEOUT_S, alive)
        print(f"kueue up in {(datetime.datetime.now() - started).total_seconds():.1f}s ({logs})")
        return self

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
        try:
            if self._applied is not None:
                self._applied.remove(START_TIMEOUT_S)
        finally:
            if self.process is not None:
                stop_process(self.process)
                self.process = None
