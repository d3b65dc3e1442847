"""The plugin's and the controller's Prometheus endpoints, scraped over HTTP from real processes
after prepares and unprepares through kubelet's socket, and the Grafana dashboard's queries
against what they export."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
from kubernetes.client import V1ResourceClaimConsumerReference
from kubernetes.client.exceptions import ApiException

from driver.nvml.mock import SIMULATED_MPS_GPU_PERCENT
from testbed.claims_api import create_allocated_claim, create_claim
from testbed.cluster.harness import free_port
from tests.support.chart import CHART
from tests.support.metrics import Families, scrape, value

pytestmark = pytest.mark.cluster
SERIES_OF_TYPE = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}


def series_names(families: Families) -> set[str]:
    """Every series name a query may use: those with samples, and those of families that have
    none yet (a labelled counter before its first event)."""
    names = set()
    for family, (kind, samples) in families.items():
        names |= {s.name for s in samples}
        names |= {family + suffix for suffix in SERIES_OF_TYPE.get(kind, ("",))}
    return names


def reserve(resource_api, core_api, claim: str, pod: str) -> None:
    """A pod using the claim, and the reservation kube-scheduler writes for it (kube-controller-manager
    drops a reservation whose pod does not exist)."""
    body = {
        "metadata": {"name": pod},
        "spec": {
            "nodeName": "node-a",  # no scheduling: node-a's kubelet is this test
            "containers": [{"name": "c", "image": "busybox", "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
        },
    }
    uid = core_api.create_namespaced_pod("default", body).metadata.uid
    for _ in range(10):  # kube-controller-manager writes the claim too, seeing the pod
        current = resource_api.read_namespaced_resource_claim(claim, "default")
        current.status.reserved_for = [V1ResourceClaimConsumerReference(resource="pods", name=pod, uid=uid)]
        try:
            resource_api.replace_namespaced_resource_claim_status(claim, "default", current)
            return
        except ApiException as err:
            if err.status != 409:
                raise
    raise AssertionError(f"claim {claim} kept changing")


@pytest.fixture
def controller_port(cluster) -> Iterator[int]:
    port = free_port()
    flags = [f"--kubeconfig={cluster.kubeconfig}", "--lease-namespace=default", f"--metrics-port={port}"]
    process = subprocess.Popen([sys.executable, "-m", "driver.cli", "controller", *flags, "--identity=metrics-test"])
    yield port
    process.terminate()
    process.wait(timeout=15)


def test_scraped_metrics_and_the_dashboard_queries(start_plugin, resource_api, core_api, controller_port):
    port = free_port()
    plugin = start_plugin(extra_args=[f"--metrics-port={port}", "--metrics-tenant-labels"])
    plugin.register()
    whole = create_claim(resource_api, devices=[("gpu", "gpu-1")])
    mig = create_allocated_claim(resource_api, [{"request": "gpu", "device": "gpu-4-mig-1g10gb-0"}])
    mps = create_allocated_claim(
        resource_api, [{"request": "gpu", "device": "gpu-5-mps", "consumedCapacity": {"memory": "4Gi"}}]
    )
    reserve(resource_api, core_api, mps["name"], "trainer")
    elsewhere = create_claim(resource_api, devices=[("gpu", "gpu-2")], pool="node-b")
    try:
        results = plugin.prepare([whole, mig, mps, elsewhere])
        assert [uid for uid, r in results.items() if r.error] == [elsewhere["uid"]]

        families = scrape(port)
        prep = {"method": "NodePrepareResources"}
        assert value(families, "fgpu_requests_total", **prep, result="error") == 1
        assert value(families, "fgpu_request_duration_seconds_count", **prep) == 1
        assert value(families, "fgpu_claim_errors_total", operation="prepare", reason="not_allocated") == 1
        for kind, count in {"whole": 1, "mig": 1, "mps": 1, "timeslice": 0}.items():
            assert value(families, "fgpu_prepared_devices", node="node-a", kind=kind) == count
        _, samples = families["fgpu_gpu_utilization_ratio"]
        (share,) = [s for s in samples if s.labels["claim"] == mps["name"]]
        assert (share.labels["claim_pod"], share.labels["gpu_index"]) == ("trainer", "5")
        assert share.value == SIMULATED_MPS_GPU_PERCENT / 100
        _, samples = families["fgpu_mig_memory_total_bytes"]
        assert [(s.labels["claim"], s.labels["mig_profile"]) for s in samples] == [(mig["name"], "1g.10gb")]
    finally:  # MPS daemons outlive the plugin by design: the test leaves none behind
        unprepared = plugin.unprepare([whole, mig, mps])
        core_api.delete_namespaced_pod("trainer", "default", grace_period_seconds=0)
    assert all(not error for error in unprepared.values())
    families = scrape(port)
    assert value(families, "fgpu_requests_total", method="NodeUnprepareResources", result="ok") == 1
    assert value(families, "fgpu_prepared_devices", node="node-a", kind="mps") == 0
    assert not families["fgpu_mig_memory_total_bytes"][1]

    controller = scrape(controller_port)
    exported = series_names(families) | series_names(controller)
    dashboard = json.loads((CHART / "dashboards" / "fgpu.json").read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\bfgpu_[a-z0-9_]+", target["expr"])
    }
    assert queried - exported == set()  # every query names a series a plugin or the controller exports
    everything = families | controller
    shown = {name for name, family in everything.items() if series_names({name: family}) & queried}
    # ... and every metric is on the dashboard (the text format lists counters' _created series apart)
    assert {n for n in everything if n.startswith("fgpu_") and not n.endswith("_created")} - shown == set()
