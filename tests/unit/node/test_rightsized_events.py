"""The RightSized Event of a claim automatic sizing changed: its message from the claim's
annotation and spec, at most one per claim, none for an annotation it cannot read, and prepare
never waiting for it."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from driver.claims.refs import ClaimRef
from driver.kube.errors import KubeError
from driver.node.rightsized_events import ANNOTATION_LIMIT, RightsizedEvents, rightsized_event, sized_requests
from driver.sizing.initial import ORIGINAL_ANNOTATION
from testbed.fakes import InMemoryKubeApi, allocated_claim, result

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
REPORTER = "gpu.fgpu.dev/node-a"
ORIGINAL = json.dumps({"gpu": {"compute": "25", "memory": "10Gi"}})


def sized_claim(
    name: str = "pod-gpu-x7k2p", uid: str = "uid-1", original: str | None = ORIGINAL, device: str = "gpu-0"
) -> dict[str, Any]:
    """A claim allocated on node-a as the webhook sized it: request gpu now 2560Mi and 9%."""
    claim = allocated_claim("team-a", name, uid, [result(device)])
    capacity = {"requests": {"memory": "2560Mi", "compute": "9"}}
    claim["spec"]["devices"]["requests"] = [
        {"name": "gpu", "exactly": {"deviceClassName": "mps", "capacity": capacity}}
    ]
    claim["metadata"]["resourceVersion"] = "41"
    if original is not None:
        claim["metadata"]["annotations"] = {ORIGINAL_ANNOTATION: original}
    return claim


def ref_of(claim: dict[str, Any]) -> ClaimRef:
    meta = claim["metadata"]
    return ClaimRef(meta["namespace"], meta["name"], meta["uid"])


def wait_until(condition: Callable[[], Any], timeout_s: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
    return value


def test_the_event_names_each_sized_request_now_and_before():
    claim = sized_claim()
    event = rightsized_event(claim, sized_requests(claim), REPORTER, NOW)
    assert event["message"] == (
        "request gpu sized to compute 9, memory 2560Mi from compute 25, memory 10Gi "
        f"by its workload's usage history ({ORIGINAL_ANNOTATION})"
    )
    assert (event["type"], event["reason"], event["source"]) == ("Normal", "RightSized", {"component": REPORTER})
    assert event["metadata"] == {"name": "uid-1.rightsized", "namespace": "team-a"}  # one name per claim
    assert event["involvedObject"] == {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "name": "pod-gpu-x7k2p",
        "namespace": "team-a",
        "uid": "uid-1",
        "resourceVersion": "41",
    }


def test_only_the_requests_the_annotation_names_in_the_claims_order():
    claim = sized_claim(original=json.dumps({"b": {}, "gpu": {"memory": "4Gi"}}))
    claim["spec"]["devices"]["requests"] = [
        {"name": "gpu", "exactly": {"capacity": {"requests": {"memory": "1Gi"}}}},
        {"name": "a", "exactly": {}},
        {"name": "b", "exactly": {"capacity": {"requests": {"memory": "3Gi"}}}},
    ]
    event = rightsized_event(claim, sized_requests(claim), REPORTER, NOW)
    assert event["message"].startswith(
        "request gpu sized to memory 1Gi from memory 4Gi; request b sized to memory 3Gi from the class's default by"
    )


def test_a_request_moved_to_another_kind_shows_its_classes():
    """The webhook keeps such a request's deviceClassName, selectors and capacity (a whole GPU here)."""
    selectors = [{"cel": {"expression": 'device.attributes["gpu.fgpu.dev"].productName.startsWith("NVIDIA H100")'}}]
    claim = sized_claim(original=json.dumps({"gpu": {"deviceClassName": "gpu.fgpu.dev", "selectors": selectors}}))
    claim["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "mps.gpu.fgpu.dev"
    assert rightsized_event(claim, sized_requests(claim), REPORTER, NOW)["message"].startswith(
        "request gpu sized to class mps.gpu.fgpu.dev, compute 9, memory 2560Mi from class gpu.fgpu.dev by"
    )


def test_a_partition_moved_to_a_smaller_profile_shows_both_profiles():
    def pinned(profile: str) -> list[dict]:
        return [{"cel": {"expression": f'device.attributes["gpu.fgpu.dev"].profile == "{profile}"'}}]

    original = {"gpu": {"deviceClassName": "mig.gpu.fgpu.dev", "selectors": pinned("2g.20gb")}}
    claim = sized_claim(original=json.dumps(original))
    claim["spec"]["devices"]["requests"][0]["exactly"] = {"deviceClassName": "mig.gpu.fgpu.dev",
                                                          "selectors": pinned("1g.10gb")}  # fmt: skip
    assert rightsized_event(claim, sized_requests(claim), REPORTER, NOW)["message"].startswith(
        "request gpu sized to class mig.gpu.fgpu.dev, profile 1g.10gb from class mig.gpu.fgpu.dev, profile 2g.20gb by"
    )
    original["gpu"]["selectors"] = pinned("2g\\nInjected")
    claim["metadata"]["annotations"][ORIGINAL_ANNOTATION] = json.dumps(original)
    with pytest.raises(ValueError, match="is not a MIG profile name"):
        sized_requests(claim)


@pytest.mark.parametrize(
    ("original", "why"),
    [
        ("{not json", "Expecting property name"),
        ("[]", "not an object of 1 to 32 requests"),
        ("{}", "not an object of 1 to 32 requests"),
        ("[" * 100_000, "longer than"),
        ("[" * (ANNOTATION_LIMIT - 1) + "]", "nested too deep"),
        (json.dumps({"other": {"memory": "1Gi"}}), "names request 'other', which the claim does not have"),
        (json.dumps({"gpu": "10Gi"}), "request gpu: not an object of at most 8 capacities"),
        (json.dumps({"gpu": {"memory": 10}}), "request gpu: memory is not a quantity"),
        (json.dumps({"gpu": {"memory": "ten"}}), "invalid quantity"),
        (json.dumps({"gpu": {"memory": "1" * 65}}), "at most 64 characters"),
        (json.dumps({"gpu": {"mem\nory": "1Gi"}}), "is not a capacity name"),
        (json.dumps({"gpu": {f"c{i}": "1" for i in range(9)}}), "at most 8 capacities"),
        (json.dumps({"gpu": {"deviceClassName": "Not A Class"}}), "deviceClassName is not a class name"),
        (json.dumps({"gpu": {"deviceClassName": "gpu.fgpu.dev", "count": 2}}), "'count' is not a field sizing keeps"),
        (json.dumps({"gpu": {"deviceClassName": "gpu.fgpu.dev", "capacity": "big"}}), "capacity is not an object"),
    ],
)
def test_an_annotation_not_as_the_webhook_writes_it_is_a_log_line_and_no_event(original, why, caplog):
    api = InMemoryKubeApi()
    claim = sized_claim(original=original)
    with caplog.at_level(logging.WARNING):
        RightsizedEvents(api, REPORTER, lambda: NOW).record(ref_of(claim), claim)
    assert api.events == []
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"annotation {ORIGINAL_ANNOTATION} not understood" in line and "pod-gpu-x7k2p" in line and why in line
    assert "\n" not in line


def test_a_request_sizing_does_not_change_is_not_read_as_sized():
    claim = sized_claim()
    claim["spec"]["devices"]["requests"] = [{"name": "gpu", "firstAvailable": [{"name": "a"}]}]
    with pytest.raises(ValueError, match="not an `exactly` request"):
        sized_requests(claim)


def test_the_event_is_written_once_per_claim(caplog):
    api = InMemoryKubeApi()
    claim = sized_claim()
    with caplog.at_level(logging.WARNING):
        RightsizedEvents(api, REPORTER, lambda: NOW).record(ref_of(claim), claim)
        RightsizedEvents(api, REPORTER, lambda: NOW).record(ref_of(claim), claim)  # a restarted plugin's
    (event,) = api.events
    assert event["involvedObject"]["uid"] == "uid-1"
    assert caplog.records == []  # the second one's refusal is no news
    other = sized_claim(name="pod-gpu-b2c3d", uid="uid-2")
    RightsizedEvents(api, REPORTER, lambda: NOW).record(ref_of(other), other)
    assert [e["involvedObject"]["uid"] for e in api.events] == ["uid-1", "uid-2"]


def test_an_event_the_api_server_does_not_take_is_a_log_line(caplog):
    api = InMemoryKubeApi()
    api.unavailable = True
    claim = sized_claim()
    with caplog.at_level(logging.WARNING):
        RightsizedEvents(api, REPORTER, lambda: NOW).record(ref_of(claim), claim)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "cannot record its RightSized event" in line and "uid-1" in line


def test_the_worker_writes_the_events_of_sized_claims_only():
    api = InMemoryKubeApi()
    events = RightsizedEvents(api, REPORTER, lambda: NOW)
    events.start()
    try:
        plain, sized = sized_claim(name="plain", uid="uid-plain", original=None), sized_claim()
        events.prepared(ref_of(plain), plain)
        events.prepared(ref_of(sized), sized)
        barrier = sized_claim(name="last", uid="uid-last")
        events.prepared(ref_of(barrier), barrier)
        wait_until(lambda: len(api.events) == 2)  # written in order: the barrier's is the last
    finally:
        events.stop()
    assert [e["involvedObject"]["name"] for e in api.events] == ["pod-gpu-x7k2p", "last"]


def test_prepare_answers_without_waiting_for_the_event_and_writes_it_once(node, monkeypatch):
    api, env = node
    let, creating = threading.Event(), threading.Event()
    create_event = api.create_event

    def held(namespace: str, event: dict[str, Any]) -> dict[str, Any]:  # the API server slow to take it
        creating.set()
        if not let.wait(10):
            raise KubeError("never let")
        return create_event(namespace, event)

    monkeypatch.setattr(api, "create_event", held)
    events = env.preparer.rightsized
    events.start()
    try:
        claim = sized_claim()
        api.claims[("team-a", claim["metadata"]["name"])] = claim
        ref = ref_of(claim)
        assert env.preparer.prepare([ref])[ref.uid].error == ""  # while the API server holds the Event
        assert creating.wait(5) and api.events == []
        let.set()
        wait_until(lambda: api.events)
        assert env.preparer.unprepare([ref]) == {ref.uid: ""}
        assert env.preparer.prepare([ref])[ref.uid].error == ""  # a prepare afresh: the claim read again
        assert env.preparer.prepare([ref])[ref.uid].error == ""  # kubelet's repeat: from the record
        barrier = sized_claim(name="last", uid="uid-last", device="gpu-1")
        api.claims[("team-a", "last")] = barrier
        assert env.preparer.prepare([ref_of(barrier)])["uid-last"].error == ""
        wait_until(lambda: len(api.events) == 2)  # written in order: the claim's second try is done
    finally:
        events.stop()
    assert [(e["reason"], e["involvedObject"]["uid"]) for e in api.events] == [
        ("RightSized", "uid-1"),
        ("RightSized", "uid-last"),
    ]
