"""One pass's context (kube-scheduler's CycleState): made afresh by every pass (controller.py), read
and added to by the collaborators it is handed to, dropped at the end of the pass."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from driver.allocator.cluster import ClusterAllocator
from driver.controller.search_shares import SearchShares


@dataclass
class Pass:
    allocator: ClusterAllocator  # everything the claims hold and the ledgers record (allocators.py)
    reserved: dict[str, list[dict[str, Any]]]  # claim uid -> device results reserved for it (making_room.py)
    shares: SearchShares  # what each namespace's units may still search this pass (search_shares.py)
    unplaced: list[list[dict[str, Any]]] = field(default_factory=list)  # units that fit nowhere (placing.py)
