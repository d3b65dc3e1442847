"""The FGD simulator replica's pieces (bench/openb_replica.py) on hand-made nodes and pods: typical
pods as GetTypicalPods builds them, a node's fragment amount for a typical-pod list worked out by
hand, FGD's truncated score and its ties, the GPU chosen within a node, BestFit, and a tiny replay."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from bench.openb import TraceNode
from bench.openb_replica import (
    Mix,
    Node,
    Options,
    Scorer,
    Spec,
    Typical,
    _choose,
    accessible,
    after_sub,
    bestfit_score,
    build_nodes,
    exclusive_gpus,
    fgd_score,
    frag_amount,
    replay,
    spec_of,
    typical_pods,
)
from tests.support.openb import pod, write_tiny_traces

SHARE = Spec(4000, 500, 1)  # fits where a GPU has >= 500 left and 4 cores
BIG_CPU = Spec(16000, 200, 1)  # needs 16 cores
CPU_ONLY = Spec(2000, 0, 0)
TYPICAL = (Typical(SHARE, 0.5), Typical(BIG_CPU, 0.25), Typical(CPU_ONLY, 0.25))


def test_frag_amount_worked_out_by_hand():
    # GPUs left 1000, 300, 0 (1300 in all), 8 cores left.
    # SHARE fits: only the GPUs below 500 count: 300 + 0, x 0.5 = 150.
    # BIG_CPU lacks CPU: all 1300 count, x 0.25 = 325. CPU_ONLY (class XL): all 1300, x 0.25 = 325.
    assert frag_amount(8000, [1000, 300, 0], "T4", TYPICAL) == pytest.approx(800)
    # With 16 cores BIG_CPU fits too: GPUs below 200 only (0): 150 + 0 + 325.
    assert frag_amount(16000, [1000, 300, 0], "T4", TYPICAL) == pytest.approx(475)
    # A typical pod that names another model, or asks for more GPUs than fit, strands everything.
    assert frag_amount(16000, [1000, 300], "T4", (Typical(Spec(1000, 200, 1, "V100M16|P100"), 1.0),)) == 1300
    assert frag_amount(16000, [1000, 300], "T4", (Typical(Spec(1000, 1000, 2), 1.0),)) == 1300
    assert frag_amount(16000, [1000, 1000], "T4", (Typical(Spec(1000, 1000, 2), 1.0),)) == 0
    assert frag_amount(16000, [0, 0], "T4", TYPICAL) == 0  # nothing left, nothing stranded


def test_model_access_reads_the_pipe_separated_list():
    assert accessible("T4", "") and accessible("T4", "V100M16|T4") and not accessible("T4", "V100M16|P100")


def test_typical_pods_most_frequent_first_up_to_95_percent_ties_by_larger_spec():
    specs = [Spec(1000, 500, 1)] * 50 + [Spec(2000, 0, 0)] * 30 + [Spec(3000, 1000, 1)] * 10
    specs += [Spec(5000, 1000, 2)] * 6 + [Spec(4000, 1000, 1)] * 2 + [Spec(9000, 1000, 1)] * 2
    typical = typical_pods(specs)
    # 50 + 30 + 10 + 6 = 96 of 100 >= 95: four taken, weights renormalised over the 96.
    assert [t.spec for t in typical] == [Spec(1000, 500, 1), Spec(2000, 0, 0), Spec(3000, 1000, 1), Spec(5000, 1000, 2)]
    assert [round(t.weight * 96) for t in typical] == [50, 30, 10, 6]
    # at 99%: the two specs of count 2 tie; the larger CPU comes first
    assert [t.spec.cpu for t in typical_pods(specs, Mix(threshold=0.99))][-2:] == [9000, 4000]
    assert Spec(2000, 0, 0) not in [t.spec for t in typical_pods(specs, Mix(cpu_pods=False))]
    weighed = {t.spec: t.weight for t in typical_pods(specs, Mix(weigh_devices=True, threshold=1.0))}
    assert weighed[Spec(5000, 1000, 2)] == pytest.approx(12 / 106)
    merged = typical_pods([Spec(1000, 1000, 1)] * 3 + [Spec(2000, 1000, 1)] * 5, Mix(one_cpu=True))
    assert merged == (Typical(Spec(2000, 1000, 1), 1.0),)


def test_supply_keeps_a_scarce_cpu_size_apart_and_weighs_it_by_the_gpus_that_can_run_it():
    # 8-GPU pods: 6 ask 64 cores, 2 ask 120, which only n2 (128 cores) has: 8 of the 24 GPUs
    # the request could use, under half. 4-core pods of 2 GPUs run everywhere.
    nodes = [
        TraceNode("n0", 96000, 1, 8, "G2"),
        TraceNode("n1", 96000, 1, 8, "G2"),
        TraceNode("n2", 128000, 1, 8, "G3"),
    ]
    specs = [Spec(64000, 1000, 8)] * 6 + [Spec(120000, 1000, 8)] * 2 + [Spec(4000, 1000, 2)] * 8
    merged = {t.spec: t.weight for t in typical_pods(specs, Mix(one_cpu=True, threshold=1.0, supply=True), nodes)}
    assert merged == pytest.approx(
        {Spec(64000, 1000, 8): 6 / 16, Spec(120000, 1000, 8): 2 / 16 * 3, Spec(4000, 1000, 2): 0.5}
    )
    plain = {t.spec: t.weight for t in typical_pods(specs, Mix(one_cpu=True, threshold=1.0), nodes)}
    assert plain == {Spec(64000, 1000, 8): 0.5, Spec(4000, 1000, 2): 0.5}


def test_spec_of_a_trace_pod_joins_the_models_and_zeroes_a_cpu_only_pods_milli():
    assert spec_of(pod("a", 1, 470, 8000, ("V100M16", "V100M32"))) == Spec(8000, 470, 1, "V100M16|V100M32")
    assert spec_of(pod("b", 0, cpu=12500)) == Spec(12500, 0, 0)


def test_fgd_score_is_truncated_so_close_rises_tie():
    assert fgd_score(500, 500) == 50
    assert fgd_score(500, 510) == fgd_score(500, 530) == 49  # 10 and 30 thousandths more: one score
    assert fgd_score(500, 550) == 48
    assert fgd_score(500, 510, exact=True) > fgd_score(500, 530, exact=True)
    assert fgd_score(2000, 0) == 88  # sigmoid(2) = 0.8808


def test_strand_counts_the_gpus_left_beyond_what_the_cpu_left_feeds():
    typical = (Typical(Spec(11000, 1000, 1), 1.0),)
    # 8 free GPUs, CPU for 7 of the typical pods (80 cores): one GPU's worth stranded.
    assert frag_amount(80000, [1000] * 8, "G2", typical) == 0
    assert frag_amount(80000, [1000] * 8, "G2", typical, strand=True) == 1000
    assert frag_amount(88000, [1000] * 8, "G2", typical, strand=True) == 0
    # a model the pod cannot run on strands nothing for it (it counts everything as before)
    restricted = (Typical(Spec(11000, 1000, 1, "T4"), 1.0),)
    assert frag_amount(0, [1000] * 8, "G2", restricted, strand=True) == 8000


def test_sub_takes_the_least_left_gpus_that_fit_and_whole_gpus_are_the_first_free():
    assert after_sub([1000, 600, 300], Spec(0, 500, 1)) == [1000, 100, 300]
    assert after_sub([1000, 0, 1000, 1000], Spec(0, 1000, 2)) == [0, 0, 0, 1000]
    assert exclusive_gpus([600, 1000, 1000, 1000], Spec(0, 1000, 2)) == [1, 2]


def test_fgd_on_a_node_takes_the_gpu_that_strands_least_first_among_equal_scores():
    scorer = Scorer("fgd")
    scorer.set_typical((Typical(Spec(1000, 500, 1), 1.0),))
    # a 500 share beside 1000 and 600 left: on the 600 GPU it leaves 100 (a fragment for 500s),
    # on the free one 500 (still usable): the free one rises F by 0 against 100.
    node = Node("n", "T4", 32000, 10**6, [600, 1000])
    assert scorer.score(node, Spec(1000, 500, 1)) == (50, [1])
    # two GPUs with the same left: the first.
    assert scorer.score(Node("n", "T4", 32000, 10**6, [1000, 1000]), Spec(1000, 300, 1))[1] == [0]


def test_ties_between_nodes_go_to_the_first_in_name_order_or_at_random():
    nodes = [Node(f"n{i}", "T4", 32000, 10**6, [1000]) for i in range(3)]
    scorer = Scorer("fgd")
    scorer.set_typical((Typical(Spec(1000, 500, 1), 1.0),))
    share = pod("s", 1, 500)
    chosen = set()
    for seed in range(40):
        kept: list[dict] = [{} for _ in nodes]
        found = _choose(nodes, kept, scorer, share, spec_of(share), "random", random.Random(seed))
        assert found is not None
        chosen.add(found[0])
    assert chosen == {0, 1, 2}
    kept = [{} for _ in nodes]
    assert _choose(nodes, kept, scorer, share, spec_of(share), "name", random.Random(0)) == (0, [0])
    # ours: the fullest (least GPU left, as a share) first; for 100-thousandth pods all score 50 here
    small = Scorer("fgd")
    small.set_typical((Typical(Spec(1000, 100, 1), 1.0),))
    nodes[2].gpus = [600]
    kept = [{} for _ in nodes]
    assert _choose(nodes, kept, small, share, spec_of(share), "fullest", random.Random(0))[0] == 2
    assert _choose(nodes, [{} for _ in nodes], small, share, spec_of(share), "name", random.Random(0))[0] == 0
    # a node that does not fit (memory) is never chosen
    nodes[0].memory_left = 10
    kept = [{} for _ in nodes]
    assert _choose(nodes, kept, scorer, share, spec_of(share), "name", random.Random(0)) == (1, [0])


def test_nodes_are_in_the_order_of_their_permuted_names():
    nodes = build_nodes([TraceNode(f"openb-node-{i:04d}", 32000, 65536, 1, "T4") for i in range(50)], seed=42)
    assert [n.name for n in nodes] == sorted(n.name for n in nodes)
    assert [n.name[6:] for n in nodes] != sorted(n.name[6:] for n in nodes)  # not the trace's order
    assert build_nodes([TraceNode("x", 1, 1, 1, "T4")] * 3, seed=1)[0].name.startswith("p0000-")


def test_bestfit_prefers_the_least_left_after_and_the_tightest_gpu():
    share = Spec(8000, 500, 1)
    assert bestfit_score(64000, 8000, share) == 31  # 1 - (0.5 * 56/128 + 0.5 * 7.5/8) = 0.3125
    assert bestfit_score(16000, 1000, share) > bestfit_score(64000, 8000, share)
    scorer = Scorer("bestfit")
    assert scorer.score(Node("n", "T4", 64000, 10**6, [1000, 600, 700]), share)[1] == [1]


def test_replay_of_a_tiny_trace_drops_what_fits_nowhere():
    nodes = [TraceNode(name, 32000, 65536, 1, "T4") for name in "abcd"]
    pods = [pod(f"p{i}", 1, 800) for i in range(5)] + [pod("cpu", 0, cpu=1000)]
    for options in (Options("fgd"), Options("bestfit"), Options("fgd", "online"), Options("fgd", exact=True)):
        result = replay(nodes, pods, 42, options)
        # 4,000 capacity tuned to 5,200: six 800 shares (one a clone), one a GPU: two fit nowhere.
        assert result.failed == 2
        assert result.unallocated[100] == pytest.approx(20.0)  # 3,200 of 4,000 used at 4,000 arrived


@pytest.mark.parametrize(
    "flags",
    [
        ["--policy", "fgd"],
        ["--policy", "bestfit", "--ties", "random"],
        ["--typical", "online", "--no-cpu-pods", "--weigh-devices", "--one-cpu", "--exact", "--ties", "fullest"],
        ["--strand", "--threshold", "0.99", "--typical", "online", "--one-cpu", "--supply"],
        ["--threshold", "0.5", "--every", "2", "--stop-at", "110"],
    ],
)
def test_the_command_as_users_run_it_reports_the_replica_beside_the_published_figures(tmp_path, flags):
    traces = write_tiny_traces(tmp_path)
    command = [sys.executable, "-m", "bench.openb_replica", "--traces", str(traces), "--seeds", "42,43", *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    assert "BestFit (published)" in done.stdout and '"seeds": [\n    42,\n    43\n  ]' in done.stdout
