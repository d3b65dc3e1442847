"""The claims' status.devices: written after prepare, removed after unprepare, repaired by the
reconciler, other drivers' entries left alone; with the in-memory API's server-side apply."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

import pytest
from kubernetes.client.exceptions import ApiException

from driver.claims.refs import ClaimRef
from driver.kube.client import translated_errors
from driver.kube.errors import (
    ConflictError,
    KubeError,
    KubeUnavailableError,
    NotFoundError,
    RefusedError,
    TooManyRequestsError,
)
from driver.node import metrics
from driver.node.claim_status import CONFLICT_ATTEMPTS, ClaimStatusWriter, device_data, device_entry, up_to_date
from driver.node.reconcile import ClaimReconciler
from driver.node.state import PreparedDevice
from testbed.fakes import InMemoryKubeApi, result
from tests.support.claim_status import NIC_ENTRY, add_claim, status_devices

DRIVER = "gpu.fgpu.dev"


def refusals(reason: str) -> float:
    return metrics.REGISTRY.get_sample_value("fgpu_claim_status_refusals_total", {"reason": reason}) or 0.0


def change(api: InMemoryKubeApi, ref: ClaimRef) -> None:
    """Another writer changes the claim (kube-scheduler reserving it for a pod)."""
    claim = api.claims[(ref.namespace, ref.name)]
    claim["status"]["reservedFor"] = [{"resource": "pods", "name": "p", "uid": "pod-uid"}]
    api._bump(claim)


def test_a_refused_write_is_reported_once_and_tried_again_only_when_the_claim_changes(
    node, caplog: pytest.LogCaptureFixture
):
    api, env = node
    ref = add_claim(api, "refused", [result("gpu-4")])
    reconciler = ClaimReconciler(api, env.preparer, env.claims)
    api.status_refusal = "forbidden: cannot associated-node:update resourceclaims/driver"
    before = refusals("forbidden")
    with caplog.at_level(logging.WARNING):
        prepared = env.preparer.prepare([ref])[ref.uid]
    assert prepared.error == "" and env.cdi.spec_path(ref.uid).exists()
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "default/refused (uid uid-refused): writing its status.devices was refused" in line
    assert "403 forbidden" in line and "\n" not in line
    (event,) = api.events
    assert event["involvedObject"]["name"] == "refused" and event["involvedObject"]["uid"] == ref.uid
    assert (event["type"], event["reason"]) == ("Warning", "DeviceStatusRefused")
    assert "claim default/refused" in event["message"] and "403 forbidden" in event["message"]
    assert refusals("forbidden") == before + 1

    for _ in range(3):  # the same claim: not sent again, not reported again
        reconciler.reconcile_once()
    api.status_refusal = ""  # e.g. an admin fixed the role: the claim is the same, so it still waits
    reconciler.reconcile_once()
    assert refusals("forbidden") == before + 1 and len(api.events) == 1 and api.status_writes == 0
    assert set(status_devices(api, ref)) == {"eth1"}

    api.status_refusal = "forbidden: still"
    change(api, ref)
    reconciler.reconcile_once()  # changed: tried once more, refused for a new cause: a second Event
    assert refusals("forbidden") == before + 2 and len(api.events) == 2
    change(api, ref)
    api.status_refusal = ""
    reconciler.reconcile_once()
    assert set(status_devices(api, ref)) == {"eth1", "gpu-4"}
    assert env.preparer.status.refusal(ref.uid) is None


def test_the_same_cause_after_a_change_counts_but_makes_no_second_event(node):
    api, env = node
    ref = add_claim(api, "again", [result("gpu-4")])
    api.status_refusal, api.status_refusal_code = "spec: field is immutable", 422
    before = refusals("invalid")
    env.preparer.prepare([ref])
    change(api, ref)
    ClaimReconciler(api, env.preparer, env.claims).reconcile_once()
    assert refusals("invalid") == before + 2 and len(api.events) == 1


def test_a_refused_clear_waits_for_a_change_and_an_unreachable_server_for_nothing(node):
    api, env = node
    ref = add_claim(api, "cleared", [result("gpu-4")])
    reconciler = ClaimReconciler(api, env.preparer, env.claims)
    env.preparer.prepare([ref])
    api.status_refusal = "forbidden"
    assert env.preparer.unprepare([ref]) == {ref.uid: ""}
    assert set(status_devices(api, ref)) == {"eth1", "gpu-4"}
    assert env.preparer.status.pending_clears() == [ref]
    api.status_refusal = ""
    reconciler.reconcile_once()  # unchanged claim: the clear waits
    assert set(status_devices(api, ref)) == {"eth1", "gpu-4"}
    api.unavailable = True
    reconciler.reconcile_once()  # the API server down: kept for later
    api.unavailable = False
    change(api, ref)
    reconciler.reconcile_once()
    assert status_devices(api, ref) == {"eth1": NIC_ENTRY}
    assert env.preparer.status.pending_clears() == []


def test_a_write_that_loses_a_race_is_redone_on_a_fresh_read(node, caplog: pytest.LogCaptureFixture):
    api, env = node
    ref = add_claim(api, "raced", [result("gpu-4")])
    api.status_conflicts = 2  # e.g. kube-scheduler and another driver wrote the claim in between
    assert env.preparer.prepare([ref])[ref.uid].error == ""
    assert set(status_devices(api, ref)) == {"eth1", "gpu-4"} and api.status_conflicts == 0

    assert env.preparer.unprepare([ref]) == {ref.uid: ""}
    api.status_conflicts = CONFLICT_ATTEMPTS  # every attempt lost: left to the reconciler, not parked
    writer = ClaimStatusWriter(api, DRIVER, "node-a")
    device = PreparedDevice(("gpu",), "node-a", "gpu-4", ())
    with caplog.at_level(logging.WARNING):
        assert not writer.publish(ref, [device], 1)
    assert "lost 3 races in a row" in caplog.text and writer.refusal(ref.uid) is None
    assert writer.publish(ref, [device], 1)


def test_the_reconciler_restores_lost_entries_and_leaves_current_ones(node):
    api, env = node
    ref = add_claim(api, "wiped", [result("gpu-5")])
    env.preparer.prepare([ref])
    reconciler = ClaimReconciler(api, env.preparer, env.claims)
    version = api.claims[("default", "wiped")]["metadata"]["resourceVersion"]
    reconciler.reconcile_once()
    assert api.claims[("default", "wiped")]["metadata"]["resourceVersion"] == version  # up to date: no write
    api.claims[("default", "wiped")]["status"]["devices"] = [NIC_ENTRY]  # e.g. a plugin restarted before its write
    reconciler.reconcile_once()
    assert set(status_devices(api, ref)) == {"eth1", "gpu-5"}


def test_writes_never_reach_a_claim_recreated_under_the_same_name(node):
    api, env = node
    ref = add_claim(api, "reborn", [result("gpu-6")])
    env.preparer.prepare([ref])
    api.status_refusal = "forbidden"
    env.preparer.unprepare([ref])
    api.status_refusal = ""
    add_claim(api, "reborn-new", [result("gpu-6")])
    api.claims[("default", "reborn")] = api.claims.pop(("default", "reborn-new"))
    api.status_owners[("default", "reborn")] = api.status_owners.pop(("default", "reborn-new"))
    env.preparer.status.retry_clears()
    assert env.preparer.status.pending_clears() == []  # the old claim is gone: nothing left to remove
    writer = ClaimStatusWriter(api, DRIVER, "node-a")
    assert writer.publish(ref, [PreparedDevice(("gpu",), "node-a", "gpu-6", ())], 1)  # ours is gone: done
    assert set(status_devices(api, ref)) == {"eth1"}


def test_records_from_before_the_status_fields_report_what_they_have():
    old_mig = PreparedDevice(
        ("gpu",), "node-a", "gpu-1-mig-1g10gb-0", (), kind="mig", gpu_uuid="GPU-1", gpu_index=1, mig_start=0, mig_size=1
    )
    assert device_data(old_mig) == {
        "kind": "mig",
        "gpuUUID": "GPU-1",
        "gpuIndex": 1,
        "mig": {"placement": {"start": 0, "size": 1}},
    }
    when = datetime(2026, 5, 4, 3, 2, 1, 987654, tzinfo=UTC)
    entry = device_entry(DRIVER, old_mig, 3, when)
    assert entry["conditions"][0]["lastTransitionTime"] == "2026-05-04T03:02:01Z"  # RFC 3339, whole seconds
    claim = {"status": {"devices": [{**entry, "conditions": [{**entry["conditions"][0], "status": "False"}]}]}}
    assert not up_to_date([entry], claim)  # not Ready
    assert up_to_date([entry], {"status": {"devices": [entry]}})
    assert not up_to_date([entry], {"status": {"devices": [{**entry, "data": {"kind": "mig"}}]}})


def test_a_refusal_names_the_servers_reason_in_one_line():
    body = json.dumps({"kind": "Status", "message": 'status.devices: Forbidden:\nchanging status.devices requires "x"'})
    with pytest.raises(KubeError) as refused, translated_errors():
        raise ApiException(status=422, reason="Unprocessable Entity", http_resp=None) from None
    assert str(refused.value) == "API server refused the request: 422 Unprocessable Entity"
    error = ApiException(status=422, reason="Unprocessable Entity")
    error.body = body
    with pytest.raises(KubeError) as refused, translated_errors():
        raise error
    assert str(refused.value) == (
        'API server refused the request: 422 status.devices: Forbidden: changing status.devices requires "x"'
    )


@pytest.mark.parametrize(
    ("status", "raised"),
    [
        (422, RefusedError),
        (403, RefusedError),
        (400, RefusedError),
        (404, NotFoundError),
        (409, ConflictError),
        (429, TooManyRequestsError),  # a KubeUnavailableError: retried as one
        (503, KubeUnavailableError),
    ],
)
def test_only_refusals_that_a_retry_cannot_fix_are_refused_errors(status: int, raised: type[KubeError]):
    with pytest.raises(KubeError) as caught, translated_errors():
        raise ApiException(status=status, reason="x")
    assert type(caught.value) is raised
    assert isinstance(caught.value, KubeUnavailableError) == (status in (429, 503))
    if raised is RefusedError:
        assert caught.value.status == status
