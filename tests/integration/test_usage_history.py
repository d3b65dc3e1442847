"""The usage history in the cluster (issue 42), end to end short of a real node: the plugin as a real
process samples a prepared MPS share whose (mock) process uses 2Gi of its 10Gi, keeps it in its
ConfigMap `fgpu-usage-node-a`, reads it back after a restart, and `fgpu rightsize --kubeconfig` turns
it into a recommendation of 2.5Gi.

A day of history in a minute: the plugin samples every 0.05 s (the hidden --usage-sample-period,
each sample still counting 10 s) and its first run's history clock is 25 hours back (the test hook
FGPU_TEST_CLOCK_OFFSET_S), so that the two runs span the day and 360 samples the rules ask for. The
share's process runs in the pod of a real ReplicaSet (gated, so never scheduled) through a fake
/proc (the hidden --proc-root): its cgroup names the pod, as a container's would on a node."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from driver.common.testhooks import CLOCK_OFFSET_ENV
from driver.nvml.session import MOCK_STATE_ENV
from driver.sizing import store
from testbed.claims_api import create_allocated_claim
from testbed.workloads import wait_for
from tests.support import ROOT

pytestmark = pytest.mark.cluster

PID = 4242
SHARE = {"request": "gpu", "device": "gpu-3-mps", "consumedCapacity": {"memory": "10Gi", "compute": "25"}}


def fgpu(*args: str, env: dict[str, str]) -> str:
    run = subprocess.run([sys.executable, "-m", "driver.cli", *args], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    return run.stdout


def replica_set_pod(apps: kubernetes.client.AppsV1Api, core: kubernetes.client.CoreV1Api) -> dict[str, Any]:
    """A pod of ReplicaSet web-7d4b9c (as a Deployment `web` names its ReplicaSets), held at a
    scheduling gate; its claim entry names a template that need not exist (nothing is created)."""
    labels = {"app": "usage-web", "pod-template-hash": "7d4b9c"}
    body = {
        "metadata": {"name": "web-7d4b9c"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "schedulingGates": [{"name": "example.com/never"}],
                    "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "mps-10gi"}],
                    "containers": [{"name": "main", "image": "pause", "resources": {"claims": [{"name": "gpu"}]}}],
                },
            },
        },
    }
    apps.create_namespaced_replica_set("default", body)
    selector = "app=usage-web"
    pods = wait_for(lambda: core.list_namespaced_pod("default", label_selector=selector).items, timeout=60)
    return kubernetes.client.ApiClient().sanitize_for_serialization(pods[0])


def stored(core: kubernetes.client.CoreV1Api, namespace: str) -> tuple[int, int]:
    """(samples, hourly buckets) in the node's ConfigMap; (0, 0) before it is written."""
    try:
        raw = core.read_namespaced_config_map("fgpu-usage-node-a", namespace)
    except kubernetes.client.ApiException:
        return 0, 0
    history = store.history_of({"binaryData": raw.binary_data or {}})
    buckets = [b for c in history.claims.values() for b in c.buckets] if history else []
    return sum(b.samples for b in buckets), len(buckets)


def test_a_share_using_2gi_of_10gi_is_recommended_2_5gi_from_the_clusters_history(
    start_plugin, resource_api, core_api, cluster, tmp_path: Path
):
    apps = kubernetes.client.AppsV1Api(cluster.api_client())
    namespace = f"fgpu-usage-{uuid.uuid4().hex[:6]}"
    core_api.create_namespace({"metadata": {"name": namespace}})
    try:
        pod = replica_set_pod(apps, core_api)
        claim = create_allocated_claim(resource_api, [SHARE])
        resource_api.patch_namespaced_resource_claim(
            claim["name"], "default", {"metadata": {"annotations": {"resource.kubernetes.io/pod-claim-name": "gpu"}}}
        )
        reserved = [{"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}]
        status = {"status": {"reservedFor": reserved}}
        resource_api.patch_namespaced_resource_claim_status(claim["name"], "default", status)
        proc = tmp_path / "proc" / str(PID)
        proc.mkdir(parents=True)
        (proc / "cgroup").write_text(f"0::/kubepods/besteffort/pod{pod['metadata']['uid']}/c0ffee\n")
        state = tmp_path / "gpus.json"
        args = [f"--usage-history-namespace={namespace}", "--usage-history-interval=1",
                "--usage-sample-period=0.05", f"--proc-root={tmp_path / 'proc'}"]  # fmt: skip
        plugin = start_plugin(extra_args=args, extra_env={MOCK_STATE_ENV: str(state), CLOCK_OFFSET_ENV: "-90000"})
        plugin.register()
        assert plugin.prepare([claim])[claim["uid"]].error == ""
        env = {"PATH": "/usr/bin:/bin", "NVML": "mock:dgx-h100", MOCK_STATE_ENV: str(state)}
        fgpu("mock", "usage", "--gpu=3", f"--pid={PID}", "--memory=2048", "--sm=8", env=env)

        # Yesterday: 200 samples, then a restart (its last write on SIGTERM) ...
        wait_for(lambda: stored(core_api, namespace)[0] >= 200, timeout=120)
        assert plugin.stop() == 0
        before = stored(core_api, namespace)[0]
        plugin.extra_env = {MOCK_STATE_ENV: str(state)}  # ... into today
        plugin.start()
        # The week read back, and today's samples beside it (another bucket).
        wait_for(lambda: stored(core_api, namespace)[0] >= before + 200, timeout=120)
        samples, buckets = stored(core_api, namespace)
        assert buckets >= 2 and samples >= 400  # yesterday rolled up into its day, today by the hour

        out = fgpu("rightsize", f"--kubeconfig={cluster.kubeconfig}", f"--namespace={namespace}", "-o", "json",
                   env={**env, "HOME": str(tmp_path)})  # fmt: skip
        (recommendation,) = json.loads(out)
        assert recommendation["key"]["workload"] == {"kind": "Deployment", "name": "web"}
        assert (recommendation["key"]["template"], recommendation["key"]["request"]) == ("mps-10gi", "gpu")
        mps = {"kind": "mps", "profile": None}
        assert recommendation["current"] == {**mps, "memory_mib": 10240, "compute_percent": 25}
        # 2Gi used: x 1.2 = 2.4Gi, in 256Mi steps 2.5Gi; 8% compute x 1.1: 9%.
        assert recommendation["recommended"] == {**mps, "memory_mib": 2560, "compute_percent": 9}
        assert recommendation["observed"]["memory_peak_mib"] == 2048
        assert not [e for e in plugin.unprepare([claim]).values() if e]
    finally:
        apps.delete_namespaced_replica_set("web-7d4b9c", "default")
        core_api.delete_namespace(namespace)
