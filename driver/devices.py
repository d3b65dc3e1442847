"""GPU records -> DRA devices (pure). The domain objects published in ResourceSlices."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from driver.discovery import GpuInfo

AttributeKind = Literal["string", "int", "bool", "version"]
PCI_BUS_ID_ATTRIBUTE = "resource.kubernetes.io/pciBusID"


@dataclass(frozen=True)
class Attribute:
    kind: AttributeKind
    value: str | int | bool


@dataclass(frozen=True)
class Device:
    """One allocatable device. Attribute and capacity names without a domain belong to the driver's."""

    name: str
    attributes: dict[str, Attribute] = field(default_factory=dict)
    capacity: dict[str, int] = field(default_factory=dict)


def whole_gpu_name(gpu: GpuInfo) -> str:
    return f"gpu-{gpu.index}"


def whole_gpu_device(gpu: GpuInfo) -> Device:
    return Device(
        name=whole_gpu_name(gpu),
        attributes={
            "type": Attribute("string", "gpu"),
            "uuid": Attribute("string", gpu.uuid),
            "productName": Attribute("string", gpu.product_name),
            "architecture": Attribute("string", gpu.architecture),
            "cudaComputeCapability": Attribute("version", gpu.cuda_compute_capability),
            "driverVersion": Attribute("version", gpu.driver_version),
            "cudaDriverVersion": Attribute("version", gpu.cuda_driver_version),
            "index": Attribute("int", gpu.index),
            "migCapable": Attribute("bool", gpu.mig_capable),
            PCI_BUS_ID_ATTRIBUTE: Attribute("string", gpu.pci_bus_id),
        },
        capacity={"memory": gpu.memory_bytes, "multiprocessors": gpu.multiprocessors},
    )


def node_devices(gpus: list[GpuInfo]) -> list[Device]:
    """Every device the node offers, in a stable order."""
    return [whole_gpu_device(gpu) for gpu in sorted(gpus, key=lambda g: g.index)]
