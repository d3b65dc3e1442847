"""The plugin's metrics after prepares and unprepares through the driver, over mock NVML and the
in-memory API: kubelet's calls go through the DRA service as kubelet's would."""

from __future__ import annotations

import socket
import time
import urllib.request

import pynvml
import pytest

from driver.claims.refs import ClaimRef
from driver.common.http_server import ConnectionLimits
from driver.node import metrics
from driver.node.kubelet.dra_service import DraV1Service
from driver.node.metrics import ClaimHolders, MetricsServer, NodeCollector, node_registry
from driver.node.state import PreparedClaim
from testbed.fakes import InMemoryKubeApi, allocated_claim, result
from testbed.node_env import NodeEnv
from tests.support.dra_calls import Samples, prepare, unprepare


def add_claim(api: InMemoryKubeApi, name: str, results: list[dict], pods: tuple[str, ...] = ()) -> ClaimRef:
    claim = allocated_claim("team", name, f"uid-{name}", results)
    claim["status"]["reservedFor"] = [{"resource": "pods", "name": pod, "uid": f"pod-{pod}"} for pod in pods]
    api.claims[("team", name)] = claim
    return ClaimRef("team", name, f"uid-{name}")


@pytest.fixture
def plugin(node: tuple[InMemoryKubeApi, NodeEnv]) -> tuple[InMemoryKubeApi, NodeEnv, DraV1Service, Samples]:
    api, env = node
    collector = NodeCollector("node-a", env.claims, env.session, env.gpus, ClaimHolders(api), tenant_labels=True)
    return api, env, DraV1Service(env.preparer, lambda uids, answered: None), Samples(node_registry(collector))


def test_requests_latency_and_errors_by_reason(plugin):
    api, _, service, samples = plugin
    good = add_claim(api, "good", [result("gpu-0")])
    elsewhere = add_claim(api, "elsewhere", [result("gpu-1", pool="node-b")])
    missing = ClaimRef("team", "missing", "uid-missing")
    assert prepare(service, [good])["uid-good"] == ""
    errors = prepare(service, [good, elsewhere, missing])
    assert errors["uid-good"] == "" and errors["uid-elsewhere"] and errors["uid-missing"]
    assert unprepare(service, [good]) == {"uid-good": ""}
    prepare(service, [])  # the liveness self-probe's call: not counted

    prep, unprep = "NodePrepareResources", "NodeUnprepareResources"
    assert samples.delta("fgpu_requests_total", method=prep, result="ok") == 1
    assert samples.delta("fgpu_requests_total", method=prep, result="error") == 1
    assert samples.delta("fgpu_requests_total", method=unprep, result="ok") == 1
    assert samples.delta("fgpu_request_duration_seconds_count", method=prep) == 2
    assert samples.delta("fgpu_request_duration_seconds_sum", method=prep) > 0
    assert samples.value("fgpu_requests_in_flight", method=prep) == 0
    assert samples.delta("fgpu_claim_errors_total", operation="prepare", reason="not_allocated") == 1
    assert samples.delta("fgpu_claim_errors_total", operation="prepare", reason="not_found") == 1
    assert samples.delta("fgpu_claim_errors_total", operation="prepare", reason="api") == 0


def test_failed_steps_are_counted_by_their_source(plugin):
    api, env, service, samples = plugin
    taken = add_claim(api, "taken", [result("gpu-4-mig-1g10gb-0")])
    assert env.session.set_mig_mode(4, True)
    env.session.create_mig_instance(4, 0, 0, 8)  # someone else's 7g instance spans the placement
    assert prepare(service, [taken])["uid-taken"]
    api.unavailable = True
    assert "API server" in prepare(service, [add_claim(api, "later", [result("gpu-5")])])["uid-later"]
    assert samples.delta("fgpu_claim_errors_total", operation="prepare", reason="mig") == 1
    assert samples.delta("fgpu_claim_errors_total", operation="prepare", reason="api") == 1


class FlakyApi(InMemoryKubeApi):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def get_claim(self, namespace: str, name: str) -> dict:
        self.calls += 1
        return super().get_claim(namespace, name)


def test_claim_holders_refresh_and_spare_an_unreachable_api_server():
    api = FlakyApi()
    now = [0.0]
    holders = ClaimHolders(api, refresh_s=60, clock=lambda: now[0])
    claims = [PreparedClaim(f"uid-{n}", "team", n, ()) for n in ("a", "b")]
    add_claim(api, "a", [result("gpu-0")], pods=("pa",))
    add_claim(api, "b", [result("gpu-1")], pods=("pb",))
    assert holders.pods(claims) == {"uid-a": ("pa",), "uid-b": ("pb",)}
    add_claim(api, "a", [result("gpu-0")], pods=("pa", "pa2"))
    now[0] = 30
    assert holders.pods(claims)["uid-a"] == ("pa",)  # within the refresh period: no new GET
    api.unavailable = True
    now[0] = 61
    calls = api.calls
    assert holders.pods(claims) == {"uid-a": ("pa",), "uid-b": ("pb",)}  # what was known stays
    assert api.calls == calls + 1  # one failed GET; the next claim was not tried
    now[0] = 100
    assert holders.pods(claims)["uid-a"] == ("pa",)  # still quiet after the failure
    api.unavailable = False
    now[0] = 122
    assert holders.pods(claims)["uid-a"] == ("pa", "pa2")
    api.claims.pop(("team", "b"))
    now[0] = 200
    assert holders.pods(claims[1:]) == {"uid-b": ()}  # a claim gone from the API server: no pod


def test_health_hooks_are_exported_before_and_after_events(plugin):
    _, env, _, samples = plugin
    families = {family.name for family in samples.registry.collect()}
    assert {"fgpu_health_events", "fgpu_device_taints"} <= families
    gpu = env.gpus[0].uuid
    metrics.record_health_event(gpu, "xid", 79)
    metrics.record_health_event(gpu, "gpu_lost")
    assert samples.delta("fgpu_health_events_total", gpu=gpu, kind="xid", xid="79") == 1
    assert samples.delta("fgpu_health_events_total", gpu=gpu, kind="gpu_lost", xid="") == 1
    metrics.set_taints_in_force({"NoExecute": 2, "None": 1})
    assert samples.value("fgpu_device_taints", effect="NoExecute") == 2
    assert samples.value("fgpu_device_taints", effect="NoSchedule") == 0
    metrics.set_taints_in_force({})
    assert samples.value("fgpu_device_taints", effect="NoExecute") == 0
    assert samples.value("fgpu_device_taints", effect="None") == 0


def test_a_gpu_nvml_cannot_read_leaves_the_other_gpus_metrics(plugin, monkeypatch):
    _, env, _, samples = plugin
    real = env.session.usage

    def lost(index: int):
        if index == 5:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return real(index)

    monkeypatch.setattr(env.session, "usage", lost)
    indexes = {s["gpu_index"] for s in samples.series("fgpu_gpu_memory_total_bytes")}
    assert indexes == {str(i) for i in range(8)} - {"5"}
    assert samples.value("fgpu_mps_clients", gpu=env.gpus[5].uuid, gpu_index="5") == 0


def test_the_claim_error_reasons_are_the_documented_set():
    """README lists them; every one is exported from the start at zero."""
    values = {
        s.labels["reason"]
        for family in metrics.REGISTRY.collect()
        for s in family.samples
        if s.name == "fgpu_claim_errors_total"
    }
    assert values == {
        "invalid", "not_found", "not_allocated", "driver", "mig", "mps", "timeslice", "io", "api", "internal"
    }  # fmt: skip


def test_metrics_port_in_use_is_tried_again_until_free():
    """hostNetwork: the previous instance of a rolling update holds the port until it stops."""
    holder = socket.socket()
    holder.bind(("0.0.0.0", 0))
    holder.listen()
    port = holder.getsockname()[1]
    server = MetricsServer(port, node_registry(metrics.REGISTRY), retry_s=0.05)
    server.start()
    try:
        holder.close()
        deadline = time.monotonic() + 10
        while True:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
                break
            except OSError:
                assert time.monotonic() < deadline, "the metrics server never bound the freed port"
                time.sleep(0.05)
        assert "fgpu_requests_total" in body
    finally:
        server.stop()


def connect_when_up(port: int) -> socket.socket:
    deadline = time.monotonic() + 10
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            assert time.monotonic() < deadline, "the metrics server never listened"
            time.sleep(0.05)


def test_tenant_names_are_left_out_unless_asked_for(node):
    """Any pod can scrape the plugin's port: without --metrics-tenant-labels no series names a
    namespace, claim or pod; the claim's UID tells claims apart."""
    api, env = node
    ref = add_claim(api, "secret-project", [result("gpu-0")], pods=("trainer",))
    collector = NodeCollector("node-a", env.claims, env.session, env.gpus, ClaimHolders(api))
    assert prepare(DraV1Service(env.preparer, lambda uids, answered: None), [ref]) == {ref.uid: ""}
    collector.sample_usage()
    samples = Samples(node_registry(collector))
    values = {v for name in ("fgpu_gpu_memory_used_bytes", "fgpu_gpu_seconds_total", "fgpu_claim_idle_seconds")
              for labels in samples.series(name) for v in labels.values()}  # fmt: skip
    assert not values & {"team", "secret-project", "trainer"}
    (held,) = [s for s in samples.series("fgpu_gpu_memory_used_bytes") if s["claim"] == ref.uid]
    assert (held["claim_namespace"], held["claim_pod"]) == ("", "")
    assert [s["claim"] for s in samples.series("fgpu_claim_idle_seconds")] == [ref.uid]
    assert {s["claim_namespace"] for s in samples.series("fgpu_gpu_seconds_total")} == {""}


def test_the_metrics_port_takes_a_bounded_number_of_connections_each_closed_when_idle():
    """A thread per connection without end was a way to exhaust the plugin from any pod."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = MetricsServer(port, node_registry(metrics.REGISTRY), limits=ConnectionLimits(2, idle_timeout_s=0.3))
    server.start()
    try:
        held = [connect_when_up(port), socket.create_connection(("127.0.0.1", port), timeout=5)]
        third = socket.create_connection(("127.0.0.1", port), timeout=5)
        assert third.recv(1) == b""  # closed at once: two are open
        started = time.monotonic()
        assert held[0].recv(1) == b"" and held[1].recv(1) == b""  # closed: they sent nothing
        assert time.monotonic() - started < 3
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "fgpu_requests_total" in body
    finally:
        server.stop()
