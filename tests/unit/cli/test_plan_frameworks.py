"""`fgpu plan` on workload operators' kinds (driver/cli/plan_frameworks.py): the examples users copy
(examples/frameworks/, as shipped) expanded into the pods their operators create, each pod's claim
made from its template and each operator's gang placed all or none as the controller places it."""

from __future__ import annotations

import copy
import io
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from driver.allocator.model import ObjectError
from driver.allocator.policies import DEFAULT_POLICY
from driver.cli.plan import Plan, make_plan
from driver.cli.plan_frameworks import framework_pods
from driver.cli.plan_inputs import manifest, read_manifests
from driver.scheduling.framework_gangs import FrameworkGang
from tests.support import ROOT
from tests.support.controller_cluster import discover

CLASSES = ROOT / "daemonset" / "deviceclasses.yaml"
FRAMEWORKS = ROOT / "examples" / "frameworks"
WHOLE, MPS, MIG_3G = r"gpu-\d", r"gpu-\d-mps \(share\)", r"gpu-\d-mig-3g40gb-\d"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One dgx-h100 (8 GPUs) as installed by default."""
    return discover(tmp_path_factory.mktemp("slices"), "n1", "dgx-h100")


def plan_of(*paths: Path, extra: list[dict[str, Any]] = ()) -> Plan:  # type: ignore[assignment]
    manifests = read_manifests(list(paths), io.StringIO())
    manifests += [manifest(obj, f"test: document {i}") for i, obj in enumerate(extra, 1)]
    return make_plan(manifests, DEFAULT_POLICY, "gpu.fgpu.dev")


def outcomes(plan: Plan) -> dict[str, Any]:
    return {o.unit.subject: o for o in plan.outcomes}


def example(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((FRAMEWORKS / name).read_text()) if d]


# Each example alone on one node: the subject of each claim (gang and size in it) and its devices.
EXPECTED = {
    "trainjob-4x2-gpus.yaml": [(f"trainjob default/train-4x2 node 0 pod {i}: claim gpu from template two-gpus "
                                "(gang jobset:train-4x2 of 4)", [WHOLE] * 2) for i in range(4)],
    "trainjob-mig-3g.yaml": [(f"trainjob default/train-mig-3g node 0 pod {i}: claim gpu from template mig-3g-40gb "
                              "(gang jobset:train-mig-3g of 4)", [MIG_3G]) for i in range(4)],
    "lws-2x4-gpus.yaml": [(f"leaderworkerset default/serve-2x4 group 0 {role}: claim gpu from template four-gpus "
                           "(gang lws:serve-2x4/0 of 2)", [WHOLE] * 4) for role in ("leader", "worker 1")],
    "raycluster-mps.yaml": [(f"raycluster default/ray-mps quarter-gpu worker {i}: claim gpu from template "
                             "mps-quarter-h100 (gang ray:ray-mps of 5)", [MPS]) for i in range(4)],
    "rayjob-mps.yaml": [(f"rayjob default/rayjob-mps half-gpu worker {i}: claim gpu from template mps-half-h100 "
                         "(gang ray:rayjob-mps-kckj6 of 3)", [MPS]) for i in range(2)],
    "serving-mps-8x10gi.yaml": [(f"deployment default/serve-small-model replica {i}: claim gpu from template "
                                 "mps-10gi", [MPS]) for i in range(8)],
}  # fmt: skip


def test_every_framework_example_is_covered():
    assert sorted(p.name for p in FRAMEWORKS.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_example_alone_fits_one_node_with_its_gang(name, node):
    plan = plan_of(node, CLASSES, FRAMEWORKS / name)
    assert not plan.skipped and plan.failed == 0, (plan.skipped, [o.error for o in plan.outcomes])
    got = outcomes(plan)
    assert sorted(got) == sorted(subject for subject, _ in EXPECTED[name])
    for subject, patterns in EXPECTED[name]:
        devices = sorted(got[subject].devices)
        assert len(devices) == len(patterns), (subject, devices)
        assert all(re.fullmatch(p, d) for p, d in zip(patterns, devices, strict=True)), (subject, devices)
    held = [(o.node, d) for o in plan.outcomes for d in o.devices if "(share)" not in d]
    assert len(held) == len(set(held)), held


def test_all_examples_at_once_place_each_gang_whole_or_not_at_all(node):
    """8 GPUs: lone claims first (the Deployment's shares), then the gangs in input order; the LWS
    group (8 GPUs) and the 4x2 TrainJob cannot be placed whole once the shares and partitions before
    them hold GPUs: none of their claims is allocated, each says why."""
    plan = plan_of(node, CLASSES, FRAMEWORKS)
    by_gang: dict[str, list[Any]] = {}
    for outcome in plan.outcomes:
        if (found := re.search(r"\(gang (\S+) of \d+\)", outcome.unit.subject)) is not None:
            by_gang.setdefault(found.group(1), []).append(outcome)
    assert sorted(by_gang) == ["jobset:train-4x2", "jobset:train-mig-3g", "lws:serve-2x4/0", "ray:ray-mps",
                               "ray:rayjob-mps-kckj6"]  # fmt: skip
    for gang, members in by_gang.items():
        assert all(o.error for o in members) or not any(o.error for o in members), gang  # all or none
    for gang in ("lws:serve-2x4/0", "jobset:train-4x2"):
        assert all(o.error.startswith(f"pod group default/{gang} (gang of ") for o in by_gang[gang])
        assert "gang cannot be placed whole" in by_gang[gang][0].error


def test_a_gang_with_fewer_pods_than_its_size_waits():
    """A TrainJob of 3 nodes on the runtime whose template says 4: as the controller, nothing placed."""
    documents = example("trainjob-4x2-gpus.yaml")
    documents[2]["spec"]["trainer"]["numNodes"] = 3
    plan = plan_of(CLASSES, extra=documents)
    assert len(plan.outcomes) == 3
    assert all(o.error == "pod group default/jobset:train-4x2 waits for 1 more pod(s) of 4" for o in plan.outcomes)


def test_a_trainjob_without_its_runtime_is_not_planned(node):
    template, _, trainjob = example("trainjob-4x2-gpus.yaml")
    plan = plan_of(node, CLASSES, extra=[template, trainjob])
    reasons = {s.what: s.reason for s in plan.skipped}
    assert reasons["trainjob default/train-4x2"].startswith(
        "its runtime trainingruntime default/torch-2-gpus-per-node is not in the input"
    )
    assert reasons["resourceclaimtemplate default/two-gpus"] == "no pod in the input uses it"
    runtime_only = plan_of(node, CLASSES, extra=example("trainjob-4x2-gpus.yaml")[:2])
    assert {s.what: s.reason for s in runtime_only.skipped}["trainingruntime default/torch-2-gpus-per-node"] == (
        "no TrainJob in the input uses it"
    )


def test_a_trainjob_on_a_cluster_training_runtime(node):
    """A ClusterTrainingRuntime (cluster-scoped, the runtimeRef's default kind) serves TrainJobs of
    every namespace."""
    template, runtime, trainjob = example("trainjob-mig-3g.yaml")
    runtime = {**runtime, "kind": "ClusterTrainingRuntime"}
    trainjob = copy.deepcopy(trainjob)
    del trainjob["spec"]["runtimeRef"]["kind"]
    plan = plan_of(node, CLASSES, extra=[template, runtime, trainjob])
    assert not plan.skipped and plan.failed == 0 and len(plan.outcomes) == 4


def jobset(opt_in: bool) -> list[dict[str, Any]]:
    template = copy.deepcopy(example("trainjob-4x2-gpus.yaml")[0])
    if not opt_in:
        del template["spec"]["metadata"]
    container = {"name": "main", "image": "x", "resources": {"claims": [{"name": "gpu"}]}}
    claims = [{"name": "gpu", "resourceClaimTemplateName": "two-gpus"}]
    pod = {"spec": {"restartPolicy": "Never", "resourceClaims": claims, "containers": [container]}}
    job = {"parallelism": 1, "completions": 1, "template": pod}
    rjobs = [{"name": "workers", "replicas": 3, "template": {"spec": job}}]
    return [template, {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": "js"},
                       "spec": {"replicatedJobs": rjobs}}]  # fmt: skip


def test_a_jobsets_pods_carry_its_labels_and_its_gang_is_its_jobs():
    made = framework_pods(manifest(jobset(True)[1], "test"), lambda _: None)
    assert [p.name for p in made] == [f"js-workers-{j}-0-{p.name[-5:]}" for j, p in enumerate(made)]
    assert {p.gang for p in made} == {FrameworkGang("JobSet", "jobset:js", 3, "jobset.sigs.k8s.io/global-replicas")}


def test_a_jobset_without_the_opt_in_is_planned_claim_by_claim(node):
    """kube-scheduler allocates claims that do not opt in, one by one: no gang."""
    plan = plan_of(node, CLASSES, extra=jobset(False))
    assert len(plan.outcomes) == 3 and plan.failed == 0
    assert not any("(gang" in o.unit.subject for o in plan.outcomes)
    with_opt_in = plan_of(node, CLASSES, extra=jobset(True))
    assert all(o.unit.subject.endswith("(gang jobset:js of 3)") for o in with_opt_in.outcomes)


def test_a_malformed_operator_object_is_one_line_naming_it():
    bad = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": "js"}, "spec": {}}
    with pytest.raises(ObjectError, match=r"^test: document 1: jobset default/js: replicatedJobs is missing"):
        plan_of(CLASSES, extra=[bad])
