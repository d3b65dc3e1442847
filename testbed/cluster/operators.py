"""The workload operators users submit GPU work through (issue 39), each as a process on the host
against the test control plane like Kueue's manager (kueue_manager.py): JobSet, LeaderWorkerSet,
Kubeflow Trainer v2 (its TrainJobs become JobSets: it needs JobSet running) and KubeRay, built by
build.sh from operators/ (KubeRay from operators/kuberay/) with their CRDs and webhook manifests in
<name>-config/. They copy pod templates into the pods they create through their own Go types:
k8s.io/api v0.36.2 (v0.35.0 for KubeRay) keeps spec.resourceClaims, which a k8s.io/api older than
v0.31 drops without a word (tests/e2e/frameworks/test_frameworks.py checks the pods still carry their claims).

Their webhooks are called by kube-apiserver at https://127.0.0.1:<port> with a certificate made
here: each operator's own certificate management (a Secret it fills and a caBundle it injects into
configurations of fixed names) is off, its webhook server reads our tls.crt/tls.key from
controller-runtime's default directory under $TMPDIR (Trainer's configuration has no certDir), and
we write the CA into the configurations. Their pod webhooks keep the objectSelector of their
kustomize patches, so no other test's pods reach them. With the admin kubeconfig they need no RBAC
here, and without leader election or certificate Secrets they need no namespace of their own.

    python -m testbed.cluster.operators   # starts each against a fresh control plane, prints times
"""

from __future__ import annotations

import datetime
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from testbed.cluster.harness import Cluster, free_port, spawn, stop_process
from testbed.cluster.host_manager import (
    AppliedObjects,
    exited_check,
    served_from_host,
    serving_certificate,
    wait_established,
    wait_ready,
)

START_TIMEOUT_S = 90


@dataclass(frozen=True)
class Serving:
    """Where one run of an operator listens and keeps its files."""

    workdir: Path
    health_port: int = field(default_factory=free_port)
    webhook_port: int = field(default_factory=free_port)

    @property
    def cert_dir(self) -> Path:
        """controller-runtime's default CertDir with TMPDIR=workdir."""
        return self.workdir / "k8s-webhook-server" / "serving-certs"

    @property
    def health(self) -> str:
        return f"127.0.0.1:{self.health_port}"


def _manager_configuration(api_version: str, serving: Serving) -> dict[str, Any]:
    """The Configuration JobSet and LWS share (Kueue's shape): served on loopback, no metrics, no
    leader election (one process), certificates from us."""
    return {
        "apiVersion": api_version,
        "kind": "Configuration",
        "health": {"healthProbeBindAddress": serving.health},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": serving.webhook_port, "host": "127.0.0.1", "certDir": str(serving.cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
    }


def _trainer_configuration(serving: Serving) -> dict[str, Any]:
    return {
        "apiVersion": "config.trainer.kubeflow.org/v1alpha1",
        "kind": "Configuration",
        "health": {
            "healthProbeBindAddress": serving.health,
            "readinessEndpointName": "readyz",
            "livenessEndpointName": "healthz",
        },
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": serving.webhook_port, "host": "127.0.0.1"},  # no certDir: see TMPDIR
        "leaderElection": {"leaderElect": False},
        "certManagement": {"enable": False},
    }


def _kuberay_flags(serving: Serving) -> list[str]:
    return [
        f"--health-probe-bind-address={serving.health}",
        "--metrics-addr=0",
        "--enable-leader-election=false",
        "--log-stdout-encoder=console",
    ]


@dataclass(frozen=True)
class OperatorSpec:
    """How one operator runs on the host."""

    name: str  # its binary and <name>-config/ in build.sh's output
    configuration: Callable[[Serving], dict[str, Any]] | None = None  # the --config file's content
    flags: Callable[[Serving], list[str]] = lambda _: []
    env: Mapping[str, str] = field(default_factory=dict)


JOBSET = OperatorSpec("jobset", lambda s: _manager_configuration("config.jobset.x-k8s.io/v1alpha1", s))
LWS = OperatorSpec("lws", lambda s: _manager_configuration("config.lws.x-k8s.io/v1alpha1", s))
TRAINER = OperatorSpec("trainer", _trainer_configuration)
# KubeRay's webhook is off unless ENABLE_WEBHOOKS=true. It would give each worker an init container
# that waits for the head's GCS with `ray health-check`, and each Ray container exec probes of
# Ray's dashboard agent: the test bed's pods run busybox, not Ray, so both are off (a Ray image
# needs neither setting).
KUBERAY = OperatorSpec(
    "kuberay",
    flags=_kuberay_flags,
    env={"ENABLE_INIT_CONTAINER_INJECTION": "false", "ENABLE_PROBES_INJECTION": "false"},
)
OPERATORS = {spec.name: spec for spec in (JOBSET, LWS, TRAINER, KUBERAY)}


def _json_patch(document: dict[str, Any], operation: dict[str, Any]) -> None:
    """One RFC 6902 add or replace (what the operators' kustomize patches use)."""
    if operation["op"] not in ("add", "replace"):
        raise ValueError(f"unsupported patch operation {operation}")
    *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in operation["path"].split("/")[1:]]
    target: Any = document
    for part in parents:
        target = target[int(part)] if isinstance(target, list) else target[part]
    if isinstance(target, list) and last == "-":
        target.append(operation["value"])
    elif isinstance(target, list):
        index = int(last)
        if operation["op"] == "add":
            target.insert(index, operation["value"])
        else:
            target[index] = operation["value"]
    else:
        target[last] = operation["value"]


def kustomized(directory: Path) -> list[dict[str, Any]]:
    """manifests.yaml of a webhook directory with its kustomization's patches applied: the pod
    webhooks' objectSelectors, Trainer's configuration names."""
    documents = [d for d in yaml.safe_load_all((directory / "manifests.yaml").read_text()) if d]
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    for patch in kustomization.get("patches") or ():
        target = patch.get("target") or {}
        for document in documents:
            name = document["metadata"]["name"]
            if document["kind"] == target.get("kind") and target.get("name", name) == name:
                for operation in yaml.safe_load((directory / patch["path"]).read_text()):
                    _json_patch(document, operation)
    return documents


def webhook_configurations(operator: str, directory: Path, port: int, ca_bundle: str) -> list[dict[str, Any]]:
    """The operator's webhook configurations pointed at it on the host, named after it (JobSet's
    and LWS's are both plain `mutating-webhook-configuration`)."""
    return [
        {
            "apiVersion": document["apiVersion"],
            "kind": document["kind"],
            "metadata": {"name": f"{operator}-{document['metadata']['name']}"},
            "webhooks": [served_from_host(webhook, port, ca_bundle) for webhook in document["webhooks"]],
        }
        for document in kustomized(directory)
    ]


@dataclass
class HostOperator:
    cluster: Cluster
    spec: OperatorSpec
    workdir: Path
    process: subprocess.Popen[bytes] | None = None
    start_s: float | None = None  # from installing its CRDs until it was ready
    _applied: AppliedObjects | None = field(default=None, repr=False)

    @property
    def config_dir(self) -> Path:
        assert self.cluster.binaries is not None
        return self.cluster.binaries / f"{self.spec.name}-config"

    def start(self) -> HostOperator:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> HostOperator:
        assert self.cluster.binaries is not None
        name = self.spec.name
        started = datetime.datetime.now()
        self.workdir.mkdir(parents=True, exist_ok=True)
        serving = Serving(self.workdir)
        applied = self._applied = AppliedObjects(self.cluster)
        crds = [yaml.safe_load(path.read_text()) for path in sorted((self.config_dir / "crds").glob("*.yaml"))]
        for crd in crds:
            applied.apply(crd, created=True)
        wait_established(self.cluster, [crd["metadata"]["name"] for crd in crds], START_TIMEOUT_S)
        if (webhooks := self.config_dir / "webhook").is_dir():
            certificate = serving_certificate(self.workdir / "pki", f"{name}-ca", name, [])
            certificate.write_serving(serving.cert_dir)
            for configuration in webhook_configurations(name, webhooks, serving.webhook_port, certificate.ca_bundle):
                applied.apply(configuration, created=True)
        argv = [str(self.cluster.binaries / name)]
        if self.spec.configuration is not None:
            config_file = self.workdir / "configuration.yaml"
            config_file.write_text(yaml.safe_dump(self.spec.configuration(serving)))
            argv.append(f"--config={config_file}")
        argv += self.spec.flags(serving)
        env = {"KUBECONFIG": str(self.cluster.kubeconfig), "PATH": "/usr/bin:/bin", "TMPDIR": str(self.workdir)}
        logs = self.workdir / f"{name}.log"
        self.process = spawn(argv, logs, env={**env, **self.spec.env})
        wait_ready(name, serving.health_port, START_TIMEOUT_S, exited_check(name, self.process, logs))
        self.start_s = (datetime.datetime.now() - started).total_seconds()
        print(f"{name} up in {self.start_s:.1f}s ({logs})")
        return self

    def stop(self) -> None:
        """Takes out what start() added, newest first, then stops the operator: the webhook
        configurations (with the operator gone they would refuse its kinds), then the CRDs and so
        every object of theirs, while it runs to remove its finalizers from them."""
        try:
            if self._applied is not None:
                self._applied.remove(START_TIMEOUT_S)
        finally:
            if self.process is not None:
                stop_process(self.process)
                self.process = None


def main() -> int:
    """Each operator against a throw-away control plane: start, stop and their times."""
    workdir = Path(tempfile.mkdtemp(prefix="fgpu-operators-"))
    cluster = Cluster(workdir / "cluster")
    try:
        cluster.start()
        running: list[HostOperator] = []
        try:
            for spec in (JOBSET, LWS, TRAINER, KUBERAY):  # Trainer after JobSet: it needs its CRD
                running.append(HostOperator(cluster, spec, workdir / spec.name).start())
        finally:
            for operator in reversed(running):
                operator.stop()
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
