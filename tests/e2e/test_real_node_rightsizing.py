"""Right-sizing end to end on the real node (issue 42): a Deployment on 10Gi MPS shares whose
process uses 2Gi is recommended 2.5Gi from the history the plugin sampled; in Initial mode the
claim of a new replica is made at that size, with an Event saying so, and its container sees the
smaller limit; when that replica's process reaches its limit, the next replica gets the original
size back.

The GPU is the NVML mock: the container's process (busybox's `sleep`, in the pod's cgroup) is given
its GPU memory and SM use with `fgpu mock usage`, as a CUDA process would hold them. A day of
history in a minute: the plugin samples every 0.05 s (each sample still counting 10 s) and its first
run's clock is 25 hours back (FGPU_TEST_CLOCK_OFFSET_S); its restart brings it to today."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from driver.admission.rightsize import TTL_S
from driver.common.testhooks import CLOCK_OFFSET_ENV
from driver.node.usage import pod_uid_of_cgroup
from driver.nvml.session import MOCK_STATE_ENV
from driver.sizing import store
from driver.sizing.initial import ORIGINAL_ANNOTATION, RIGHTSIZE
from testbed.cluster.node import RealNode
from testbed.node_plugin import NodePlugin
from testbed.workloads import claim_template, delete_namespace, deployment, pod_events, report, unique, wait_until
from tests.support import ROOT
from tests.support.pools import serving
from tests.support.webhook import rightsize_webhook

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]

ORIGINAL = {"memory": "10Gi", "compute": "25"}
SAMPLES_PER_RUN = 200  # two runs: 400 samples over 25 hours, past the rules' 360 and a day


def fgpu(*args: str, state: Path) -> str:
    environment = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), "NVML": "mock:dgx-h100",
                   MOCK_STATE_ENV: str(state)}  # fmt: skip
    run = subprocess.run([sys.executable, "-m", "driver.cli", *args], capture_output=True, text=True,
                         env=environment, cwd=ROOT, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.fixture
def team(core_api, plugin) -> Iterator[str]:
    """The team's namespace, not opted in to automatic sizing yet; gone before the plugin is, which
    unprepares its pods' claims."""
    name = unique("team")
    core_api.create_namespace({"metadata": {"name": name}})
    try:
        yield name
    finally:
        delete_namespace(core_api, name)


@pytest.fixture
def history(cluster, tmp_path: Path) -> Iterator[str]:
    with rightsize_webhook(cluster, tmp_path / "webhook.log") as namespace:
        yield namespace


@pytest.fixture
def plugin(cluster, real_node: RealNode, history: str) -> Iterator[NodePlugin]:
    """The plugin keeping the usage history in `history`, written every second; started 25 hours
    back in time."""
    resource_api = kubernetes.client.ResourceV1Api(cluster.api_client())
    plugin = NodePlugin.on(real_node)
    plugin.extra_args += [f"--usage-history-namespace={history}", "--usage-history-interval=1",
                          "--usage-sample-period=0.05"]  # fmt: skip
    plugin.extra_env = {**plugin.extra_env, CLOCK_OFFSET_ENV: "-90000"}
    with serving(plugin, resource_api):
        yield plugin


def samples(core_api, namespace: str, node: str) -> int:
    try:
        raw = core_api.read_namespaced_config_map(f"fgpu-usage-{node}", namespace)
    except kubernetes.client.ApiException:
        return 0
    stored = store.history_of({"binaryData": raw.binary_data or {}})
    return sum(b.samples for c in stored.claims.values() for b in c.buckets) if stored else 0


def replicas(core_api, resource_api, namespace: str) -> dict[str, tuple[Any, dict[str, Any]]]:
    """Each running pod of the Deployment with its claim, by pod name."""
    pods = core_api.list_namespaced_pod(namespace, label_selector="app=web").items
    claims = {
        c["metadata"]["name"]: c for c in resource_api.list_namespaced_resource_claim(namespace).to_dict()["items"]
    }
    found = {}
    for pod in pods:
        statuses = pod.status.resource_claim_statuses or []
        claim = next((claims.get(s.resource_claim_name) for s in statuses if s.name == "gpu"), None)
        if pod.status.phase == "Running" and claim is not None:
            found[pod.metadata.name] = (pod, claim)
    return found


def scale_to(apps, core_api, resource_api, namespace: str, count: int) -> tuple[Any, dict[str, Any]]:
    """Scale the Deployment up by one to `count`; the new replica, running, and its claim."""
    before = set(replicas(core_api, resource_api, namespace))
    apps.patch_namespaced_deployment_scale("web", namespace, {"spec": {"replicas": count}})

    def new_one() -> tuple[Any, dict[str, Any]] | None:
        running = replicas(core_api, resource_api, namespace)
        added = [running[name] for name in set(running) - before]
        return added[0] if len(running) == count and added else None

    return wait_until(f"replica {count} running", new_one)


def events_of(core_api, claim: dict[str, Any]) -> list[str]:
    return pod_events(core_api, claim["metadata"]["name"], claim["metadata"]["namespace"])


def memory_of(claim: dict[str, Any]) -> str:
    return claim["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["memory"]


def run_on_gpu(pod: Any, claim: dict[str, Any], memory_mib: int, sm_percent: int, state: Path) -> None:
    """The container's process holds `memory_mib` of its share's GPU and uses `sm_percent` of its SMs."""
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    gpu = int(result["device"].split("-")[1])  # gpu-<index>-mps
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _in_pod(p, pod.metadata.uid)]
    sleeper = next(pid for pid in pids if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sleep"))
    fgpu("mock", "usage", f"--gpu={gpu}", f"--pid={sleeper}", f"--memory={memory_mib}", f"--sm={sm_percent}",
         state=state)  # fmt: skip


def _in_pod(proc: Path, uid: str) -> bool:
    try:
        return pod_uid_of_cgroup((proc / "cgroup").read_text()) == uid
    except OSError:  # gone meanwhile
        return False


def recommendation(cluster, history: str, state: Path) -> dict[str, Any]:
    out = fgpu("rightsize", f"--kubeconfig={cluster.kubeconfig}", f"--namespace={history}", "-o", "json", state=state)
    (only,) = [r for r in json.loads(out) if r["key"]["workload"]["name"] == "web"]
    return only


def test_a_deployment_using_2gi_of_10gi_shares_gets_2_5gi_replicas_and_its_original_after_running_out(
    cluster, core_api, resource_api, real_node, history, plugin, team
):
    apps = kubernetes.client.AppsV1Api(cluster.api_client())
    template = claim_template("mps-10gi", "mps.gpu.fgpu.dev", capacity=ORIGINAL)
    kubernetes.utils.create_from_dict(cluster.api_client(), template, namespace=team)
    kubernetes.utils.create_from_dict(cluster.api_client(), deployment("web", real_node.name, "mps-10gi", 0),
                                      namespace=team)  # fmt: skip
    first, first_claim = scale_to(apps, core_api, resource_api, team, 1)
    # Not opted in yet: the first claim keeps its request.
    assert memory_of(first_claim) == "10Gi"
    assert ORIGINAL_ANNOTATION not in (first_claim["metadata"]["annotations"] or {})
    run_on_gpu(first, first_claim, 2048, 8, plugin.mock_state)

    # Yesterday's samples, then a restart (its last write at SIGTERM) into today's.
    wait_until("yesterday's samples", lambda: samples(core_api, history, real_node.name) >= SAMPLES_PER_RUN)
    plugin.extra_env = {k: v for k, v in plugin.extra_env.items() if k != CLOCK_OFFSET_ENV}
    plugin.restart()
    before = samples(core_api, history, real_node.name)
    wait_until("today's samples", lambda: samples(core_api, history, real_node.name) >= before + SAMPLES_PER_RUN)
    recommended = recommendation(cluster, history, plugin.mock_state)
    assert recommended["recommended"] == {"kind": "mps", "profile": None, "memory_mib": 2560, "compute_percent": 9}

    # The team opts in; a new replica's claim is made at the recommendation; its container sees the
    # smaller limit.
    core_api.patch_namespace(team, {"metadata": {"labels": {RIGHTSIZE: "initial"}}})
    second, second_claim = scale_to(apps, core_api, resource_api, team, 2)
    assert memory_of(second_claim) == "2560Mi"
    assert json.loads(second_claim["metadata"]["annotations"][ORIGINAL_ANNOTATION]) == {"gpu": ORIGINAL}
    assert report(core_api, second.metadata.name, team).env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2560M"
    assert report(core_api, first.metadata.name, team).env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"
    # The claim says so in an Event (the plugin's, at prepare); the first claim has none.
    sized = "RightSized: request gpu sized to compute 9, memory 2560Mi from compute 25, memory 10Gi"
    wait_until("the sized claim's Event", lambda: any(e.startswith(sized) for e in events_of(core_api, second_claim)))
    assert not [e for e in events_of(core_api, first_claim) if e.startswith("RightSized")]

    # It grows to its limit (an out-of-memory); the next replica gets the original size back, once the
    # webhook reads the history again (it keeps what it read for a minute).
    run_on_gpu(second, second_claim, 2550, 8, plugin.mock_state)
    sized_at = time.monotonic()

    def raised() -> bool:
        return recommendation(cluster, history, plugin.mock_state)["recommended"]["memory_mib"] > 2560

    wait_until("the out-of-memory in the recommendation", raised)
    time.sleep(max(0.0, sized_at + TTL_S - time.monotonic()))
    third, third_claim = scale_to(apps, core_api, resource_api, team, 3)
    assert memory_of(third_claim) == "10Gi", third_claim
    assert report(core_api, third.metadata.name, team).env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"
