"""The fragmentation policy's order of a request kept from claim to claim (driver/allocator/ranking.py):
through placements, releases, pods without claims coming and going, new levels, new mixes and nodes
joining, every claim gets the very order, GPUs and placement that scoring every node afresh gives."""

from __future__ import annotations

import random
from fractions import Fraction
from typing import Any

import pytest

from driver.allocator import cluster as cluster_module
from driver.allocator import ranking
from driver.allocator.cluster import ClusterAllocator, Placement
from driver.allocator.model import slice_from_object
from driver.scheduling.nodefit import CPU, MEMORY, PODS, NodeFacts, NodeRoom, PodNeeds
from tests.support.allocation import allocator, claim, exactly, h100_slices, profile

NODES = [f"n{i:02d}" for i in range(12)]
REQUESTS = [
    exactly("gpu.fgpu.dev"),
    exactly("gpu.fgpu.dev", count=2),
    exactly("mps.gpu.fgpu.dev", capacity={"requests": {"compute": "30"}}),
    exactly("mps.gpu.fgpu.dev", capacity={"requests": {"compute": "50"}}),
    exactly("mig.gpu.fgpu.dev", selector=profile("1g.10gb")),
]


class Twin:
    """An allocator and its room, driven with the same steps as its twin."""

    def __init__(self, cpus: dict[str, int], pods_of: dict[str, list[PodNeeds]], fresh: bool) -> None:
        self.allocator: ClusterAllocator = allocator(h100_slices(*NODES), policy="fragmentation")
        facts = [NodeFacts(n, allocatable={CPU: Fraction(c), MEMORY: Fraction(2**40), PODS: Fraction(110)})
                 for n, c in cpus.items()]  # fmt: skip
        self.room = NodeRoom(facts, pods_of)
        self.reused = 0  # orders kept from an earlier claim and taken in, not built afresh
        rankings = self.allocator._rankings
        if fresh:  # never a ranking: every claim scores every node
            rankings.asked_before = lambda ask: False  # type: ignore[method-assign]
            return
        build = rankings.ranking

        def counted(ask: int, version: int, nodes: int) -> Any:
            found = build(ask, version, nodes)
            self.reused += found[1] is not None
            return found

        rankings.ranking = counted  # type: ignore[method-assign]

    def order(self, c: Any) -> tuple[list[str], dict[str, Any]]:
        order = list(self.allocator._by_fragmentation(c, None, self.room))
        prefer = {node: self.allocator._prefer.get(node) for node in order}
        return order, {node: (p[0][0].devices[0].id, p[1]) if p else None for node, p in prefer.items()}

    def place(self, c: Any) -> Placement | None:
        outcome = self.allocator.allocate(c, room=self.room)
        if not isinstance(outcome, Placement):
            return None
        self.allocator.commit(outcome)
        self.room.take(outcome)
        return outcome

    def release(self, placement: Placement) -> None:
        self.allocator.release(placement.node, placement.allocation, placement.claim)
        self.room.give_back(placement)

    def node_added(self, name: str) -> None:
        self.allocator.update_slices([slice_from_object(s) for s in h100_slices(name)], [])

    def pod_without_claims(self, placement: Placement, comes: bool) -> None:
        (self.room.take if comes else self.room.give_back)(placement)
        self.allocator.pods_changed([placement.node])


def where(placement: Placement | None) -> tuple[str, list[str]] | None:
    """The node and devices (a share's ID is drawn anew each time)."""
    if placement is None:
        return None
    return placement.node, [r["device"] for r in placement.allocation["devices"]["results"]]


@pytest.mark.parametrize("seed", range(6))
def test_a_kept_order_is_the_order_scored_afresh(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_module, "FLOOD_EVERY", 5)  # the level moves often
    rng = random.Random(seed)
    pods_of: dict[str, list[PodNeeds]] = {}
    cpus = {node: rng.choice((48, 96, 192)) for node in NODES}
    kept, fresh = Twin(cpus, pods_of, fresh=False), Twin(cpus, pods_of, fresh=True)
    live: list[tuple[Placement, Placement]] = []
    claimless: list[tuple[Placement, Placement]] = []
    for step in range(260):
        if step in (90, 180):  # a node joins (the room has no facts of it: no pod fits there)
            kept.node_added(f"new{step}")
            fresh.node_added(f"new{step}")
        roll = rng.random()
        if roll < 0.6 or not live:
            c = claim(f"c{step}", rng.choice(REQUESTS))
            pods_of[c.key] = [PodNeeds(f"ns/p{step}", {CPU: Fraction(rng.choice((1, 4, 8)))})]
            assert kept.order(c) == fresh.order(c), f"step {step}"
            placements = (kept.place(c), fresh.place(c))
            assert where(placements[0]) == where(placements[1]), f"step {step}"
            if placements[0] is not None:
                live.append(placements)  # type: ignore[arg-type]
        elif roll < 0.8:
            pair = live.pop(rng.randrange(len(live)))
            kept.release(pair[0])
            fresh.release(pair[1])
        elif roll < 0.93 or not claimless:
            c = claim(f"pod{step}")
            pods_of[c.key] = [PodNeeds(f"ns/q{step}", {CPU: Fraction(rng.choice((2, 16, 40)))})]
            node = rng.choice(NODES)
            pair = (Placement(c, node, {"devices": {"results": []}}),) * 2
            kept.pod_without_claims(pair[0], comes=True)
            fresh.pod_without_claims(pair[1], comes=True)
            claimless.append(pair)  # type: ignore[arg-type]
        else:
            pair = claimless.pop(rng.randrange(len(claimless)))
            kept.pod_without_claims(pair[0], comes=False)
            fresh.pod_without_claims(pair[1], comes=False)
    assert kept.reused > 100  # the kept orders were used, not built afresh each time


def test_the_log_of_touched_nodes_stays_bounded_while_a_ranking_lags() -> None:
    rankings = ranking.Rankings()
    rankings.ranking(1, 0, nodes=100)  # then never used while request 2 goes on
    for i in range(5000):
        rankings.touch(f"n{i % 100}")
        rankings.ranking(2, 0, nodes=100)  # used every time: in step
    assert len(rankings._log) <= 1024 + 100
    assert rankings.ranking(1, 0, nodes=100)[1] is None  # it lagged past a quarter of the nodes: built afresh
    assert rankings.ranking(2, 1, nodes=100)[1] is None  # a new mix: built afresh
