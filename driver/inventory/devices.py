"""GPU records -> DRA devices and counter sets (pure). The domain objects published in slices.

Per GPU `gpu-<i>` (index i), as the node's sharing configuration offers:
- `gpu-<i>`: the whole GPU;
- `gpu-<i>-mig-<profile>-<start>`: one device per MIG profile and placement;
- `gpu-<i>-mps`: MPS shares (allowMultipleAllocations; capacity memory, compute, clients);
- `gpu-<i>-ts`: time-sliced shares (allowMultipleAllocations; capacity memory, for accounting);
- `gpu-<i>-mig-<profile>-<start>-mps` / `-ts`: MPS or time-sliced shares inside that MIG partition
  (offered kinds mig-mps, mig-timeslice; the partition's memory and, for MPS, compute).
A counter set `gpu-<i>-counters` per GPU makes them exclusive where the hardware needs it: the
whole GPU, every share device and the 7g profile consume all of it, a MIG device its memory
slices (and the media-extensions counter for +me profiles); a share device inside a partition the
same as the partition, once however many shares it holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from driver.inventory.discovery import GpuInfo
from driver.inventory.sharing import MIG_KINDS, DeviceKind, SharingConfig
from driver.nvml.geometry import GEOMETRY_BY_ID, MEMORY_SLICES, memory_slots
from driver.nvml.machine import MigProfileSpec

AttributeKind = Literal["string", "int", "bool", "version"]
# Kubernetes' standard attributes (k8s.io/dynamic-resource-allocation/deviceattribute).
PCI_BUS_ID_ATTRIBUTE = "resource.kubernetes.io/pciBusID"
PCIE_ROOT_ATTRIBUTE = "resource.kubernetes.io/pcieRoot"
NUMA_NODE_ATTRIBUTE = "resource.kubernetes.io/numaNode"
NOT_OFFERED_ATTRIBUTE = "notOffered"  # on a GPU's devices: what it holds back and why
MiB = 2**20
GiB = 2**30
MPS_MAX_CLIENTS = 48  # MPS server limit on Volta and newer
SHARE_MEMORY_STEP = 256 * MiB
SHARE_DEFAULT_MEMORY = GiB  # a share's memory when the request names none
MPS_DEFAULT_COMPUTE = 10  # an MPS share's compute percentage when the request names none


@dataclass(frozen=True)
class Attribute:
    kind: AttributeKind
    value: str | int | bool


@dataclass(frozen=True)
class PublishedRequestPolicy:
    """How a consumable capacity of a published device may be requested: a default and a range
    rounded up to `step` (the allocator reads it back as allocator/model.RequestPolicy)."""

    default: int
    minimum: int
    step: int
    maximum: int | None = None


@dataclass(frozen=True)
class CounterSet:
    name: str
    counters: dict[str, int]


@dataclass(frozen=True)
class DeviceTaint:
    """A taint on a published device (resource.k8s.io/v1 DeviceTaint); time_added is RFC 3339."""

    key: str
    value: str
    effect: str
    time_added: str


@dataclass(frozen=True)
class PublishedDevice:
    """One device as this node publishes it in its ResourceSlices (the allocator reads it back as
    allocator/model.Device). Attribute and capacity names without a domain belong to the driver's."""

    name: str
    attributes: dict[str, Attribute] = field(default_factory=dict)
    capacity: dict[str, int] = field(default_factory=dict)
    request_policies: dict[str, PublishedRequestPolicy] = field(default_factory=dict)
    consumes: dict[str, dict[str, int]] = field(default_factory=dict)  # counter set -> counters
    allow_multiple_allocations: bool = False
    taints: tuple[DeviceTaint, ...] = ()


@dataclass(frozen=True)
class Inventory:
    devices: list[PublishedDevice]
    counter_sets: list[CounterSet]


@dataclass(frozen=True)
class MigPlacement:
    """What a MIG device stands for: a profile at a placement on a parent GPU."""

    gpu_index: int
    profile: MigProfileSpec
    start: int
    size: int


def whole_gpu_name(gpu: GpuInfo) -> str:
    return f"gpu-{gpu.index}"


def counter_set_name(gpu: GpuInfo) -> str:
    return f"gpu-{gpu.index}-counters"


def mig_device_name(gpu_index: int, profile_name: str, start: int) -> str:
    return f"gpu-{gpu_index}-mig-{re.sub(r'[^a-z0-9]', '', profile_name.lower())}-{start}"


def mig_share_device_name(gpu_index: int, profile_name: str, start: int, kind: DeviceKind) -> str:
    return f"{mig_device_name(gpu_index, profile_name, start)}-{'mps' if kind == 'mig-mps' else 'ts'}"


def mps_device_name(gpu: GpuInfo) -> str:
    return f"gpu-{gpu.index}-mps"


def timeslice_device_name(gpu: GpuInfo) -> str:
    return f"gpu-{gpu.index}-ts"


def gpu_counters(gpu: GpuInfo) -> dict[str, int]:
    if gpu.mig_capable and gpu.mig_profiles:
        return {**{f"memory-slice-{k}": 1 for k in range(MEMORY_SLICES)}, "media-extensions": 1}
    return {"gpu": 1}


def _product_attributes(gpu: GpuInfo) -> dict[str, Attribute]:
    return {
        "productName": Attribute("string", gpu.product_name),
        "architecture": Attribute("string", gpu.architecture),
        "cudaComputeCapability": Attribute("version", gpu.cuda_compute_capability),
        "driverVersion": Attribute("version", gpu.driver_version),
        "cudaDriverVersion": Attribute("version", gpu.cuda_driver_version),
        "index": Attribute("int", gpu.index),
        PCI_BUS_ID_ATTRIBUTE: Attribute("string", gpu.pci_bus_id),
        **_topology_attributes(gpu),
    }


def _topology_attributes(gpu: GpuInfo) -> dict[str, Attribute]:
    """Where sysfs does not say, no attribute: a device without NUMA affinity must not publish
    numaNode (upstream), or matchAttribute would pair it with every other such device."""
    attributes = {}
    if gpu.pcie_root is not None:
        attributes[PCIE_ROOT_ATTRIBUTE] = Attribute("string", gpu.pcie_root)
    if gpu.numa_node is not None:
        attributes[NUMA_NODE_ATTRIBUTE] = Attribute("int", gpu.numa_node)
    return attributes


def _consumes_all(gpu: GpuInfo) -> dict[str, dict[str, int]]:
    return {counter_set_name(gpu): gpu_counters(gpu)}


def whole_gpu_device(gpu: GpuInfo) -> PublishedDevice:
    return PublishedDevice(
        name=whole_gpu_name(gpu),
        attributes={
            "type": Attribute("string", "gpu"),
            "uuid": Attribute("string", gpu.uuid),
            "migCapable": Attribute("bool", gpu.mig_capable),
            **_product_attributes(gpu),
        },
        capacity={"memory": gpu.memory_bytes, "multiprocessors": gpu.multiprocessors},
        consumes=_consumes_all(gpu),
    )


def mig_placements(gpu: GpuInfo) -> list[MigPlacement]:
    return [
        MigPlacement(gpu.index, profile, start, GEOMETRY_BY_ID[profile.profile_id].memory_slices)
        for profile in gpu.mig_profiles
        for start in GEOMETRY_BY_ID[profile.profile_id].starts
    ]


def _placement_counters(gpu: GpuInfo, placement: MigPlacement) -> dict[str, dict[str, int]]:
    geometry = GEOMETRY_BY_ID[placement.profile.profile_id]
    counters = {f"memory-slice-{k}": 1 for k in sorted(memory_slots(placement.start, placement.size))}
    if geometry.media_extensions or geometry.memory_slices == MEMORY_SLICES:
        counters["media-extensions"] = 1
    return {counter_set_name(gpu): counters}


def _placement_attributes(gpu: GpuInfo, placement: MigPlacement, device_type: str) -> dict[str, Attribute]:
    return {
        "type": Attribute("string", device_type),
        "profile": Attribute("string", placement.profile.name),
        "parentUUID": Attribute("string", gpu.uuid),
        "placementStart": Attribute("int", placement.start),
        "placementSize": Attribute("int", placement.size),
        **_product_attributes(gpu),
    }


def mig_device(gpu: GpuInfo, placement: MigPlacement) -> PublishedDevice:
    profile = placement.profile
    return PublishedDevice(
        name=mig_device_name(gpu.index, profile.name, placement.start),
        attributes=_placement_attributes(gpu, placement, "mig"),
        capacity={
            "memory": profile.memory_mib * MiB,
            # The hardware's unit of a partition (8 a GPU): what a quota counts it in (docs/kueue.md).
            "memorySlices": placement.size,
            "multiprocessors": profile.multiprocessors,
            "copyEngines": profile.copy_engines,
            "decoders": profile.decoders,
            "encoders": profile.encoders,
            "jpegEngines": profile.jpeg_engines,
            "ofaEngines": profile.ofa_engines,
        },
        consumes=_placement_counters(gpu, placement),
    )


def mig_share_device(gpu: GpuInfo, placement: MigPlacement, kind: DeviceKind) -> PublishedDevice:
    """Shares of one MIG partition: the partition is made with the first share and isolated from
    the rest of the GPU by hardware; its shares split it as MPS or time-slicing do a whole GPU.
    memory: the partition's, in the share steps; compute (MPS): a percentage of its multiprocessors."""
    memory = _share_steps(placement.profile.memory_mib * MiB)
    memory_policy = _share_memory_policy(memory)
    if kind == "mig-mps":
        capacity = {"memory": memory, "compute": 100, "clients": MPS_MAX_CLIENTS}
        policies = {"memory": memory_policy, **_MPS_POLICIES}
    else:
        capacity, policies = {"memory": memory}, {"memory": memory_policy}
    return PublishedDevice(
        name=mig_share_device_name(gpu.index, placement.profile.name, placement.start, kind),
        attributes=_placement_attributes(gpu, placement, kind),
        capacity=capacity,
        request_policies=policies,
        consumes=_placement_counters(gpu, placement),
        allow_multiple_allocations=True,
    )


def _share_steps(memory_bytes: int) -> int:
    """Memory as a share capacity: the API wants the capacity (and max) to be min plus a whole
    number of steps, so it is rounded down to a multiple of the 256Mi step."""
    return memory_bytes - memory_bytes % SHARE_MEMORY_STEP


def share_memory(gpu: GpuInfo) -> int:
    return _share_steps(gpu.memory_bytes)


def _share_memory_policy(maximum: int) -> PublishedRequestPolicy:
    """A share's memory: default 1Gi, in 256Mi steps, up to `maximum`."""
    return PublishedRequestPolicy(SHARE_DEFAULT_MEMORY, SHARE_MEMORY_STEP, SHARE_MEMORY_STEP, maximum)


# compute: active thread percentage, default 10, in steps of 1 (what CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
# takes; coarser steps round shares up and waste a GPU's leftover: BENCHMARKS.md, openb); clients: one per share.
_MPS_POLICIES = {
    "compute": PublishedRequestPolicy(default=MPS_DEFAULT_COMPUTE, minimum=1, step=1, maximum=100),
    "clients": PublishedRequestPolicy(default=1, minimum=1, step=1, maximum=1),
}


def mps_device(gpu: GpuInfo) -> PublishedDevice:
    """MPS shares. memory: pinned device memory limit, default 1Gi, in 256Mi steps; compute:
    active thread percentage, default 10, in steps of 1; clients: one per share, at most 48."""
    return PublishedDevice(
        name=mps_device_name(gpu),
        attributes={
            "type": Attribute("string", "mps"),
            "uuid": Attribute("string", gpu.uuid),
            **_product_attributes(gpu),
        },
        capacity={"memory": share_memory(gpu), "compute": 100, "clients": MPS_MAX_CLIENTS},
        request_policies={
            "memory": _share_memory_policy(share_memory(gpu)),
            **_MPS_POLICIES,
        },
        consumes=_consumes_all(gpu),
        allow_multiple_allocations=True,
    )


def timeslice_device(gpu: GpuInfo) -> PublishedDevice:
    """Time-sliced shares: memory is accounting only (no isolation), default 1Gi in 256Mi steps."""
    return PublishedDevice(
        name=timeslice_device_name(gpu),
        attributes={
            "type": Attribute("string", "timeslice"),
            "uuid": Attribute("string", gpu.uuid),
            **_product_attributes(gpu),
        },
        capacity={"memory": share_memory(gpu)},
        request_policies={"memory": _share_memory_policy(share_memory(gpu))},
        consumes=_consumes_all(gpu),
        allow_multiple_allocations=True,
    )


@dataclass(frozen=True)
class DeviceTarget:
    """What a published device stands for on this node."""

    name: str
    kind: DeviceKind
    gpu: GpuInfo
    placement: MigPlacement | None = None


def gpu_targets(gpu: GpuInfo, offered: frozenset[DeviceKind]) -> list[DeviceTarget]:
    targets = []
    if "whole" in offered:
        targets.append(DeviceTarget(whole_gpu_name(gpu), "whole", gpu))
    if "mig" in offered and gpu.mig_capable:
        targets.extend(
            DeviceTarget(mig_device_name(gpu.index, p.profile.name, p.start), "mig", gpu, p)
            for p in mig_placements(gpu)
        )
    if "mps" in offered:
        targets.append(DeviceTarget(mps_device_name(gpu), "mps", gpu))
    if "timeslice" in offered:
        targets.append(DeviceTarget(timeslice_device_name(gpu), "timeslice", gpu))
    return targets


def mig_share_targets(gpu: GpuInfo, offered: frozenset[DeviceKind], sharing: SharingConfig) -> list[DeviceTarget]:
    if not gpu.mig_capable:
        return []
    return [
        DeviceTarget(mig_share_device_name(gpu.index, p.profile.name, p.start, kind), kind, gpu, p)
        for kind in ("mig-mps", "mig-timeslice")
        if kind in offered
        for p in mig_placements(gpu)
        if sharing.shares_mig_profile(gpu.index, p.profile.name)
    ]


def node_targets(gpus: list[GpuInfo], sharing: SharingConfig) -> list[DeviceTarget]:
    """Every device the node is configured to offer, in a stable order: what prepare accepts (a
    claim allocated before a GPU's MIG mode changed gets the partitioner's reason, not "unknown
    device"). The slices carry those of them the GPUs can offer now (node_inventory)."""
    return [
        target
        for gpu in sorted(gpus, key=lambda g: g.index)
        for offered in (sharing.offered(gpu.index),)
        for target in gpu_targets(gpu, offered) + mig_share_targets(gpu, offered, sharing)
    ]


def device_for(target: DeviceTarget) -> PublishedDevice:
    if target.kind == "whole":
        return whole_gpu_device(target.gpu)
    if target.kind in MIG_KINDS:
        assert target.placement is not None
        if target.kind == "mig":
            return mig_device(target.gpu, target.placement)
        return mig_share_device(target.gpu, target.placement, target.kind)
    if target.kind == "mps":
        return mps_device(target.gpu)
    return timeslice_device(target.gpu)
