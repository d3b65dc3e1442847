"""Where kube-scheduler will put the CPU and memory that pods without claims take, for the
fragmentation policy when those pods are not placed here (issue 43, item 3).

kube-scheduler's default scoring (NodeResourcesFit LeastAllocated) sends each pod to the node with
the largest share of its CPU and memory free, so the pods without claims that are still to come
fill the emptiest nodes first, like water poured on the nodes' free shares: each node ends with at
most a common level of its allocatable free, and the nodes below it are not reached. A node the
policy keeps empty for GPU pods is the first one filled, and the GPUs it kept are left without
the CPU to feed them.

The policy counts a node's room as kube-scheduler will leave it: what it has left, capped at the
level (fragmentation.py, room_copies), on the nodes those pods can reach: a node tainted against
them (kept for pods with GPUs, which tolerate the taint) keeps its room whole and takes no part
in the level (PodRoom.open_to_any_pod). The level is where the demand to come meets the free room:
as much more per GPU as the pods without claims took so far per GPU in use, for the next HORIZON
of the free GPUs (the cluster filling at the mix it has seen), from the nodes' free shares,
highest first. Pure: the numbers come from the allocator (cluster.py)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

SIZED = ("cpu", "memory")  # what LeastAllocated scores (and fragmentation's whole-node prior sizes)
# The share of the free GPUs whose filling the level looks ahead to: GPU pods come between the
# pods without claims and take CPU too, so the level is near, not where a full cluster would be
# (openb as deployed, unallocated GPUs at 100% arrived, seeds 42-45: 4.87% on average looking
# ahead to all of them, 4.50 to a quarter, 4.89 without a level; docs/benchmarks/openb.md).
HORIZON = 0.25


@dataclass(frozen=True)
class Room:
    """One node's resources left and allocatable for pods, by name."""

    left: Mapping[str, float]
    allocatable: Mapping[str, float]


def demand_to_come(
    used: Mapping[str, float], claims_per_gpu: Mapping[str, float], gpus_used: float, gpus_free: float
) -> dict[str, float]:
    """Per resource, what pods without claims will take while the next HORIZON of `gpus_free`
    fills: `used` (over the GPU nodes) less what the claims' pods take (`claims_per_gpu` x
    `gpus_used`) is theirs so far, as much again per GPU. Nothing where no GPU is in use yet (no
    mix to go by)."""
    if gpus_used <= 0:
        return {}
    return {
        name: max(0.0, used.get(name, 0.0) / gpus_used - claims_per_gpu.get(name, 0.0)) * gpus_free * HORIZON
        for name in SIZED
    }


def level(rooms: Iterable[Room], demand: Mapping[str, float]) -> dict[str, float]:
    """Per resource with demand, the share of its allocatable that the nodes keep free at most once
    `demand` more is placed on them emptiest first (0: the demand takes all the room left)."""
    rooms = list(rooms)
    found: dict[str, float] = {}
    for name, wanted in demand.items():
        if wanted <= 0:
            continue
        # (free share, allocatable) per node, highest free share first: lowering the level from one
        # node's share to the next takes (that drop) x (the allocatable of the nodes above it).
        shares = sorted(
            (
                (room.left.get(name, 0.0) / full, full)
                for room in rooms
                if (full := room.allocatable.get(name, 0.0)) > 0
            ),
            reverse=True,
        )
        above = 0.0  # allocatable of the nodes above the level
        at = shares[0][0] if shares else 0.0
        for share, full in shares:
            if above and (at - share) * above >= wanted:
                break
            wanted -= (at - share) * above
            at, above = share, above + full
        found[name] = max(0.0, at - wanted / above) if above else 0.0
    return found


def capped(left: Mapping[str, float], allocatable: Mapping[str, float], water: Mapping[str, float]) -> dict[str, float]:
    """What a node's room keeps once the pods without claims to come have filled it to the level."""
    return {
        name: min(value, water[name] * allocatable.get(name, 0.0)) if name in water else value
        for name, value in left.items()
    }
