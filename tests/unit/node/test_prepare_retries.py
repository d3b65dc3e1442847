"""Pods whose claims kubelet could not prepare while the plugin was away are annotated once it is
back, which makes kubelet sync them at once instead of at its next periodic pod sync."""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from driver.node.kubelet.api import dra_v1_pb2
from driver.node.kubelet.dra_service import DraV1Service
from driver.node.kubelet.prepare_retries import EVENT_REASON, PrepareRetries, WaitingPod, waiting_pods
from driver.node.state import PreparedClaim, PreparedDevice
from testbed.fakes import CallContext, InMemoryKubeApi, allocated_claim, result
from testbed.workloads import wait_until

DRIVER, NODE = "gpu.fgpu.dev", "node-a"
ANNOTATION = "gpu.fgpu.dev/prepare-retry"


def reserved(claim: dict, *pods: tuple[str, str]) -> dict:
    claim["status"]["reservedFor"] = [{"resource": "pods", "name": name, "uid": uid} for name, uid in pods]
    return claim


def pod(name: str, uid: str, namespace: str = "ns") -> dict:
    return {"metadata": {"namespace": namespace, "name": name, "uid": uid}, "spec": {"nodeName": NODE}}


def test_only_unprepared_claims_of_this_drivers_pool_name_their_pods():
    claims = [
        reserved(allocated_claim("ns", "a", "ua", [result("gpu-0")]), ("p1", "u1")),
        reserved(allocated_claim("ns", "b", "ub", [result("gpu-1")]), ("p1", "u1"), ("p2", "u2")),
        reserved(allocated_claim("ns", "prepared", "up", [result("gpu-2")]), ("p3", "u3")),
        reserved(allocated_claim("ns", "elsewhere", "ue", [result("gpu-0", pool="node-b")]), ("p4", "u4")),
        reserved(allocated_claim("ns", "other-driver", "uo", [result("x", driver="other.dev")]), ("p5", "u5")),
        allocated_claim("ns", "unreserved", "uu", [result("gpu-3")]),
        {"metadata": {"namespace": "ns", "name": "pending", "uid": "un"}, "spec": {}},
    ]
    deleting = reserved(allocated_claim("ns", "deleting", "ud", [result("gpu-4")]), ("p6", "u6"))
    deleting["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    claims.append(deleting)
    assert waiting_pods(claims, DRIVER, NODE, prepared={"up"}) == [
        WaitingPod("ns", "p1", "u1", ("a", "b"), ("ua", "ub")),
        WaitingPod("ns", "p2", "u2", ("b",), ("ub",)),
    ]


def test_a_waiting_pod_is_annotated_with_an_event_each_time_the_plugin_comes_back():
    api = InMemoryKubeApi()
    api.claims[("ns", "a")] = reserved(allocated_claim("ns", "a", "ua", [result("gpu-0")]), ("p1", "u1"))
    api.claims[("ns", "done")] = reserved(allocated_claim("ns", "done", "ud", [result("gpu-1")]), ("p2", "u2"))
    api.pods = {("ns", "p1"): pod("p1", "u1"), ("ns", "p2"): pod("p2", "u2")}
    now = [datetime(2026, 12, 1, 0, 0, 0, tzinfo=UTC)]
    asked: list[set[str]] = []
    retries = PrepareRetries(api, DRIVER, NODE, prepared=lambda: {"ud"}, clock=lambda: now[0], asked=asked.append)

    assert retries.retry_once("the plugin is registered") == ["ns/p1"]
    assert asked == [{"ua"}]  # the claims kubelet was asked about (their cancelled answers no longer count)
    first = api.pods[("ns", "p1")]["metadata"]["annotations"][ANNOTATION]
    assert first == "2026-12-01T00:00:00.000000Z"
    assert "annotations" not in api.pods[("ns", "p2")]["metadata"]  # its claim is prepared
    (event,) = api.events
    assert event["reason"] == EVENT_REASON and event["type"] == "Normal"
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "namespace": "ns",
        "name": "p1",
        "uid": "u1",
        "resourceVersion": None,
    }
    assert event["message"].startswith("the plugin is registered: asked kubelet to prepare claim(s) a now")

    now[0] += timedelta(microseconds=1)  # a second return within the same second still changes the pod
    retries.retry_once("the driver is loaded again")
    assert api.pods[("ns", "p1")]["metadata"]["annotations"][ANNOTATION] != first
    assert len(api.events) == 2


def test_a_pod_gone_or_recreated_under_its_name_is_left_alone():
    api = InMemoryKubeApi()
    api.claims[("ns", "a")] = reserved(allocated_claim("ns", "a", "ua", [result("gpu-0")]), ("p1", "u1"), ("p2", "u2"))
    api.pods = {("ns", "p1"): pod("p1", "another-uid")}  # p2 is gone
    retries = PrepareRetries(api, DRIVER, NODE, prepared=set)
    assert retries.retry_once("back") == []
    assert "annotations" not in api.pods[("ns", "p1")]["metadata"] and not api.events


def test_requests_are_served_on_the_workers_thread_until_it_stops(caplog):
    api = InMemoryKubeApi()
    api.claims[("ns", "a")] = reserved(allocated_claim("ns", "a", "ua", [result("gpu-0")]), ("p1", "u1"))
    api.pods = {("ns", "p1"): pod("p1", "u1")}
    retries = PrepareRetries(api, DRIVER, NODE, prepared=set)
    api.unavailable = True
    retries.start()
    try:
        retries.request("registered")  # the API server away: logged, the worker goes on
        failed = "cannot ask kubelet to retry waiting pods: connection refused"
        wait_until("the failure logged", lambda: failed in caplog.text, timeout_s=5, interval=0.01)
        api.unavailable = False
        retries.request("registered")
        wait_until("the pod annotated", lambda: api.events, timeout_s=5, interval=0.01)
    finally:
        retries.stop()
    assert ANNOTATION in api.pods[("ns", "p1")]["metadata"]["annotations"]


def test_a_prepare_whose_call_kubelet_cancelled_counts_as_waiting_until_a_call_is_answered(node):
    """Kubelet closes its connection to a rolling update's old instance when that one deregisters,
    cancelling a prepare in flight; the prepare completes all the same, and kubelet, which never saw
    the answer, waits for its next pod sync. Such a claim is retried like one never prepared, also
    after the next instance's start-up check, until a call for it is answered."""
    api, env = node
    api.claims[("ns", "a")] = allocated_claim("ns", "a", "ua", [result("gpu-0")])
    changed: list[list[str]] = []
    service = DraV1Service(
        env.preparer, lambda uids, answered: changed.append(env.preparer.record_answer(uids, answered))
    )
    request = dra_v1_pb2.NodePrepareResourcesRequest(claims=[dra_v1_pb2.Claim(namespace="ns", name="a", uid="ua")])

    assert not service.NodePrepareResources(request, CallContext(active=False)).claims["ua"].error
    assert changed == [["ns/a"]]
    assert "ua" in env.claims.all() and "ua" not in env.claims.answered()  # prepared, and kubelet does not know
    env.preparer.check_prepared()  # the next instance's start-up check is no answer to kubelet
    assert "ua" not in env.claims.answered()

    assert not service.NodePrepareResources(request, CallContext()).claims["ua"].error  # kubelet's retry
    assert changed == [["ns/a"], ["ns/a"]] and env.claims.answered() == {"ua"}
    assert not service.NodePrepareResources(request, CallContext()).claims["ua"].error
    assert changed[-1] == []  # answered already: nothing written


def test_the_answered_mark_is_written_only_when_false_so_an_older_plugin_reads_the_record():
    device = PreparedDevice(
        request_names=("gpu",), pool=NODE, device="gpu-0", cdi_ids=("gpu.fgpu.dev/gpu=x",), kind="whole",
        gpu_uuid="GPU-0", gpu_index=0,
    )  # fmt: skip
    claim = PreparedClaim("ua", "ns", "a", (device,))
    assert "answered" not in claim.to_json()
    assert PreparedClaim.from_json(claim.to_json()) == claim
    cancelled = replace(claim, answered=False)
    assert cancelled.to_json()["answered"] is False and PreparedClaim.from_json(cancelled.to_json()) == cancelled
    assert PreparedClaim.from_json({**claim.to_json(), "from_a_newer_plugin": 1}) == claim


def test_a_registration_asks_again_once_the_replaced_instance_has_stopped():
    """The instance it replaces serves calls sent to it before its withdrawal for its drain: one
    that kubelet gave up on meanwhile is only marked after this instance's first pass."""
    api = InMemoryKubeApi()
    api.pods = {("ns", "p1"): pod("p1", "u1")}
    passes: list[Collection[str]] = []  # the claims each pass asked about (told at its end)
    retries = PrepareRetries(api, DRIVER, NODE, prepared=set, asked=passes.append)
    retries.start()
    try:
        retries.request("registered", again_after_s=0.3)
        wait_until("the first pass", lambda: passes, timeout_s=5, interval=0.01)
        assert not api.events  # it found no waiting claim
        api.claims[("ns", "a")] = reserved(allocated_claim("ns", "a", "ua", [result("gpu-0")]), ("p1", "u1"))
        wait_until("the second pass annotated the pod", lambda: api.events, timeout_s=5, interval=0.01)
        wait_until("the second pass ended", lambda: len(passes) == 2, timeout_s=5, interval=0.01)
        assert passes == [set(), {"ua"}]
        time.sleep(0.5)
        assert len(passes) == 2 and len(api.events) == 1  # and no third
    finally:
        retries.stop()
