"""`fgpu webhook` as a process on this host, for the tests that call the real one: started with a
certificate the test cluster's CA signed, and waited for until it serves."""

from __future__ import annotations

import base64
import contextlib
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kubernetes.client import AdmissionregistrationV1Api, CoreV1Api

from testbed.cluster.harness import Cluster, free_port
from testbed.workloads import unique
from tests.support import ROOT
from tests.support.chart import find, render


def wait_serving(process: subprocess.Popen[bytes], port: int, cafile: str | None = None) -> None:
    """Until /healthz answers ok over TLS (`cafile`: the CA to trust; none: its certificate is not
    checked, for a webhook whose CA is in a Secret not read yet)."""
    context = ssl.create_default_context(cafile=cafile)
    if cafile is None:
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", context=context, timeout=2) as answer:
                assert answer.read() == b"ok\n"
                return
        except OSError:
            assert process.poll() is None, f"fgpu webhook exited {process.returncode}"
            assert time.monotonic() < deadline, "fgpu webhook did not serve"
            time.sleep(0.2)


def serve_webhook(
    cluster: Cluster, port: int, name: str, *flags: str, log: Path | None = None
) -> subprocess.Popen[bytes]:
    """`fgpu webhook` on 127.0.0.1:`port` with a serving certificate `name` of the cluster's CA and
    `flags`, its output to `log` (else inherited), once it serves; killed if it does not."""
    assert cluster.pki is not None
    cluster.pki.sign_server(name, "fgpu-webhook", "IP:127.0.0.1")
    command = [sys.executable, "-m", "driver.cli", "webhook", "--bind-address=127.0.0.1", f"--port={port}",
               f"--tls-cert-file={cluster.pki.path(f'{name}.crt')}",
               f"--tls-private-key-file={cluster.pki.path(f'{name}.key')}", *flags]  # fmt: skip
    if log is None:
        process = subprocess.Popen(command, cwd=ROOT)
    else:
        with log.open("wb") as out:
            process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_serving(process, port, cluster.pki.path("ca.crt"))
    except AssertionError:
        process.kill()
        process.wait()
        raise
    return process


def pointed_at_host(config: dict[str, Any], cluster: Cluster, port: int, path: str, name: str) -> dict[str, Any]:
    """A webhook configuration the chart renders, renamed `name`, each of its webhooks calling
    this host's webhook at `path` and trusting the cluster's CA."""
    assert cluster.pki is not None
    config["metadata"] = {"name": name}
    ca_bundle = base64.b64encode(Path(cluster.pki.path("ca.crt")).read_bytes()).decode()
    for webhook in config["webhooks"]:
        webhook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca_bundle}
    return config


@contextlib.contextmanager
def host_webhook(
    cluster: Cluster, values: dict[str, str], webhooks: list[str], path: str, flags: tuple[str, ...], log: Path
) -> Iterator[None]:
    """`fgpu webhook` with `flags` serving on this host, and the entries `webhooks` of the
    MutatingWebhookConfiguration the chart renders with `values` pointed at its `path`. Its output
    goes to `log`."""
    admission = AdmissionregistrationV1Api(cluster.api_client())
    port, name = free_port(), unique("fgpu-mutating")
    process = serve_webhook(cluster, port, name, f"--kubeconfig={cluster.kubeconfig}", *flags, log=log)
    config = find(render(values), "MutatingWebhookConfiguration")
    config["webhooks"] = [w for w in config["webhooks"] if w["name"] in webhooks]
    assert [w["name"] for w in config["webhooks"]] == webhooks
    admission.create_mutating_webhook_configuration(pointed_at_host(config, cluster, port, path, name))
    try:
        yield
    finally:
        admission.delete_mutating_webhook_configuration(name)
        process.terminate()
        process.wait(timeout=10)


@contextlib.contextmanager
def rightsize_webhook(cluster: Cluster, log: Path) -> Iterator[str]:
    """`fgpu webhook` serving /rightsize with a usage-history namespace of its own, and the chart's
    rightsize entries of the MutatingWebhookConfiguration pointed at it; yields the history
    namespace (where node plugins write their ConfigMaps). Its output goes to `log`."""
    core = CoreV1Api(cluster.api_client())
    history_ns = unique("fgpu-history")
    core.create_namespace({"metadata": {"name": history_ns}})
    webhooks = ["rightsize-namespaces.gpu.fgpu.dev", "rightsize-templates.gpu.fgpu.dev"]
    flags = (f"--rightsize-history-namespace={history_ns}",)
    try:
        with host_webhook(cluster, {"webhook.rightsize.enabled": "true"}, webhooks, "/rightsize", flags, log):
            yield history_ns
    finally:
        core.delete_namespace(history_ns)


@contextlib.contextmanager
def gpu_pods_toleration_webhook(cluster: Cluster, taint_key: str, log: Path) -> Iterator[None]:
    """`fgpu webhook --gpu-pods-toleration taint_key` and the chart's pods entry pointed at it: pods
    whose claims ask for fgpu's devices are given the toleration of `taint_key` at create, failurePolicy
    Fail (a pod admitted is one the webhook answered for)."""
    values = {"webhook.gpuPodsToleration": taint_key, "webhook.gatePods.failurePolicy": "Fail"}
    flags = (f"--gpu-pods-toleration={taint_key}",)
    with host_webhook(cluster, values, ["pods.gpu.fgpu.dev"], "/mutate", flags, log):
        yield
