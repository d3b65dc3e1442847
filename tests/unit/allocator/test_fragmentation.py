"""The fragmentation placement policy (driver/allocator/fragmentation.py): it learns the mix of
claims from the claims it is asked to place, keeps room on each GPU for the shapes that mix holds,
weighs the pods' CPU with the GPUs it would strand, and never changes whether a claim fits."""

from __future__ import annotations

import functools
import random
import subprocess
import sys
from fractions import Fraction
from typing import Any

import pytest

from driver.allocator import fragmentation
from driver.allocator.cluster import ClusterAllocator, Placement
from driver.allocator.fragmentation import request_key
from driver.allocator.model import slice_from_object
from driver.allocator.state import AllocatedState
from driver.scheduling.nodefit import CPU, MEMORY, PODS, NodeFacts, NodeRoom, PodNeeds
from tests.support import ROOT
from tests.support.allocation import DRIVER, allocator, claim, devices, exactly, h100_slices, place, profile

COMPUTE_32 = {"requests": {"compute": "32"}}


def mps(name: str, compute: int) -> object:
    return claim(name, exactly("mps.gpu.fgpu.dev", capacity={"requests": {"compute": str(compute)}}))


def test_a_share_keeps_room_for_the_shares_the_cluster_asks_for_where_best_fit_would_not():
    # GPU 0 has 50% of its compute left, GPU 1 30%. The claims seen so far are 30% shares: a 20%
    # share on GPU 1 would leave 10%, too little for them; on GPU 0 it leaves exactly 30%.
    first = allocator(h100_slices("n1"), policy="first-fit")
    taken = (place(first, mps("a", 50)).allocation, place(first, mps("b", 70)).allocation)
    assert [devices(Placement(None, "", a))[0] for a in taken] == ["gpu-0-mps", "gpu-1-mps"]  # type: ignore[arg-type]
    learned = allocator(h100_slices("n1"), policy="fragmentation", allocated=taken)
    for i in range(40):
        learned.allocate(mps(f"seen{i}", 30))  # asked, not committed: the mix is learned from the asking
    assert devices(place(learned, mps("x", 20))) == ["gpu-0-mps"]
    assert devices(place(allocator(h100_slices("n1"), allocated=taken), mps("x", 20))) == ["gpu-1-mps"]  # binpack


def using_pod(pods_of: dict[str, list[PodNeeds]], c, cpus: int):
    """The claim, its one pod asking `cpus` CPUs recorded in `pods_of`."""
    pods_of[c.key] = [PodNeeds(f"ns/pod-{c.name}", {CPU: Fraction(cpus)})]
    return c


def room_for(nodes: dict[str, int], pods_of: dict[str, list[PodNeeds]]) -> NodeRoom:
    facts = [
        NodeFacts(name, allocatable={CPU: Fraction(cpus), MEMORY: Fraction(2**40), PODS: Fraction(110)})
        for name, cpus in nodes.items()
    ]
    return NodeRoom(facts, pods_of)


def where_a_pod_without_gpus_goes(
    cpus: dict[str, int], taken: dict[str, int], seen_cpus: int, pod_cpus: int
) -> dict[str, str]:
    """Per policy: the node a claim without devices goes to, its pod asking `pod_cpus` CPUs, on
    nodes of 8 GPUs and `cpus` CPUs once `taken` (node -> whole GPUs, each with a 1-CPU pod) are
    placed and 30 whole-GPU claims whose pods ask `seen_cpus` were asked about (the mix)."""
    pods_of: dict[str, list[PodNeeds]] = {}

    with_pod = functools.partial(using_pod, pods_of)

    results = {}
    for policy in ("fragmentation", "binpack"):
        pods_of.clear()
        room = room_for(cpus, pods_of)
        cluster = allocator(h100_slices(*cpus), policy=policy)
        for node, count in taken.items():
            for i in range(count):
                outcome = cluster.allocate(with_pod(claim(f"{node}-{i}", exactly("gpu.fgpu.dev")), 1), nodes=[node])
                assert isinstance(outcome, Placement)
                cluster.commit(outcome)
                room.take(outcome)
        for i in range(30):
            cluster.allocate(with_pod(claim(f"seen{i}", exactly("gpu.fgpu.dev")), seen_cpus), room=room)
        outcome = cluster.allocate(with_pod(claim("no-gpus"), pod_cpus), room=room)
        assert isinstance(outcome, Placement) and outcome.allocation["devices"]["results"] == []
        results[policy] = outcome.node
    return results


def test_a_pod_without_gpus_goes_where_its_cpu_strands_no_gpu():
    # n2 is fuller (6 of 8 GPUs) but has 16 CPUs; whole-GPU pods need 2 CPUs each. A 9-CPU pod
    # there leaves 1 CPU, stranding n2's two free GPUs; on n1 (32 CPUs) it strands nothing.
    chosen = where_a_pod_without_gpus_goes({"n1": 32, "n2": 16}, {"n1": 4, "n2": 6}, seen_cpus=2, pod_cpus=9)
    assert chosen == {"fragmentation": "n1", "binpack": "n2"}


def test_a_pod_goes_where_the_cpu_it_leaves_still_feeds_every_free_gpu():
    # Both nodes have all 8 GPUs free and room for a whole-GPU pod (11 CPUs) after a 10-CPU pod;
    # on n1 (96 CPUs) that pod leaves 86, enough for 7 of them: one GPU stranded. n2 (200 CPUs)
    # still feeds all 8. Whether one such pod fits is the same on both: counting how many do is
    # what tells them apart.
    chosen = where_a_pod_without_gpus_goes({"n1": 96, "n2": 200}, {}, seen_cpus=11, pod_cpus=10)
    assert chosen == {"fragmentation": "n2", "binpack": "n1"}


SCARCE = f'device.attributes["{DRIVER}"].productName == "Scarce"'  # a claim's selector for n2's GPUs


def scarce_on_n2() -> list[dict[str, Any]]:
    """Two H100 nodes' slices, n2's GPUs of a model claims ask for by name (SCARCE)."""
    slices = h100_slices("n1", "n2")
    for s in slices:
        if s["spec"]["nodeName"] == "n2":
            for device in s["spec"].get("devices", []):
                device["attributes"]["productName"] = {"string": "Scarce"}
    return slices


def test_a_share_keeps_off_gpus_that_restricted_claims_can_use_only_when_such_claims_come():
    # n2's GPUs are of a model some claims ask for by name; GPU 0 of n2 has 35% of its compute
    # left. F alone fills that hole with a 32% share; with 32% shares restricted to n2's model in
    # the mix, the share goes to n1's GPUs, which those claims cannot use.
    slices = scarce_on_n2()
    hole = allocator(slices, policy="first-fit").allocate(mps("hole", 65), nodes=["n2"])
    assert isinstance(hole, Placement) and devices(hole) == ["gpu-0-mps"]
    nodes = {}
    for restricted in (False, True):
        cluster = allocator(slices, policy="fragmentation", allocated=(hole.allocation,))
        for i in range(20):
            cluster.allocate(claim(f"whole{i}", exactly("gpu.fgpu.dev")))
            if restricted:
                cluster.allocate(claim(f"r{i}", exactly("mps.gpu.fgpu.dev", selector=SCARCE, capacity=COMPUTE_32)))
            else:
                cluster.allocate(mps(f"s{i}", 32))
        nodes[restricted] = place(cluster, mps("x", 32)).node
    assert nodes == {False: "n2", True: "n1"}


def test_a_mig_placement_keeps_the_common_profile_placeable():
    # Claims for 4g.40gb (one placement per H100, memory slices 0-3) are the common ones. A 4g
    # is on one GPU; a 1g.10gb beside it blocks no 4g, while on a fresh GPU it could.
    cluster = allocator(h100_slices("n1"), policy="fragmentation")
    for i in range(20):
        cluster.allocate(claim(f"seen{i}", exactly("mig.gpu.fgpu.dev", selector=profile("4g.40gb"))))
    big = place(cluster, claim("big", exactly("mig.gpu.fgpu.dev", selector=profile("4g.40gb"))))
    small = place(cluster, claim("small", exactly("mig.gpu.fgpu.dev", selector=profile("1g.10gb"))))
    gpu = devices(big)[0].split("-mig-")[0]
    assert devices(small)[0].startswith(f"{gpu}-mig-1g")
    fresh = place(cluster, claim("fresh", exactly("mig.gpu.fgpu.dev", selector=profile("1g.10gb"))))
    slot = int(devices(fresh)[0].rsplit("-", 1)[1])
    assert devices(fresh)[0].startswith(f"{gpu}-") or slot >= 4  # never where the next 4g must go


def test_claims_the_model_does_not_describe_are_placed_as_the_search_finds():
    cluster = allocator(h100_slices("n1"), policy="fragmentation")
    two = claim("two", exactly("gpu.fgpu.dev", name="a"), exactly("mps.gpu.fgpu.dev", name="b"))
    assert request_key(two) is None
    assert len(devices(place(cluster, two))) == 2


def test_whether_a_claim_fits_never_depends_on_the_policy():
    # Claims of every kind in a random stream: at each step fragmentation places a claim exactly
    # when first fit, on the same allocations, can.
    rng = random.Random(7)
    learned = allocator(h100_slices("n1", "n2"), policy="fragmentation")
    committed: list[dict] = []
    kinds = [
        lambda i: claim(f"w{i}", exactly("gpu.fgpu.dev", count=rng.choice([1, 2, 4]))),
        lambda i: mps(f"s{i}", rng.choice([10, 25, 47, 81])),
        lambda i: claim(f"m{i}", exactly("mig.gpu.fgpu.dev", selector=profile(rng.choice(["1g.10gb", "3g.40gb"])))),
    ]
    for i in range(60):
        c = rng.choice(kinds)(i)
        outcome = learned.allocate(c)
        reference = ClusterAllocator(
            learned.snapshot, learned.classes, AllocatedState.from_allocations(committed), "first-fit"
        ).allocate(c)
        assert isinstance(outcome, Placement) == isinstance(reference, Placement), c.name
        if isinstance(outcome, Placement):
            learned.commit(outcome)
            committed.append(outcome.allocation)


def test_fgpu_plan_takes_the_policy_and_places_the_examples_as_binpack_does(tmp_path):
    def fgpu(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "driver.cli", *args]
        return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)

    slices = tmp_path / "n1.yaml"
    slices.write_text(fgpu("discover", "--nvml", "mock:dgx-h100", "--node-name", "n1", "-o", "yaml").stdout)
    examples = sorted(map(str, (ROOT / "examples").glob("*.yaml")))
    summaries = {}
    for policy in ("fragmentation", "binpack"):
        classes = str(ROOT / "daemonset" / "deviceclasses.yaml")
        run = fgpu("plan", "--policy", policy, "--slices", str(slices), "--classes", classes, "--claims", *examples)
        summaries[policy] = next(line for line in run.stdout.splitlines() if " allocated, " in line)
    assert summaries["fragmentation"] == summaries["binpack"] and "0 allocated" not in summaries["binpack"]


def test_the_census_of_gpus_follows_the_slices():
    cluster = allocator(h100_slices("n1", "n2"), policy="fragmentation")
    learned = cluster._fragmentation
    assert learned is not None and sum(n for _, n in learned.census.values()) == 16  # 8 H100s a node
    n2 = [slice_from_object(s) for s in h100_slices("n2")]
    cluster.update_slices([], n2)
    assert sum(n for _, n in learned.census.values()) == 8
    cluster.update_slices(n2, [])
    assert sum(n for _, n in learned.census.values()) == 16


def test_a_pod_keeps_off_the_only_node_whose_cpu_runs_a_less_common_big_pod():
    # Three nodes of 8 GPUs; only n3 (128 CPUs) runs the 8-GPU claims whose pod asks 120 CPUs,
    # fewer than the 8-GPU claims asking 64, which n1 and n2 (96 CPUs) run too. A whole-GPU claim
    # whose pod asks 20 CPUs strands a GPU on n1 (76 CPUs left feed 6 of the common 12-CPU ones,
    # 7 GPUs free) and none on n3. Learning each request's most common pods only, it goes to n3;
    # the 120-CPU pods are a shape of their own, weighed by how few GPUs can run them, and it
    # keeps n3 for them.
    pods_of: dict[str, list[PodNeeds]] = {}

    def asking(name: str, gpus: int, cpus: int):
        c = claim(name, exactly("gpu.fgpu.dev", count=gpus))
        pods_of[c.key] = [PodNeeds(f"ns/pod-{name}", {CPU: Fraction(cpus)})]
        return c

    seen = [(8, 64)] * 10 + [(8, 120)] * 4 + [(1, 12)] * 20
    random.Random(0).shuffle(seen)
    room = room_for({"n1": 96, "n2": 96, "n3": 128}, pods_of)
    cluster = allocator(h100_slices("n1", "n2", "n3"), policy="fragmentation")
    for i, (gpus, cpus) in enumerate(seen):
        cluster.allocate(asking(f"seen{i}", gpus, cpus), room=room)
    outcome = cluster.allocate(asking("x", 1, 20), room=room)
    assert isinstance(outcome, Placement) and outcome.node == "n1"


def test_the_view_of_a_node_follows_a_pod_without_claims_that_comes_and_goes():
    # n1 and n2 alike: 8 GPUs, 200 CPUs; the mix is whole-GPU claims whose pods ask 11 CPUs, asked
    # about with both nodes empty (their views kept since). A pod without claims then takes 104 of
    # n1's CPUs (kube-scheduler placed it: no allocation changes): a 10-CPU pod there would leave 86,
    # feeding 7 of those pods and stranding a GPU, so it goes to n2, once the allocator is told.
    # When the pod leaves, the nodes are alike again and n1 (first by name) takes it.
    pods_of: dict[str, list[PodNeeds]] = {}

    with_pod = functools.partial(using_pod, pods_of)

    room = room_for({"n1": 200, "n2": 200}, pods_of)
    cluster = allocator(h100_slices("n1", "n2"), policy="fragmentation")
    for i in range(20):  # the mix learned at 16; the next learning (at 32) would count every room afresh
        cluster.allocate(with_pod(claim(f"seen{i}", exactly("gpu.fgpu.dev")), 11), room=room)
    placed_by_kube = Placement(with_pod(claim("by-kube-scheduler"), 104), "n1", {"devices": {"results": []}})

    def node_for_a_pod() -> str:
        outcome = cluster.allocate(with_pod(claim("pod"), 10), room=room)  # asked, not committed
        assert isinstance(outcome, Placement)
        return outcome.node

    room.take(placed_by_kube)
    cluster.pods_changed(["n1"])
    assert node_for_a_pod() == "n2"
    room.give_back(placed_by_kube)
    cluster.pods_changed(["n1"])
    assert node_for_a_pod() == "n1"


def test_a_claim_asked_about_again_counts_once_in_the_mix():
    # A claim that waits is tried at every pass (and making room asks about the claims it would
    # move): the mix counts each claim once, however often it is asked about.
    learned = allocator(h100_slices("n1"), policy="fragmentation")
    waiting = mps("waits", 90)
    for _ in range(40):
        learned.allocate(waiting)
    learned.allocate(mps("other", 30))
    fragmentation = learned._fragmentation
    assert fragmentation is not None
    assert sorted(fragmentation.seen.values()) == [1, 1] and fragmentation.observed == 2


def asking_on(pods_of: dict[str, list[PodNeeds]], name: str, gpus: int, cpus: int):
    """A claim for `gpus` whole GPUs whose one pod asks `cpus` CPUs (counted in `pods_of`)."""
    c = claim(name, exactly("gpu.fgpu.dev", count=gpus))
    pods_of[c.key] = [PodNeeds(f"ns/pod-{name}", {CPU: Fraction(cpus)})]
    return c


def seen_shapes_of(learned: fragmentation.Fragmentation, gpus: int) -> list[fragmentation.Shape]:
    """The mix's shapes of claims seen (not the whole-node prior's) asking for `gpus` devices."""
    return [s for s in learned.mix if s.key and s.key[2] == gpus and s.demand[0] != "whole node"]


def test_before_any_claim_needs_it_the_node_only_the_largest_pods_fit_is_filled_last(monkeypatch):
    # n3 (128 CPUs) is the one node a pod asking more than 96 CPUs runs on; no such claim came yet.
    # A whole-GPU claim whose pod asks 20 CPUs strands a GPU on n1 (76 CPUs left feed 6 of the
    # common 12-CPU pods, 7 GPUs free) and none on n3, so the mix seen so far sends it to n3. The
    # prior of a claim for each kind of node whole keeps n3 for what only it runs, whether the
    # allocator places the pods without claims too or kube-scheduler does (none seen here);
    # without the prior (WHOLE_NODE_PRIOR 0) it goes to n3.
    def node_for_it(places_pods: bool) -> str:
        pods_of: dict[str, list[PodNeeds]] = {}
        room = room_for({"n1": 96, "n2": 96, "n3": 128}, pods_of)
        cluster = allocator(h100_slices("n1", "n2", "n3"), policy="fragmentation")
        for i in range(20):
            cluster.allocate(asking_on(pods_of, f"seen{i}", 1, 12), room=room)
            if places_pods and i % 5 == 0:
                without_claims = claim(f"cpu-pod{i}")
                pods_of[without_claims.key] = [PodNeeds(f"ns/cpu-pod{i}", {CPU: Fraction(1)})]
                cluster.allocate(without_claims, room=room)
        outcome = cluster.allocate(asking_on(pods_of, "x", 1, 20), room=room)
        assert isinstance(outcome, Placement)
        return outcome.node

    assert node_for_it(places_pods=True) == "n1"
    assert node_for_it(places_pods=False) == "n1"
    monkeypatch.setattr(fragmentation, "WHOLE_NODE_PRIOR", 0.0)
    assert node_for_it(places_pods=True) == "n3"
    assert node_for_it(places_pods=False) == "n3"


def whole_node_cpus(nodes: dict[str, int]) -> list[float]:
    """The CPUs of the prior's whole-node shapes in the mix, on `nodes` (name -> CPUs, 8 GPUs each)
    once 20 whole-GPU claims whose pods ask 12 CPUs were asked about."""
    pods_of: dict[str, list[PodNeeds]] = {}
    room = room_for(nodes, pods_of)
    cluster = allocator(h100_slices(*nodes), policy="fragmentation")
    for i in range(20):
        cluster.allocate(asking_on(pods_of, f"seen{i}", 1, 12), room=room)
    learned = cluster._fragmentation
    assert learned is not None
    return sorted(round(dict(s.needs)[CPU], 1) for s in learned.mix if s.demand[0] == "whole node")


def test_the_prior_keeps_whole_only_a_kind_of_node_no_other_kind_stands_in_for():
    # A claim for a 96-CPU node whole (86.4 CPUs) runs on the 128-CPU node too, so keeping the
    # 96-CPU nodes whole keeps nothing that only they offer; the 128-CPU node's (115.2) runs there
    # alone. Nodes all of one kind keep their prior.
    assert whole_node_cpus({"n1": 96, "n2": 96, "n3": 128}) == [115.2]
    assert whole_node_cpus({"n1": 96, "n2": 96}) == [86.4]
    assert whole_node_cpus({"n1": 96, "n2": 128, "n3": 128}) == [115.2]


def test_a_shape_first_seen_when_it_fits_nowhere_enters_the_mix_at_once():
    # 20 whole-GPU claims learned the mix (at 16); an 8-GPU claim whose pod asks 120 CPUs then
    # finds every node in use. It would enter the mix at the next learning (32 claims seen); it
    # waits, so the mix is learned again now, with it.
    pods_of: dict[str, list[PodNeeds]] = {}
    room = room_for({"n1": 96, "n2": 96, "n3": 128}, pods_of)
    cluster = allocator(h100_slices("n1", "n2", "n3"), policy="fragmentation")
    for i in range(20):
        placed = cluster.allocate(asking_on(pods_of, f"seen{i}", 1, 4), room=room)
        assert isinstance(placed, Placement)
        cluster.commit(placed)
        room.take(placed)
    learned = cluster._fragmentation
    assert learned is not None and not seen_shapes_of(learned, gpus=8)
    assert not isinstance(cluster.allocate(asking_on(pods_of, "big", 8, 120), room=room), Placement)
    assert seen_shapes_of(learned, gpus=8)


def test_a_scarce_shape_of_few_claims_weighs_into_the_mix_by_its_supply(monkeypatch):
    # One 8-GPU claim asking 120 CPUs among 199 whole-GPU ones: 0.5% of the claims, under the 1%
    # the mix leaves out by count; only n3 of three nodes runs it, so it weighs 3 times its count
    # and is in (the whole-node prior off: its claims would count in the total).
    monkeypatch.setattr(fragmentation, "WHOLE_NODE_PRIOR", 0.0)
    pods_of: dict[str, list[PodNeeds]] = {}
    room = room_for({"n1": 96, "n2": 96, "n3": 128}, pods_of)
    cluster = allocator(h100_slices("n1", "n2", "n3"), policy="fragmentation")
    seen = [(1, 12)] * 199 + [(8, 120)]
    random.Random(1).shuffle(seen)
    for i, (gpus, cpus) in enumerate(seen):
        cluster.allocate(asking_on(pods_of, f"seen{i}", gpus, cpus), room=room)
    learned = cluster._fragmentation
    assert learned is not None
    learned.learn(cluster._node_kinds(room))
    big = seen_shapes_of(learned, gpus=8)
    assert len(big) == 1 and big[0].weight == pytest.approx(3 / 200)


def node_for_a_gpu_pod_beside_pods_placed_by_kube_scheduler(claimless_seen: bool) -> str:
    """n1 and n2 alike: 8 GPUs, 100 CPUs. n1 runs 4 whole-GPU claims whose pods ask 10 CPUs (60
    left); kube-scheduler placed a 40-CPU pod without claims on n2 (60 left). 70 such claims are
    then asked about (the mix; the level is counted at the 65th). Where does the next one go?"""
    pods_of: dict[str, list[PodNeeds]] = {}

    with_pod = functools.partial(using_pod, pods_of)

    room = room_for({"n1": 100, "n2": 100}, pods_of)
    cluster = allocator(h100_slices("n1", "n2"), policy="fragmentation")
    for i in range(4):
        outcome = cluster.allocate(with_pod(claim(f"on-n1-{i}", exactly("gpu.fgpu.dev")), 10), nodes=["n1"], room=room)
        assert isinstance(outcome, Placement)
        cluster.commit(outcome)
        room.take(outcome)
    room.take(Placement(with_pod(claim("by-kube-scheduler"), 40), "n2", {"devices": {"results": []}}))
    cluster.pods_changed(["n2"])
    if claimless_seen:
        cluster.allocate(with_pod(claim("claimless"), 1), room=room)  # asked: fgpu places such pods too
    for i in range(70):
        cluster.allocate(with_pod(claim(f"seen{i}", exactly("gpu.fgpu.dev")), 10), room=room)
    outcome = cluster.allocate(with_pod(claim("next", exactly("gpu.fgpu.dev")), 10), room=room)
    assert isinstance(outcome, Placement)
    return outcome.node


def test_a_gpu_pod_takes_the_cpu_that_kube_schedulers_pods_without_claims_would_take():
    # kube-scheduler's pods without claims took 40 CPUs per 4 GPUs in use: 10 a GPU, so over the
    # next quarter of the 12 free GPUs 30 more, from the emptiest nodes: both nodes down from 60 to
    # 45 CPUs left (water_level.py). Counted so, n2's 8 free GPUs will be fed by 4 pods at most and
    # a pod placed there takes CPU those pods would have taken (one GPU fewer stranded), where on n1
    # it strands none either way: it goes to n2. Where fgpu places the pods without claims too there
    # is no level: both nodes feed their free GPUs, and binpack's order (the used node) decides.
    assert node_for_a_gpu_pod_beside_pods_placed_by_kube_scheduler(claimless_seen=False) == "n2"
    assert node_for_a_gpu_pod_beside_pods_placed_by_kube_scheduler(claimless_seen=True) == "n1"


def node_for_a_gpu_pod_beside_a_node_kept_for_gpu_pods(tainted: bool) -> tuple[str, dict[str, float]]:
    """n1 and n2 (96 CPUs) each run a 30-CPU pod kube-scheduler placed (no claims); n3 (128 CPUs,
    the one node the largest pods fit) is, when `tainted`, kept for pods with GPUs (they tolerate
    the taint). n1 runs 4 whole-GPU claims with 8-CPU pods; 70 such claims are asked about (the
    level is counted at the 65th). Where does one whose pod asks 30 CPUs go, and what does the
    policy count n3's room capped by (empty: not capped)?"""
    taint = {"key": "example.com/gpu-pods-only", "effect": "NoSchedule"}
    tolerates = ({"key": "example.com/gpu-pods-only", "operator": "Exists", "effect": "NoSchedule"},)
    pods_of: dict[str, list[PodNeeds]] = {}
    cpus = {"n1": 96, "n2": 96, "n3": 128}
    facts = [
        NodeFacts(
            name,
            allocatable={CPU: Fraction(count), MEMORY: Fraction(2**40), PODS: Fraction(110)},
            taints=(taint,) if tainted and name == "n3" else (),
        )
        for name, count in cpus.items()
    ]
    room = NodeRoom(facts, pods_of)
    cluster = allocator(h100_slices(*cpus), policy="fragmentation")

    def gpu_claim(name: str, cpus: int):
        c = claim(name, exactly("gpu.fgpu.dev"))
        pods_of[c.key] = [PodNeeds(f"ns/{name}", {CPU: Fraction(cpus)}, tolerations=tolerates)]
        return c

    for node in ("n1", "n2"):
        room.take(Placement(using_pod(pods_of, claim(f"by-kube-scheduler-{node}"), 30), node, {}))
    cluster.pods_changed(["n1", "n2"])
    for i in range(4):
        outcome = cluster.allocate(gpu_claim(f"on-n1-{i}", 8), nodes=["n1"], room=room)
        assert isinstance(outcome, Placement)
        cluster.commit(outcome)
        room.take(outcome)
    for i in range(70):
        cluster.allocate(gpu_claim(f"seen{i}", 8), room=room)
    outcome = cluster.allocate(gpu_claim("next", 30), room=room)
    assert isinstance(outcome, Placement)
    view = cluster._views["n3"]
    assert view is not None
    return outcome.node, dict(view.allocatable)


def test_the_level_of_kube_schedulers_pods_leaves_alone_a_node_they_cannot_reach():
    # kube-scheduler's pods without claims cannot run on a tainted node: the level they will fill
    # the nodes to (water_level.py) is counted over the others and caps only their rooms. Counted
    # as reachable, n3's room is capped too, and the 30-CPU pod goes to it; kept for pods with GPUs,
    # n3's 128 CPUs are counted whole and the pod goes to n2.
    assert node_for_a_gpu_pod_beside_a_node_kept_for_gpu_pods(tainted=False) == (
        "n3",
        {CPU: 128.0, MEMORY: 2.0**40, PODS: 110.0},
    )
    assert node_for_a_gpu_pod_beside_a_node_kept_for_gpu_pods(tainted=True) == ("n2", {})


def test_the_cpu_claims_ask_per_gpu_counts_claims_only_a_later_kind_of_node_can_take():
    # n1's GPUs are not of the model the claims ask for by name; n2's are. Each claim takes one
    # whole GPU of n2 and its pod 10 CPUs: 10 CPUs per GPU, though the first kind takes none.
    slices = scarce_on_n2()
    pods_of: dict[str, list[PodNeeds]] = {}
    room = room_for({"n1": 100, "n2": 100}, pods_of)
    cluster = allocator(slices, policy="fragmentation")
    for i in range(4):
        cluster.allocate(using_pod(pods_of, claim(f"r{i}", exactly("gpu.fgpu.dev", selector=SCARCE)), 10), room=room)
    learned = cluster._fragmentation
    assert learned is not None
    assert learned.claims_per_gpu(cluster._node_kinds(room)) == {CPU: pytest.approx(10.0)}


def test_a_new_level_recounts_only_the_rooms_it_caps_otherwise():
    # Level 60% then 55% of 100 CPUs: a room of 50 CPUs left is under both (its copies and scores
    # stand), one of 80 was capped at 60 and is now capped at 55 (counted again); a level of
    # other resources counts every view again.
    learned = fragmentation.Fragmentation()
    learned.flood({CPU: 0.6}, {})
    version = learned.version

    def counted(left: int) -> fragmentation.NodeView:
        return fragmentation.NodeView([], (), version=version, left={CPU: left}, allocatable={CPU: 100.0})

    under, over = counted(50), counted(80)
    assert learned.flood({CPU: 0.55}, {"under": under, "over": over, "none": None}) == ["over"]
    assert (learned.version, under.version, over.version) == (version, version, -1)
    learned.flood({CPU: 0.55, MEMORY: 0.5}, {"under": under})
    assert learned.version == version + 1


def test_nodes_alike_share_their_scores_until_a_pod_makes_one_differ():
    # n1 and n2 empty and alike: a claim scored on one is scored on both. A pod without claims
    # landing on n2 makes its room differ; it is scored afresh, n1 keeps what it had.
    pods_of: dict[str, list[PodNeeds]] = {}
    room = room_for({"n1": 100, "n2": 100}, pods_of)
    cluster = allocator(h100_slices("n1", "n2"), policy="fragmentation")
    for i in range(20):
        cluster.allocate(using_pod(pods_of, claim(f"seen{i}", exactly("gpu.fgpu.dev")), 10), room=room)
    n1, n2 = cluster._views["n1"], cluster._views["n2"]
    assert n1 is not None and n2 is not None and n1.scored and n1.scored is n2.scored
    room.take(Placement(using_pod(pods_of, claim("by-kube-scheduler"), 40), "n2", {"devices": {"results": []}}))
    cluster.pods_changed(["n2"])
    kept = dict(n1.scored)
    cluster.allocate(using_pod(pods_of, claim("next", exactly("gpu.fgpu.dev")), 10), room=room)
    assert n1.scored is not n2.scored and n1.scored == kept and n2.scored.keys() == kept.keys()


def test_f_of_a_node_does_not_depend_on_where_its_gpus_states_sit():
    # choose() scores each state of GPU once, so F must be the same, to the last bit, for the
    # node's GPUs in any order: two free GPUs are then picked by position, not by rounding.
    cluster = allocator(h100_slices("n1"), policy="fragmentation")
    for i, compute in enumerate((30, 70, 30, 10, 50, 30)):
        place(cluster, mps(f"s{i}", compute))
    for i in range(40):
        cluster.allocate(mps(f"seen{i}", 20 + 10 * (i % 3)))  # asked, not placed: the mix
    view = cluster._view("n1")
    assert view is not None and len(set(view.ids)) > 2
    learned, node = cluster._fragmentation, functools.partial(cluster.node_allocator, "n1")
    assert learned is not None and learned.mix
    copies = tuple(1 for _ in learned.mix)
    ids = list(view.ids)
    amounts = set()
    for seed in range(20):
        random.Random(seed).shuffle(ids)
        learned._amounts.clear()
        amounts.add(learned.amount(node, tuple(ids), copies))
    assert len(amounts) == 1
