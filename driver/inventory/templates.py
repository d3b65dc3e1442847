"""A node type's ResourceSlices as an autoscaler's template (pure): what every node of one machine
profile and offer publishes, less what names one node or one physical GPU, for scale from zero.

Every node of a machine type publishes the same devices, attributes, capacities and counters; only
the node name (slice names, `nodeName`, the pool name) and the GPUs' serial facts (NODE_FACT_ATTRIBUTES:
`uuid`, `parentUUID`) differ (tests/unit/inventory/test_identical_slices.py). A template cannot know
the serial facts of a node that does not exist yet, so it leaves them out; where a claim needs devices
to share one (`matchAttribute: gpu.fgpu.dev/parentUUID`: two MIG partitions of one GPU), the template
says which devices will share it (AttributeBinding, Karpenter's `cloudprovider.AttributeBinding`).
The machine profile's topology (`pciBusID`, `pcieRoot`, `numaNode`) and driver version are promised as
they are: a machine type's board lays out its GPUs alike, and a node pool runs one driver.

Two renderings (docs/autoscaling.md): Karpenter's `cloudprovider.DynamicResources` (ResourceSlice
templates: driver, pool, devices or shared counters; attribute bindings), and ResourceSlice objects
without a node, what Cluster Autoscaler's `TemplateNodeInfo` returns for a node group."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from driver.inventory.devices import Inventory
from driver.inventory.slices import build_slices

# Serial facts of one physical GPU: two nodes of one machine type never publish the same values.
NODE_FACT_ATTRIBUTES = frozenset({"uuid", "parentUUID"})
# The fields of Karpenter's cloudprovider.Device (v1.15.0): a template device has no taints.
KARPENTER_DEVICE_FIELDS = ("name", "attributes", "capacity", "allowMultipleAllocations", "consumesCounters")


@dataclass(frozen=True)
class AttributeBinding:
    """Devices that will share one value of `attribute` (fully qualified) on every node of the type."""

    attribute: str
    devices: tuple[str, ...]


@dataclass(frozen=True)
class NodeTypeTemplate:
    driver: str
    pool: str  # the template's pool name; a node's pool is named after the node
    slice_specs: list[dict[str, Any]]  # ResourceSlice specs without nodeName, in publishing order
    bindings: list[AttributeBinding]


def without_node_facts(inventory: Inventory) -> Inventory:
    """The inventory less NODE_FACT_ATTRIBUTES and taints: what every healthy node of the type
    publishes alike (a node's taints are its own news, on its own slices)."""
    devices = [
        replace(d, attributes={k: v for k, v in d.attributes.items() if k not in NODE_FACT_ATTRIBUTES}, taints=())
        for d in inventory.devices
    ]
    return Inventory(devices=devices, counter_sets=inventory.counter_sets)


def attribute_bindings(driver: str, inventory: Inventory) -> list[AttributeBinding]:
    """Per node-fact attribute, the devices that share a value (one GPU's), two or more of them:
    Karpenter ignores a binding of fewer."""
    bindings = []
    for attribute in sorted(NODE_FACT_ATTRIBUTES):
        groups: dict[object, list[str]] = {}
        for device in inventory.devices:
            if attribute in device.attributes:
                groups.setdefault(device.attributes[attribute].value, []).append(device.name)
        bindings += [
            AttributeBinding(f"{driver}/{attribute}", tuple(names)) for names in groups.values() if len(names) > 1
        ]
    return bindings


def node_type_template(driver: str, pool: str, inventory: Inventory) -> NodeTypeTemplate:
    """The slices a node publishes (driver/inventory/slices.py, the same chunks and order), with
    the pool named `pool`, no node and no node facts."""
    slices = build_slices(driver, pool, without_node_facts(inventory), generation=1, owner=None)
    specs = [{k: v for k, v in s["spec"].items() if k != "nodeName"} for s in slices]
    return NodeTypeTemplate(driver, pool, specs, attribute_bindings(driver, inventory))


def resource_slices_document(template: NodeTypeTemplate) -> dict[str, Any]:
    """A List of ResourceSlices without metadata and nodeName: an autoscaler names them and sets
    the node when it makes a node of the type (Cluster Autoscaler's TemplateNodeInfo does)."""
    items = [
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "spec": spec} for spec in template.slice_specs
    ]
    return {"apiVersion": "v1", "kind": "List", "items": items}


def karpenter_document(template: NodeTypeTemplate) -> dict[str, Any]:
    """Karpenter's cloudprovider.DynamicResources, field by field in the API's lowerCamel names (the Go
    struct has no JSON form of its own): a slice template holds devices or shared counters, never both."""
    slice_templates = []
    for spec in template.slice_specs:
        entry: dict[str, Any] = {"driver": spec["driver"], "pool": {"name": spec["pool"]["name"]}}
        if "sharedCounters" in spec:
            entry["sharedCounters"] = spec["sharedCounters"]
        else:
            entry["devices"] = [
                {k: device[k] for k in KARPENTER_DEVICE_FIELDS if k in device} for device in spec.get("devices", [])
            ]
        slice_templates.append(entry)
    bindings = [
        {
            "attribute": b.attribute,
            "devices": [{"driver": template.driver, "pool": template.pool, "device": name} for name in b.devices],
        }
        for b in template.bindings
    ]
    return {"resourceSliceTemplates": slice_templates, "attributeBindings": bindings}


RENDERERS = {"karpenter": karpenter_document, "resourceslices": resource_slices_document}
FORMATS = tuple(RENDERERS)
