"""Hand-built clusters of mock dgx-h100 nodes whose allocations are kept as the planners' Holders
(driver/allocator/make_room.py, empty_nodes.py)."""

from __future__ import annotations

from typing import Any

from driver.allocator.cluster import ClusterAllocator
from driver.allocator.make_room import Holder
from tests.support.allocation import DRIVER, allocator, claim, exactly, h100_slices


class Cluster:
    """An allocator with allocations put on named devices by hand, each kept as a Holder."""

    def __init__(self, *nodes: str, policy: str = "binpack") -> None:
        self.allocator: ClusterAllocator = allocator(h100_slices(*nodes), policy)
        self.holders: list[Holder] = []

    def whole(self, node: str, gpu: int, movable: bool = False, started: float = 0) -> Holder:
        name = f"w-{node}-{gpu}"
        result = {"request": "r", "driver": DRIVER, "pool": node, "device": f"gpu-{gpu}"}
        return self._hold(claim(name, exactly("gpu.fgpu.dev")), node, result, movable, started)

    def share(self, node: str, gpu: int, gib: int, movable: bool = True, started: float = 0) -> Holder:
        name = f"s-{node}-{gpu}-{len(self.holders)}"
        consumed = {"clients": "1", "compute": "10", "memory": f"{gib}Gi"}
        result = {
            "request": "r",
            "driver": DRIVER,
            "pool": node,
            "device": f"gpu-{gpu}-mps",
            "shareID": f"share-{name}",
            "consumedCapacity": consumed,
        }
        request = exactly("mps.gpu.fgpu.dev", capacity={"requests": {"memory": f"{gib}Gi"}})
        return self._hold(claim(name, request), node, result, movable, started)

    def _hold(self, c: Any, node: str, result: dict[str, Any], movable: bool, started: float) -> Holder:
        holder = Holder(c, node, {"devices": {"results": [result]}}, movable, started)
        self.allocator.add(node, holder.allocation)
        self.holders.append(holder)
        return holder

    def landing(self, *nodes: str) -> None:
        """Nodes where every GPU carries a small share nobody may move: room for moved shares,
        none for a whole GPU."""
        for node in nodes:
            for gpu in range(8):
                self.share(node, gpu, 5, movable=False)
