"""The allocator on small, hand-built inventories: semantics, results, scoring, gangs, reasons."""

from __future__ import annotations

import json
from typing import Any

import pytest

from driver.allocator.allocate import NodeAllocator
from driver.allocator.cluster import ClusterAllocator, Failure, Placement, Snapshot
from driver.allocator.model import claim_from_object, class_from_object, slice_from_object
from driver.allocator.state import AllocatedState
from driver.inventory.discovery import discover_gpus
from driver.inventory.offers import node_inventory
from driver.inventory.sharing import ALL_KINDS, SharingConfig
from driver.inventory.slices import build_slices
from driver.nvml.session import NvmlSession
from tests.support import ROOT
from tests.support.allocation import DRIVER, allocator, claim, devices, exactly, h100_slices, place, profile


def test_share_rounds_up_to_the_step_and_draws_counters_once():
    cluster = allocator(h100_slices("n1"))
    first = place(cluster, claim("a", exactly("mps.gpu.fgpu.dev", capacity={"requests": {"memory": "300Mi"}})))
    (result,) = first.allocation["devices"]["results"]
    assert result["consumedCapacity"]["memory"] == "512Mi" and result["shareID"]
    second = place(cluster, claim("b", exactly("mps.gpu.fgpu.dev", capacity={"requests": {"memory": "1Gi"}})))
    assert devices(second) == devices(first)  # binpack: onto the GPU already shared
    assert second.allocation["devices"]["results"][0]["shareID"] != result["shareID"]
    # The shared GPU's counters are drawn once: its whole GPU and MIG devices are gone, others not.
    whole = place(cluster, claim("c", exactly("gpu.fgpu.dev", count=7)))
    assert devices(first)[0].removesuffix("-mps") not in devices(whole)
    assert isinstance(cluster.allocate(claim("d", exactly("gpu.fgpu.dev"))), Failure)


def test_first_available_falls_back_and_names_the_subrequest():
    cluster = allocator(h100_slices("n1"))
    subs = [
        {"name": "eight", "deviceClassName": "gpu.fgpu.dev", "count": 9},
        {
            "name": "mig",
            "deviceClassName": "mig.gpu.fgpu.dev",
            "selectors": [{"cel": {"expression": profile("3g.40gb")}}],
        },
    ]
    config = [{"requests": ["r/mig"], "opaque": {"driver": DRIVER, "parameters": {"b": 2}}}]
    placement = place(cluster, claim("a", {"name": "r", "firstAvailable": subs}, config=config))
    (result,) = placement.allocation["devices"]["results"]
    assert result["request"] == "r/mig" and "-mig-3g40gb-" in result["device"]
    configs = placement.allocation["devices"]["config"]
    assert [(c["source"], c["opaque"]["parameters"]) for c in configs] == [
        ("FromClass", {"a": 1}),
        ("FromClaim", {"b": 2}),
    ]
    assert all("requests" not in c for c in configs)  # they cover every request
    term = placement.allocation["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]
    assert term == {"key": "metadata.name", "operator": "In", "values": ["n1"]}


def test_binpack_keeps_large_placements_free_and_spread_does_not():
    packed, spread = allocator(h100_slices("n1")), allocator(h100_slices("n1"), policy="spread")
    small = [claim(f"s{i}", exactly("mig.gpu.fgpu.dev", selector=profile("1g.10gb"))) for i in range(4)]
    packed_gpus = {devices(place(packed, c))[0].split("-mig")[0] for c in small}
    spread_gpus = {devices(place(spread, c))[0].split("-mig")[0] for c in small}
    assert len(packed_gpus) == 1 and len(spread_gpus) == 4
    # Whole GPUs stay free: seven under binpack, four under spread.
    assert len(devices(place(packed, claim("w", exactly("gpu.fgpu.dev", count=7))))) == 7
    assert isinstance(spread.allocate(claim("w", exactly("gpu.fgpu.dev", count=5))), Failure)


def test_binpack_fills_a_node_before_opening_another():
    cluster = allocator(h100_slices("n1", "n2"))
    nodes = {place(cluster, claim(f"c{i}", exactly("gpu.fgpu.dev", count=3))).node for i in range(2)}
    assert len(nodes) == 1


def test_constraints_match_and_distinct():
    cluster = allocator(h100_slices("n1"))
    two = [exactly("mig.gpu.fgpu.dev", name=n, selector=profile("1g.10gb")) for n in ("a", "b")]
    same = place(cluster, claim("same", *two, constraints=[{"matchAttribute": f"{DRIVER}/parentUUID"}]))
    assert len({d.split("-mig")[0] for d in devices(same)}) == 1
    apart = place(cluster, claim("apart", *two, constraints=[{"distinctAttribute": f"{DRIVER}/parentUUID"}]))
    assert len({d.split("-mig")[0] for d in devices(apart)}) == 2
    missing = claim("missing", *two, constraints=[{"matchAttribute": "example.com/nothing"}])
    assert isinstance(cluster.allocate(missing), Failure)


def test_taints_need_tolerations():
    slices = h100_slices("n1")
    for s in slices:
        for device in s["spec"].get("devices", []):
            device["taints"] = [{"key": "fgpu.dev/xid", "value": "79", "effect": "NoSchedule"}]
    cluster = allocator(slices)
    assert isinstance(cluster.allocate(claim("a", exactly("gpu.fgpu.dev"))), Failure)
    tolerated = exactly("gpu.fgpu.dev", tolerations=[{"key": "fgpu.dev/xid", "operator": "Exists"}])
    result = place(cluster, claim("b", tolerated)).allocation["devices"]["results"][0]
    assert result["tolerations"] == [{"key": "fgpu.dev/xid", "operator": "Exists"}]


def test_incomplete_and_older_pools_are_not_used():
    slices = h100_slices("n1")
    for s in slices:
        s["spec"]["pool"]["resourceSliceCount"] += 1
    cluster = allocator(slices)
    assert isinstance(cluster.allocate(claim("a", exactly("gpu.fgpu.dev"))), Failure)
    everything = {"name": "r", "exactly": {"deviceClassName": "gpu.fgpu.dev", "allocationMode": "All"}}
    failure = cluster.allocate(claim("all", everything))
    assert isinstance(failure, Failure) and "is currently being updated" in failure.reason


def test_all_mode_takes_every_matching_device():
    cluster = allocator(h100_slices("n1"))
    everything = {"name": "r", "exactly": {"deviceClassName": "gpu.fgpu.dev", "allocationMode": "All"}}
    assert len(devices(place(cluster, claim("all", everything)))) == 8


def test_existing_allocations_are_respected():
    taken = {
        "devices": {
            "results": [{"request": "r", "driver": DRIVER, "pool": "n1", "device": f"gpu-{i}"} for i in range(7)]
        }
    }
    cluster = allocator(h100_slices("n1"), allocated=(taken,))
    assert devices(place(cluster, claim("a", exactly("gpu.fgpu.dev")))) == ["gpu-7"]


def test_gang_is_all_or_nothing():
    cluster = allocator(h100_slices("n1", "n2"))
    fits = cluster.allocate_gang([claim(f"w{i}", exactly("gpu.fgpu.dev", count=4)) for i in range(4)])
    assert isinstance(fits, list) and sorted(p.node for p in fits) == ["n1", "n1", "n2", "n2"]
    before = (set(cluster.state.exclusive), dict(cluster._usage))
    too_big = cluster.allocate_gang(
        [claim(f"x{i}", exactly("mig.gpu.fgpu.dev", selector=profile("1g.10gb"))) for i in range(2)]
    )
    assert isinstance(too_big, Failure) and "gang cannot be placed whole" in too_big.reason
    assert (set(cluster.state.exclusive), dict(cluster._usage)) == before  # nothing left behind


def test_failure_reasons_say_what_to_change():
    cluster = allocator(h100_slices("n1"))
    missing = cluster.allocate(claim("a", exactly("no-such-class")))
    assert isinstance(missing, Failure) and "could not retrieve device class no-such-class" in missing.reason
    big = cluster.allocate(claim("b", exactly("mps.gpu.fgpu.dev", capacity={"requests": {"memory": "500Gi"}})))
    assert isinstance(big, Failure)
    assert "no device of class mps.gpu.fgpu.dev with memory >= 500Gi free on any one node" in big.reason
    assert "closest: n1/gpu-" in big.reason
    nothing = cluster.allocate(
        claim("c", exactly("gpu.fgpu.dev", selector='device.attributes["gpu.fgpu.dev"].index > 99'))
    )
    assert isinstance(nothing, Failure) and "none matches the request's selectors" in nothing.reason


@pytest.mark.parametrize("bad", ['device.attributes["gpu.fgpu.dev"].nope == 1', "device.driver =="])
def test_selector_errors_fail_the_claim_with_the_error(bad: str):
    outcome = allocator(h100_slices("n1")).allocate(claim("a", exactly("gpu.fgpu.dev", selector=bad)))
    assert isinstance(outcome, Failure) and "claim ns/a: selector #0" in outcome.reason


def test_a_pool_offered_to_every_node_is_shared_between_them():
    fabric = h100_slices("fabric")
    for s in fabric:
        del s["spec"]["nodeName"]
        s["spec"]["allNodes"] = True
        for device in s["spec"].get("devices", []):
            device["attributes"]["fabric"] = {"bool": True}
    cluster = allocator(h100_slices("n1", "n2") + fabric)
    on_fabric = 'has(device.attributes["gpu.fgpu.dev"].fabric)'
    mig = claim("mig", exactly("mig.gpu.fgpu.dev", selector=f"{on_fabric} && {profile('1g.10gb')}"))
    assert cluster.allocate_on("n2", [mig]) is not None  # n2 has looked at the fabric GPUs
    whole = place(cluster, claim("whole", exactly("gpu.fgpu.dev", count=8, selector=on_fabric)))
    assert {r["pool"] for r in whole.allocation["devices"]["results"]} == {"fabric"}
    assert "nodeSelector" not in whole.allocation  # usable from any node
    # Taken through one node, the fabric GPUs are gone for the other too.
    assert isinstance(cluster.allocate(mig, nodes=["n1" if whole.node == "n2" else "n2"]), Failure)


def test_binpack_fills_a_shared_partition_before_opening_another():
    sharing = SharingConfig(default=ALL_KINDS, mig_share_profiles=frozenset({"3g.40gb"}))
    inventory = node_inventory(discover_gpus(NvmlSession.open("mock:dgx-h100")), sharing)
    slices = build_slices(DRIVER, "n1", inventory, generation=1, owner=None)
    packed, first_fit = allocator(slices), allocator(slices, policy="first-fit")
    memory = {"requests": {"memory": "10Gi"}}
    on_gpu_5 = f'{profile("3g.40gb")} && device.attributes["{DRIVER}"].index == 5'
    opened = devices(place(packed, claim("s0", exactly("mig-mps.gpu.fgpu.dev", selector=on_gpu_5, capacity=memory))))
    assert opened[0].startswith("gpu-5-mig-3g40gb-") and opened[0].endswith("-mps")
    share = exactly("mig-mps.gpu.fgpu.dev", selector=profile("3g.40gb"), capacity=memory)
    # 3g.40gb holds 39.5Gi of shares in 256Mi steps: two more of 10Gi join it, the next opens another.
    placed = [devices(place(packed, claim(f"s{i}", share)))[0] for i in range(1, 4)]
    assert placed[:2] == opened * 2 and placed[2] != opened[0]
    assert devices(place(first_fit, claim("f", share))) == ["gpu-0-mig-3g40gb-0-mps"]  # what binpack avoids
    # The partition's counters keep the GPU's whole device from it.
    whole = claim("w", exactly("gpu.fgpu.dev", selector=f'device.attributes["{DRIVER}"].index == 5'))
    assert isinstance(packed.allocate(whole), Failure)


def test_devices_of_one_kind_share_their_shape_and_keep_their_own_values():
    slices = [slice_from_object(s) for s in h100_slices("n1", "n2")]
    devices = {(d.id[1], d.id[2]): d for s in slices for d in s.devices}
    one, other = devices["n1", "gpu-2-mig-1g10gb-6"], devices["n2", "gpu-2-mig-1g10gb-6"]
    assert one.shape is other.shape and one.consumes[0][1] is other.consumes[0][1]  # counters too
    assert "parentUUID" not in one.shape.attributes and one.attribute("parentUUID")[0] == "string"  # the GPU's own
    assert devices["n1", "gpu-2-mig-1g10gb-0"].own is one.own  # placements of a GPU: its values once
    published = next(d for s in h100_slices("n2") for d in s["spec"].get("devices", []) if d["name"] == other.id[2])
    assert other.attributes == {k: next(iter(v.items())) for k, v in published["attributes"].items()}


def test_a_selector_on_a_gpu_s_own_values_tells_devices_apart():
    cluster = allocator(h100_slices("n1", "n2"))
    third = 'device.attributes["gpu.fgpu.dev"].index == 3'
    first = place(cluster, claim("a", exactly("gpu.fgpu.dev", selector=third)))
    second = place(cluster, claim("b", exactly("gpu.fgpu.dev", selector=third)))
    assert devices(first) == devices(second) == ["gpu-3"] and first.node != second.node
    assert isinstance(cluster.allocate(claim("c", exactly("gpu.fgpu.dev", selector=third))), Failure)
    whole_map = 'device.attributes["gpu.fgpu.dev"].exists(k, k == "uuid")'  # read as a whole: no sharing
    assert len(devices(place(cluster, claim("d", exactly("gpu.fgpu.dev", count=7, selector=whole_map))))) == 7


def pools_seen(snapshot: Snapshot) -> dict[str, list[tuple[str, bool, list[str]]]]:
    return {
        node: [(p.name, p.incomplete, [d.id[2] for d in p.devices]) for p in pools]
        for node, pools in sorted(snapshot.pools.items())
    }


def test_slices_added_changed_and_deleted_touch_only_their_nodes():
    before = [slice_from_object(s) for s in h100_slices("n1", "n2", "n3")]
    cluster = allocator(h100_slices("n1", "n2", "n3"))
    place(cluster, claim("a", exactly("gpu.fgpu.dev", count=8)))  # fills one node
    usage = dict(cluster._usage)
    n2 = [s for s in before if s.pool == "n2"]
    smaller = slice_from_object({**h100_slices("n2")[1], "spec": {**h100_slices("n2")[1]["spec"], "devices": []}})
    added = [slice_from_object(s) for s in h100_slices("n4")]
    cluster.update_slices([smaller, *added], [s for s in before if s.pool == "n3"])
    after = [s for s in before if s.pool not in ("n2", "n3")] + [s for s in n2 if s.name != smaller.name]
    assert pools_seen(cluster.snapshot) == pools_seen(Snapshot.from_slices([*after, smaller, *added]))
    assert set(cluster._usage) == {"n1", "n2", "n4"} and cluster._usage["n1"] == usage["n1"]
    assert place(cluster, claim("b", exactly("gpu.fgpu.dev", count=8))).node == "n4"  # n2 lost GPUs


@pytest.mark.parametrize(("policy", "sign"), [("binpack", -1), ("spread", 1)])
def test_nodes_are_tried_by_usage_then_name(policy: str, sign: int):
    cluster = allocator(h100_slices("n1", "n2", "n3", "n4"), policy=policy)
    for name, count in (("a", 2), ("b", 8), ("c", 1)):
        place(cluster, claim(name, exactly("gpu.fgpu.dev", count=count)))
    expected = sorted(cluster._usage, key=lambda node: (sign * cluster._usage[node], node))
    assert cluster.node_order() == expected and len(set(cluster._usage.values())) > 1


def test_a_pool_offered_to_every_node_reaches_all_of_them_and_leaves_all_of_them():
    fabric = h100_slices("fabric")
    for s in fabric:
        del s["spec"]["nodeName"]
        s["spec"]["allNodes"] = True
    cluster = allocator(h100_slices("n1", "n2"))
    shared = [slice_from_object(s) for s in fabric]
    cluster.update_slices(shared, [])
    assert {node: [p.name for p in pools] for node, pools in cluster.snapshot.pools.items()} == {
        "n1": ["fabric", "n1"],
        "n2": ["fabric", "n2"],
    }
    assert sorted(cluster.snapshot.nodes_of_pool["gpu.fgpu.dev", "fabric"]) == ["n1", "n2"]
    cluster.update_slices([], shared)
    assert [p.name for p in cluster.snapshot.pools["n1"]] == ["n1"]
    assert ("gpu.fgpu.dev", "fabric") not in cluster.snapshot.nodes_of_pool


@pytest.mark.parametrize(
    "case", ["search-order-all-constraint-ours-first", "search-order-cel-runtime-error-ours-first"]
)
def test_an_error_only_our_order_meets_is_searched_again_in_upstreams_order(case: str):
    """A policy's order that meets a search-order error (docs/allocator.md, Semantics) does not
    refuse the claim: the node is searched again in upstream's order, and gets first-fit's devices."""
    scenario = json.loads((ROOT / "tests" / "allocator" / "cases" / f"{case}.json").read_text())
    outcomes = {}
    for policy in ("first-fit", "binpack", "spread"):
        cluster = ClusterAllocator(
            Snapshot.from_slices([slice_from_object(s) for s in scenario["slices"]]),
            {c["metadata"]["name"]: class_from_object(c) for c in scenario["classes"]},
            AllocatedState.from_allocations(()),
            policy,  # type: ignore[arg-type]
        )
        for earlier in scenario["earlier"]:
            place(cluster, claim_from_object(earlier))
        outcomes[policy] = cluster.allocate(claim_from_object(scenario["claim"]))
    assert all(isinstance(o, Placement) for o in outcomes.values()), outcomes
    assert devices(outcomes["binpack"]) == devices(outcomes["spread"]) == devices(outcomes["first-fit"])


@pytest.mark.parametrize("policy", ["binpack", "fragmentation"])
def test_a_search_that_found_nothing_is_not_run_again_until_the_node_changes(
    monkeypatch: pytest.MonkeyPatch, policy: str
):
    searches: list[str] = []
    search = NodeAllocator.allocate

    def counted(self: NodeAllocator, claims: Any, budget: Any = None) -> Any:
        searches.append(self.node.name)
        return search(self, claims, budget)

    monkeypatch.setattr(NodeAllocator, "allocate", counted)
    cluster = allocator(h100_slices("n1", "n2"), policy=policy)
    full = [place(cluster, claim(f"full{i}", exactly("gpu.fgpu.dev", count=8))) for i in range(2)]
    whole = exactly("gpu.fgpu.dev")
    searches.clear()
    first = cluster.allocate(claim("a", whole))
    assert isinstance(first, Failure) and sorted(searches) == ["n1", "n2"]
    # The same request under another name, configs and labels: both nodes known full, why told as before.
    again = cluster.allocate(claim("b", whole, config=[{"opaque": {"driver": DRIVER, "parameters": {}}}]))
    assert isinstance(again, Failure) and again.reason == first.reason.replace("ns/a", "ns/b")
    assert sorted(searches) == ["n1", "n2"]
    assert isinstance(cluster.allocate(claim("c", exactly("gpu.fgpu.dev", count=2)), why=False), Failure)
    assert sorted(searches) == ["n1", "n1", "n2", "n2"]  # another request: searched
    cluster.release(full[1].node, full[1].allocation)  # that node changed: searched again, and fits
    assert place(cluster, claim("d", whole)).node == full[1].node
