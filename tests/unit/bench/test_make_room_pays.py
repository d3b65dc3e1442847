"""bench.make_room's compaction with a budget to spare: it stops where no plan pays, and asked for
less per eviction it spends more of the budget."""

from __future__ import annotations

import argparse

from bench import make_room as make_room_bench
from bench.allocator import packing_trace


def test_compaction_leaves_budget_unspent_where_no_plan_pays():
    args = argparse.Namespace(nodes=2, events=200, seed=5, budget=1000, compaction_moves=4, pays=1.0)
    arrivals = packing_trace(args.events, args.seed)
    paying = make_room_bench.run("compaction", args, arrivals)
    anything = make_room_bench.run("compaction", argparse.Namespace(**{**vars(args), "pays": 0.0}), arrivals)
    # One GPU per eviction is found far less often than an eviction a step is allowed.
    assert 0 < paying["evictions"] < anything["evictions"] <= args.budget * args.events / 1000
