"""A node's machine type from its label and annotation, and the devices a node of a type publishes."""

from __future__ import annotations

import pytest

from driver.fleet.machine_types import (
    MACHINE_LABEL,
    OFFER_ANNOTATION,
    MachineType,
    MachineTypeError,
    machine_inventory,
    machine_type_of,
)
from driver.inventory.discovery import discover_gpus
from driver.inventory.offers import node_inventory
from driver.inventory.sharing import load_sharing_config
from driver.nvml.session import NvmlSession


def node(labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None) -> dict:
    return {"metadata": {"name": "n1", "uid": "u1", "labels": labels or {}, "annotations": annotations or {}}}


def test_a_node_without_the_label_has_no_machine_type() -> None:
    assert machine_type_of(node({"other": "x"}), "whole") is None


def test_the_annotation_overrides_the_default_offer_in_a_canonical_order() -> None:
    labelled = node({MACHINE_LABEL: "l4x4"}, {OFFER_ANNOTATION: "mps, whole"})
    assert machine_type_of(labelled, "whole,mig") == MachineType("l4x4", "mps,whole")
    assert machine_type_of(node({MACHINE_LABEL: "l4x4"}), "whole") == MachineType("l4x4", "whole")


@pytest.mark.parametrize(
    ("labels", "annotations", "field"),
    [
        ({MACHINE_LABEL: "/etc/passwd"}, {}, MACHINE_LABEL),  # never a file on the publisher's host
        ({MACHINE_LABEL: "dgx-h999"}, {}, MACHINE_LABEL),
        ({MACHINE_LABEL: "l4x4"}, {OFFER_ANNOTATION: "whole," * 100}, OFFER_ANNOTATION),
        ({MACHINE_LABEL: "l4x4"}, {OFFER_ANNOTATION: "whole,unknown-kind"}, OFFER_ANNOTATION),
    ],
)
def test_a_bad_label_or_annotation_is_refused_naming_it(labels: dict, annotations: dict, field: str) -> None:
    with pytest.raises(MachineTypeError, match=field):
        machine_type_of(node(labels, annotations), "whole")


def test_an_offer_that_leaves_a_gpu_without_devices_is_refused_naming_the_annotation() -> None:
    with pytest.raises(MachineTypeError, match=f"annotation {OFFER_ANNOTATION}: .*no device"):
        machine_inventory(MachineType("l4x4", "mig"))  # L4s have no MIG


def test_a_machine_type_publishes_what_the_plugin_on_that_machine_discovers(monkeypatch: pytest.MonkeyPatch) -> None:
    # The plugin's path (fgpu discover): the mock from the environment's state, if any; the fleet's
    # is a fresh machine whatever the environment says.
    monkeypatch.delenv("FGPU_NVML_MOCK_STATE", raising=False)
    session = NvmlSession.open("mock:dgx-h100")
    try:
        expected = node_inventory(discover_gpus(session), load_sharing_config("whole,mps", None))
    finally:
        session.close()
    assert machine_inventory(MachineType("dgx-h100", "mps,whole")) == expected
