"""The controller's room for pods built pass after pass (driver/controller/fit.py's RoomReader):
what changed since the last pass is read again, what did not is reused, what is gone is
forgotten, and the room is the one a fresh read builds."""

from __future__ import annotations

import copy
from typing import Any

from driver.allocator.model import claim_from_object
from driver.controller.fit import RoomReader, node_room

JsonObject = dict[str, Any]


def node(name: str, cpu: str = "8", version: str = "1") -> JsonObject:
    return {
        "metadata": {"name": name, "resourceVersion": version},
        "spec": {},
        "status": {"allocatable": {"cpu": cpu, "memory": "32Gi", "pods": "110"}},
    }


def pod(name: str, cpu: str, node_name: str = "", claim: str = "", version: str = "1") -> JsonObject:
    spec: JsonObject = {"containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}]}
    if node_name:
        spec["nodeName"] = node_name
    if claim:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
    return {
        "metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}", "resourceVersion": version},
        "spec": spec,
        "status": {"phase": "Running" if node_name else "Pending"},
    }


def claim(name: str) -> JsonObject:
    return {
        "metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.fgpu.dev"}}]}},
    }


def resized(obj: JsonObject, cpu: str, version: str) -> JsonObject:
    changed = copy.deepcopy(obj)
    changed["spec"]["containers"][0]["resources"]["requests"]["cpu"] = cpu
    changed["metadata"]["resourceVersion"] = version
    return changed


def test_a_pod_resized_between_passes_is_read_again_and_the_others_are_reused() -> None:
    reader = RoomReader()
    running, other = pod("a", "2", "n1"), pod("b", "1", "n1")
    first = reader.room([node("n1")], [running, other], [])
    assert first.left("n1")["cpu"] == 5.0
    second = reader.room([node("n1")], [resized(running, "6", "2"), other], [])
    assert second.left("n1")["cpu"] == 1.0  # the new requests, read by its new resourceVersion
    third = reader.room([node("n1")], [resized(running, "6", "2"), other], [])
    assert third.left("n1")["cpu"] == 1.0


def test_a_pod_changed_without_a_new_resource_version_keeps_what_was_read() -> None:
    # What shows the reader keeps: an informer never hands out a changed object under the same
    # resourceVersion, so a room built from one is the same as from the first.
    reader = RoomReader()
    running = pod("a", "2", "n1")
    reader.room([node("n1")], [running], [])
    assert reader.room([node("n1")], [resized(running, "6", "1")], []).left("n1")["cpu"] == 6.0


def test_objects_without_a_resource_version_are_read_every_time() -> None:
    reader = RoomReader()
    running = pod("a", "2", "n1")
    del running["metadata"]["resourceVersion"]
    reader.room([node("n1")], [running], [])
    changed = resized(running, "6", "")
    del changed["metadata"]["resourceVersion"]
    assert reader.room([node("n1")], [changed], []).left("n1")["cpu"] == 2.0


def test_a_node_whose_allocatable_changes_is_read_again() -> None:
    reader = RoomReader()
    reader.room([node("n1", "8")], [pod("a", "2", "n1")], [])
    assert reader.room([node("n1", "16", version="2")], [pod("a", "2", "n1")], []).left("n1")["cpu"] == 14.0


def test_a_pod_gone_and_back_under_its_old_version_is_read_again() -> None:
    # Gone from the caches, it is forgotten: a pod recreated with the same uid is not expected,
    # but nothing kept may outlive what the caches hold.
    reader = RoomReader()
    reader.room([node("n1")], [pod("a", "2", "n1")], [])
    reader.room([node("n1")], [], [])
    assert reader.room([node("n1")], [resized(pod("a", "2", "n1"), "4", "1")], []).left("n1")["cpu"] == 4.0


def test_the_kept_room_is_the_one_a_fresh_read_builds() -> None:
    reader = RoomReader()
    nodes = [node("n1"), node("n2", "4")]
    pods = [pod("a", "2", "n1", claim="c1"), pod("b", "3", claim="c2"), pod("c", "1", "n2")]
    claims = [claim("c1"), claim("c2")]
    reader.room(nodes, pods, claims)
    kept, fresh = reader.room(nodes, pods, claims), node_room(nodes, pods, claims)
    wanted = claim_from_object(claims[1])
    for name in ("n1", "n2"):
        assert kept.left(name) == fresh.left(name)
        assert kept.fits(wanted, name) == fresh.fits(wanted, name)
    assert kept.pods_of.keys() == fresh.pods_of.keys()


def test_claim_pods_reads_a_pod_that_came_with_a_claim_mid_pass() -> None:
    reader = RoomReader()
    reader.room([node("n1")], [], [claim("c1")])
    pods_of = reader.claim_pods([pod("a", "3", claim="c1")], [claim("c1")])
    assert [needs.name for needs in pods_of["team/c1"]] == ["team/a"]
