"""A node type's template (driver/inventory/templates.py) from an inventory: no serial facts, no
taints, and bindings only where two or more devices will share a value."""

from __future__ import annotations

from driver.inventory.devices import Attribute, DeviceTaint, Inventory, PublishedDevice
from driver.inventory.templates import attribute_bindings, karpenter_document, node_type_template


def device(name: str, uuid: str, taints: tuple[DeviceTaint, ...] = ()) -> PublishedDevice:
    attributes = {"uuid": Attribute("string", uuid), "index": Attribute("int", int(name.split("-")[1]))}
    return PublishedDevice(name=name, attributes=attributes, taints=taints)


def test_a_template_has_no_serial_facts_no_taints_and_binds_only_groups_of_two_or_more():
    taint = DeviceTaint("gpu.fgpu.dev/xid", "79", "NoSchedule", "2026-12-05T00:00:00Z")
    inventory = Inventory(
        devices=[device("gpu-0", "GPU-a", (taint,)), device("gpu-0-mps", "GPU-a"), device("gpu-1", "GPU-b")],
        counter_sets=[],
    )
    template = node_type_template("gpu.fgpu.dev", "box", inventory)
    (spec,) = template.slice_specs
    assert "nodeName" not in spec and spec["pool"] == {"name": "box", "generation": 1, "resourceSliceCount": 1}
    assert [d["attributes"] for d in spec["devices"]] == [{"index": {"int": i}} for i in (0, 0, 1)]
    assert not any("taints" in d for d in spec["devices"])
    assert [(b.attribute, b.devices) for b in attribute_bindings("gpu.fgpu.dev", inventory)] == [
        ("gpu.fgpu.dev/uuid", ("gpu-0", "gpu-0-mps"))
    ]
    assert karpenter_document(template)["attributeBindings"] == [
        {
            "attribute": "gpu.fgpu.dev/uuid",
            "devices": [
                {"driver": "gpu.fgpu.dev", "pool": "box", "device": "gpu-0"},
                {"driver": "gpu.fgpu.dev", "pool": "box", "device": "gpu-0-mps"},
            ],
        }
    ]
