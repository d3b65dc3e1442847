"""The fleet publisher's passes over an in-memory API server: each labelled node gets its
machine's pool, a changed type rewrites it above its generation, a node gone loses its slices,
and a pass with nothing to do writes nothing."""

from __future__ import annotations

from typing import Any

from driver.fleet.machine_types import MACHINE_LABEL, OFFER_ANNOTATION, MachineType, machine_inventory
from driver.fleet.publisher import PUBLISHER, PUBLISHER_LABEL, FleetPublisher
from driver.inventory.slices import build_slices
from testbed.controller_api import InMemoryControllerApi

DRIVER = "gpu.fgpu.dev"


def labelled_node(name: str, machine: str, offer: str | None = None) -> dict[str, Any]:
    annotations = {OFFER_ANNOTATION: offer} if offer else {}
    return {"metadata": {"name": name, "labels": {MACHINE_LABEL: machine}, "annotations": annotations}}


def one_pass(publisher: FleetPublisher) -> int:
    publisher.nodes.relist()
    publisher.slices.relist()
    return publisher.reconcile().written


def pools(api: InMemoryControllerApi) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for body in api.store["slices"].values():
        found.setdefault(body["spec"]["nodeName"], []).append(body)
    return found


def test_each_labelled_node_gets_the_pool_its_plugin_would_publish() -> None:
    api = InMemoryControllerApi()
    api.put("nodes", labelled_node("h1", "dgx-h100"))
    api.put("nodes", labelled_node("l1", "l4x4", offer="whole,mps"))
    api.put("nodes", {"metadata": {"name": "cpu", "labels": {}}})  # no machine label: not ours
    publisher = FleetPublisher(api, DRIVER, "whole,mig")

    assert one_pass(publisher) == 2
    published = pools(api)
    assert sorted(published) == ["h1", "l1"]
    expected = build_slices(DRIVER, "l1", machine_inventory(MachineType("l4x4", "mps,whole")), 1, None)
    assert [s["spec"] for s in sorted(published["l1"], key=lambda s: s["metadata"]["name"])] == [
        s["spec"] for s in expected
    ]
    for body in published["h1"]:
        assert body["metadata"]["labels"] == {PUBLISHER_LABEL: PUBLISHER}
        assert body["metadata"]["ownerReferences"][0] == {
            "apiVersion": "v1", "kind": "Node", "name": "h1", "uid": "uid-h1", "controller": True,
        }  # fmt: skip
    assert one_pass(publisher) == 0  # up to date: nothing written


def test_a_changed_machine_type_rewrites_the_pool_above_its_generation() -> None:
    api = InMemoryControllerApi()
    api.put("nodes", labelled_node("n1", "dgx-h100"))
    publisher = FleetPublisher(api, DRIVER, "whole")
    one_pass(publisher)
    api.put("nodes", labelled_node("n1", "dgx-h100", offer="whole,mps"))

    assert one_pass(publisher) == 1
    published = pools(api)["n1"]
    assert {s["spec"]["pool"]["generation"] for s in published} == {2}
    assert any(d["name"].endswith("-mps") for s in published for d in s["spec"].get("devices", []))


def test_a_node_gone_or_unlabelled_loses_its_slices_and_a_bad_label_publishes_nothing() -> None:
    api = InMemoryControllerApi()
    for name in ("n1", "n2", "n3"):
        api.put("nodes", labelled_node(name, "l4x4"))
    publisher = FleetPublisher(api, DRIVER, "whole")
    one_pass(publisher)
    del api.store["nodes"]["/n1"]
    api.put("nodes", {"metadata": {"name": "n2", "labels": {}}})
    api.put("nodes", labelled_node("n3", "no-such-machine"))

    assert one_pass(publisher) == 3
    assert pools(api) == {}


def test_slices_someone_else_published_are_left_alone() -> None:
    api = InMemoryControllerApi()
    plugin_slice = build_slices(DRIVER, "real-node", machine_inventory(MachineType("l4x4", "whole")), 1, None)[0]
    api.put("slices", plugin_slice)  # a real node plugin's: no publisher label
    publisher = FleetPublisher(api, DRIVER, "whole")

    assert one_pass(publisher) == 0
    assert list(pools(api)) == ["real-node"]
