"""`fgpu plan` on what users keep: every example planned together on mock machines, each claim
named as its user sees it and allocated or refused with its reason; what is not planned said one
line an object; pods of workloads, claims from templates, gangs, nodes, stdin."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from driver.cli.plan import Plan, make_plan
from driver.cli.plan_inputs import Manifest, Pod, PodClaim, Ref, claim_object, claim_template, manifest, pods_of
from tests.support import ROOT
from tests.support.cli import KUBECONFIG

CLASSES = ROOT / "daemonset" / "deviceclasses.yaml"
EXAMPLES = ROOT / "examples"
MIG_MPS = ["--offer", "whole,mig,mps,timeslice,mig-mps", "--mig-share-profiles", "3g.40gb"]
WHOLE, MPS, TS = r"gpu-\d", r"gpu-\d-mps \(share\)", r"gpu-\d-ts \(share\)"


def fgpu(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "driver.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, input=stdin, timeout=120)


@pytest.fixture(scope="module")
def machines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """n1: a dgx-h100 as installed by default; n2: one that also offers MPS shares of 3g partitions."""
    folder = tmp_path_factory.mktemp("slices")
    paths = {}
    for node, flags in (("n1", []), ("n2", MIG_MPS)):
        run = fgpu("discover", "--nvml", "mock:dgx-h100", "--node-name", node, "-o", "yaml", *flags)
        assert run.returncode == 0, run.stderr
        paths[node] = folder / f"{node}.yaml"
        paths[node].write_text(run.stdout)
    return paths


def planned(run: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    return {entry["subject"]: entry for entry in json.loads(run.stdout)["claims"]}


def template_claim(owner: str, template: str) -> str:
    return f"{owner}: claim gpu from template {template}"


# What each example's claims get on any node that offers them: the subject as the plan names it,
# and the devices (one pattern a device) or the start of the reason it cannot be allocated.
EXAMPLE_CLAIMS: dict[str, list[str]] = {
    **{template_claim(f"deployment default/inference replica {i}", "inference-share"): [MPS] for i in range(3)},
    template_claim("pod default/h100-or-3g", "h100-or-3g"): [WHOLE],  # the first alternative: a whole H100
    template_claim("pod default/mig-pair", "two-mig-one-gpu"): [r"gpu-\d-mig-2g20gb-\d"] * 2,
    template_claim("pod default/mig-1g", "mig-1g"): [r"gpu-\d-mig-1g10gb-\d"],
    template_claim("pod default/mig-3g", "mig-3g"): [r"gpu-\d-mig-3g40gb-\d"],
    template_claim("pod default/mps-share", "mps-10gi-25pct"): [MPS],
    template_claim("pod default/cuda-job", "one-big-gpu"): [WHOLE],
    template_claim("pod default/inference-small", "small-mps-share"): [MPS],
    template_claim("pod default/inference-large", "large-mps-share"): [MPS],
    template_claim("pod default/training-mig", "mig-3g"): [r"gpu-\d-mig-3g40gb-\d"],
    "resourceclaim default/timesliced-gpu (used by pod default/timeslice-a, pod default/timeslice-b)": [TS],
    template_claim("pod default/whole-gpu", "whole-h100"): [WHOLE],
}
GANG = [template_claim(f"job default/trainer replica {i}", "trainer-gpu") for i in range(4)]
MIG_MPS_PODS = [template_claim(f"pod default/mig-mps-{x}", "mps-8gi-in-3g") for x in "ab"]


def assert_devices(entry: dict[str, Any], patterns: list[str]) -> None:
    assert "error" not in entry, entry["error"]
    assert len(entry["devices"]) == len(patterns), entry
    for device, pattern in zip(sorted(entry["devices"]), sorted(patterns), strict=True):
        assert re.fullmatch(pattern, device), (entry["subject"], device)


def test_every_example_on_one_dgx_h100(machines: dict[str, Path]):
    """All examples at once on one node as installed by default: the lone claims first, in file
    order, then the gang of 4, for which no 4 whole GPUs are left; MPS inside MIG is not offered."""
    run = fgpu("plan", str(machines["n1"]), str(CLASSES), str(EXAMPLES), "-o", "json")
    assert run.returncode == 1, run.stderr  # a claim cannot be allocated
    claims = planned(run)
    assert set(claims) == {*EXAMPLE_CLAIMS, *GANG, *MIG_MPS_PODS}
    for subject, patterns in EXAMPLE_CLAIMS.items():
        assert_devices(claims[subject], patterns)
        assert claims[subject]["node"] == "n1"
    pair = claims[template_claim("pod default/mig-pair", "two-mig-one-gpu")]["devices"]
    assert len({device.split("-mig")[0] for device in pair}) == 1  # matchAttribute parentUUID: one GPU
    for subject in GANG:  # all or none
        assert claims[subject]["error"].startswith("gang cannot be placed whole: default/trainer-")
        assert "-gpu-" in claims[subject]["error"]  # the claims kube-controller-manager makes for the pods
        assert "no device of class gpu.fgpu.dev free on any one node" in claims[subject]["error"]
    for subject in MIG_MPS_PODS:
        assert claims[subject]["error"] == (
            "request gpu: no device of class mig-mps.gpu.fgpu.dev with compute >= 30, memory >= 8Gi on any node: "
            "the class matches no device"
        )
    document = json.loads(run.stdout)
    assert document["summary"] == {"allocated": 14, "failed": 6, "skipped": 0}
    assert document["skipped"] == [] and document["notes"] == []
    text = fgpu("plan", str(machines["n1"]), str(CLASSES), str(EXAMPLES)).stdout.splitlines()
    assert f"{GANG[1]}: cannot allocate: as above" in text  # the gang's reason once
    assert "14 allocated, 6 failed, 0 not planned" in text


def test_every_example_on_two_nodes_all_allocated(machines: dict[str, Path]):
    """With a second node that offers MPS inside 3g partitions, everything fits: the examples as
    text, one line a claim, as the user names it."""
    run = fgpu("plan", "--slices", str(machines["n1"]), str(machines["n2"]), "--classes", str(CLASSES),
               "--claims", *sorted(map(str, EXAMPLES.glob("*.yaml"))))  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    for i in range(3):
        line = f"deployment default/inference replica {i}: claim gpu from template inference-share: n[12]: {MPS}"
        assert any(re.fullmatch(line, text) for text in lines), run.stdout
    for subject in MIG_MPS_PODS:
        assert any(re.fullmatch(f"{subject}: n2: gpu-\\d-mig-3g40gb-\\d-mps \\(share\\)", t) for t in lines)
    gang = [next(t for t in lines if t.startswith(subject + ": ")) for subject in GANG]
    assert all(re.fullmatch(r".*: n[12]: gpu-\d", text) for text in gang), gang
    assert "20 allocated, 0 failed, 0 not planned" in lines
    assert lines[lines.index("free capacity per node:") + 1] == "n1"


def test_the_issue_command_plans_the_pods_of_the_examples(machines: dict[str, Path]):
    """The command of issue 24, which planned nothing: each example's pod gets its claim."""
    run = fgpu("plan", "--slices", str(machines["n1"]), "--classes", str(CLASSES),
               "--claims", str(EXAMPLES / "mps-share.yaml"), str(EXAMPLES / "mig.yaml"))  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert re.search(rf"^pod default/mps-share: claim gpu from template mps-10gi-25pct: n1: {MPS}$", run.stdout, re.M)
    assert re.search(
        r"^pod default/mig-1g: claim gpu from template mig-1g: n1: gpu-\d-mig-1g10gb-\d$", run.stdout, re.M
    )
    assert "3 allocated, 0 failed, 0 not planned" in run.stdout


def test_stdin_and_a_folder(machines: dict[str, Path], tmp_path: Path):
    folder = tmp_path / "manifests"
    folder.mkdir()
    (folder / "slices.yaml").write_text(machines["n1"].read_text())
    (folder / "classes.yml").write_text(CLASSES.read_text())
    (folder / "empty.yaml").write_text("")  # in a folder: passed over
    (folder / "README.md").write_text("not read")
    run = fgpu("plan", str(folder), "-", stdin=(EXAMPLES / "whole-gpu.yaml").read_text())
    assert run.returncode == 0, run.stderr
    assert re.search(r"^pod default/whole-gpu: claim gpu from template whole-h100: n1: gpu-\d$", run.stdout, re.M)
    bad = fgpu("plan", str(folder), "-", stdin="kind: [")
    assert bad.returncode == 2 and bad.stderr.startswith("fgpu plan: stdin is not valid YAML"), bad.stderr


# In process: the planner on objects


@pytest.fixture(scope="module")
def h100(machines: dict[str, Path]) -> list[Manifest]:
    """n1's slices and the device classes, as the planner reads them."""
    objects = yaml.safe_load(machines["n1"].read_text())["items"] + [
        d for d in yaml.safe_load_all(CLASSES.read_text()) if d
    ]
    return [manifest(obj, "given") for obj in objects]


def plan_of(base: list[Manifest], *documents: str) -> Plan:
    given = [
        manifest(obj, f"f.yaml: document {i}") for i, obj in enumerate(yaml.safe_load_all("---\n".join(documents)), 1)
    ]
    return make_plan(base + given, "binpack", "gpu.fgpu.dev")


def template(name: str, cls: str = "gpu.fgpu.dev", labels: str = "{}") -> str:
    return (
        f"kind: ResourceClaimTemplate\nmetadata: {{name: {name}}}\nspec:\n  metadata: {{labels: {labels}}}\n"
        f"  spec: {{devices: {{requests: [{{name: gpu, exactly: {{deviceClassName: {cls}}}}}]}}}}\n"
    )


def workload(kind: str, name: str, template_name: str, spec: str = "", pod_spec: str = "") -> str:
    claims = f"resourceClaims: [{{name: gpu, resourceClaimTemplateName: {template_name}}}]"
    if kind == "Pod":
        return f"kind: Pod\nmetadata: {{name: {name}}}\nspec: {{{claims}{pod_spec}}}\n"
    return f"kind: {kind}\nmetadata: {{name: {name}}}\nspec: {{{spec}template: {{spec: {{{claims}{pod_spec}}}}}}}\n"


def subjects(result: Plan) -> dict[str, str]:
    """subject -> 'node: devices' or 'error: reason'."""
    return {
        o.unit.subject: f"error: {o.error}" if o.error else f"{o.node}: {', '.join(o.devices)}" for o in result.outcomes
    }


def test_what_is_not_planned_is_said_one_line_an_object(h100: list[Manifest]):
    result = plan_of(
        h100,
        "kind: ConfigMap\nmetadata: {name: settings}\n",
        "kind: Frobnicator\napiVersion: example.com/v1\nmetadata: {name: f, namespace: ml}\n",
        "kind: Workload\napiVersion: scheduling.k8s.io/v1beta1\nmetadata: {name: train}\n",
        template("unused"),
        template("nvidia", cls="gpu.nvidia.com"),
        workload("Pod", "other-driver", "nvidia"),
        workload("DaemonSet", "monitor", "unused"),
        workload("Deployment", "idle", "unused", spec="replicas: 0, "),
        "kind: Deployment\nmetadata: {name: web}\nspec: {template: {spec: {containers: []}}}\n",
        "kind: ResourceClaim\nmetadata: {name: done}\nspec: {devices: {requests: []}}\n"
        "status: {allocation: {devices: {results: []}}}\n",
    )
    skipped = {s.what: f"{s.where}: {s.reason}" for s in result.skipped}
    assert skipped == {
        "configmap default/settings": "f.yaml: document 1: fgpu plan does not plan a ConfigMap: it plans "
        "ResourceClaims, and the claims of Pods, Deployments, ReplicaSets, StatefulSets, Jobs, CronJobs, "
        "TrainJobs, JobSets, LeaderWorkerSets, RayClusters, RayJobs",
        "frobnicator ml/f": "f.yaml: document 2: fgpu plan does not plan a Frobnicator: it plans "
        "ResourceClaims, and the claims of Pods, Deployments, ReplicaSets, StatefulSets, Jobs, CronJobs, "
        "TrainJobs, JobSets, LeaderWorkerSets, RayClusters, RayJobs",
        "workload default/train": "f.yaml: document 3: gangs through the Workload API (scheduling.k8s.io) are "
        "not planned yet (another issue); its pods' claims are planned one by one",
        "resourceclaimtemplate default/unused": "f.yaml: document 4: no pod in the input uses it",
        "pod default/other-driver: claim gpu from template nvidia": "f.yaml: document 6: for another driver: "
        "class gpu.nvidia.com (give its DeviceClass and ResourceSlices to plan it)",
        "daemonset default/monitor": "f.yaml: document 7: a DaemonSet runs a pod on each node that fits: give "
        "the Nodes (in the files or --kubeconfig)",
        "deployment default/idle": "f.yaml: document 8: runs no pods (replicas or parallelism 0)",
        "deployment default/web": "f.yaml: document 9: its pods use no ResourceClaims",
        "resourceclaim default/done": "f.yaml: document 10: allocated already (counted as taken)",
    }
    assert result.outcomes == [] and result.failed == 0


def test_unknown_kind_in_the_text_output(machines: dict[str, Path], tmp_path: Path):
    manifests = tmp_path / "app.yaml"
    manifests.write_text("kind: Service\nmetadata: {name: web}\n---\n" + (EXAMPLES / "mig.yaml").read_text())
    run = fgpu("plan", str(machines["n1"]), str(CLASSES), str(manifests))
    assert run.returncode == 0, run.stderr
    assert f"  service default/web ({manifests}: document 1): fgpu plan does not plan a Service" in run.stdout
    assert "2 allocated, 0 failed, 1 not planned" in run.stdout


def test_replicas_parallelism_and_the_names_a_controller_gives(h100: list[Manifest]):
    result = plan_of(
        h100,
        template("one"),
        workload("Deployment", "web", "one", spec="replicas: 2, "),
        workload("StatefulSet", "db", "one", spec="replicas: 2, "),
        workload("Job", "train", "one", spec="parallelism: 3, completions: 2, completionMode: Indexed, "),
        workload("ReplicaSet", "rs", "one"),
        "kind: CronJob\nmetadata: {name: nightly}\nspec: {jobTemplate: {spec: {template: {spec: "
        "{resourceClaims: [{name: gpu, resourceClaimTemplateName: one}]}}}}}\n",
    )
    got = subjects(result)
    assert list(got) == [
        template_claim("deployment default/web replica 0", "one"),
        template_claim("deployment default/web replica 1", "one"),
        template_claim("statefulset default/db replica 0", "one"),
        template_claim("statefulset default/db replica 1", "one"),
        template_claim("job default/train replica 0", "one"),  # parallelism 3, but 2 completions
        template_claim("job default/train replica 1", "one"),
        template_claim("replicaset default/rs replica 0", "one"),
        template_claim("cronjob default/nightly replica 0", "one"),  # one run
    ]
    assert all(re.fullmatch(r"n1: gpu-\d", value) for value in got.values()), got
    assert len({o.devices for o in result.outcomes}) == 8  # a whole GPU each: all different
    names = [o.unit.claim.name for o in result.outcomes]
    assert re.fullmatch(r"db-0-gpu-[b-z2-9]{5}", names[2]) and re.fullmatch(
        r"web-[b-z2-9]{10}-[b-z2-9]{5}-gpu-.{5}", names[0]
    )
    assert re.fullmatch(r"train-1-[b-z2-9]{5}-gpu-[b-z2-9]{5}", names[5])
    assert len(set(names)) == len(names)


def test_a_claim_from_a_template_is_the_one_kube_controller_manager_makes():
    given = manifest(yaml.safe_load(template("t", labels="{team: ml}")), "f.yaml: document 1")
    given.obj["spec"]["metadata"]["annotations"] = {"note": "x"}
    pod = Pod(Ref("Pod", "ml", "p"), None, "p", (PodClaim("gpu", template="t"),))
    claim = claim_object(claim_template(given), pod, pod.claims[0])
    assert claim["metadata"]["namespace"] == "ml" and claim["metadata"]["name"].startswith("p-gpu-")
    assert claim["metadata"]["labels"] == {"team": "ml"}
    assert claim["metadata"]["annotations"] == {"note": "x", "resource.kubernetes.io/pod-claim-name": "gpu"}
    assert claim["spec"] == given.obj["spec"]["spec"]
    long_pod, long_claim = "p" * 60, "c" * 30  # cut in proportion, as upstream does: 37 + "-" + 18, then 5
    long = claim_object(claim_template(given), Pod(pod.owner, None, long_pod, ()), PodClaim(long_claim, template="t"))
    assert re.fullmatch("p{37}-c{18}[b-z2-9]{5}", long["metadata"]["name"])


def test_a_daemonset_with_nodes_gets_a_claim_on_each_node_it_selects(h100: list[Manifest], machines: dict[str, Path]):
    n2 = [manifest(obj, "given") for obj in yaml.safe_load(machines["n2"].read_text())["items"]]
    result = plan_of(
        h100 + n2,
        "kind: Node\nmetadata: {name: n1, labels: {gpu: h100}}\n",
        "kind: Node\nmetadata: {name: n2, labels: {gpu: h100}}\n",
        "kind: Node\nmetadata: {name: n3}\n",
        template("one"),
        workload("DaemonSet", "exporter", "one", pod_spec=", nodeSelector: {gpu: h100}, affinity: {x: 1}"),
    )
    got = subjects(result)
    assert list(got) == [template_claim(f"daemonset default/exporter on node n{i}", "one") for i in (1, 2)]
    assert [v.split(":")[0] for v in got.values()] == ["n1", "n2"]
    assert any("placement only on the 3 Node(s) given, where the claim's pods fit" in note for note in result.notes)
    assert not any("not checked" in note for note in result.notes)


def test_given_nodes_restrict_placement(h100: list[Manifest], machines: dict[str, Path]):
    n2 = [manifest(obj, "given") for obj in yaml.safe_load(machines["n2"].read_text())["items"]]
    web = workload("Deployment", "web", "one", spec="replicas: 3, ", pod_spec=", nodeSelector: {a: b}")
    result = plan_of(h100 + n2, "kind: Node\nmetadata: {name: n2, labels: {a: b}}\n", template("one"), web)
    assert [o.node for o in result.outcomes] == ["n2"] * 3
    assert "not used, no Node object given for them: the slices of n1" in result.notes
    assert sorted(result.nodes) == ["n2"]
    without = plan_of(h100 + n2, "kind: Node\nmetadata: {name: n2}\n", template("one"), web)
    assert [o.error for o in without.outcomes] == [
        "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."
    ] * 3


def test_claims_go_only_where_their_pods_fit(h100: list[Manifest], machines: dict[str, Path]):
    """Pod fit as kube-scheduler checks it (driver/scheduling/nodefit.py): each replica's pod is counted on the
    node its claim went to, so the third replica of 3-CPU pods finds no node with CPU left."""
    n2 = [manifest(obj, "given") for obj in yaml.safe_load(machines["n2"].read_text())["items"]]
    nodes = [
        "kind: Node\nmetadata: {name: n1}\nstatus: {allocatable: {cpu: '4', memory: 64Gi, pods: '110'}}\n",
        "kind: Node\nmetadata: {name: n2}\nspec: {taints: [{key: dedicated, value: x, effect: NoSchedule}]}\n"
        "status: {allocatable: {cpu: '64', memory: 64Gi, pods: '110'}}\n",
    ]
    container = ", containers: [{name: c, resources: {requests: {cpu: '3'}}}]"
    web = workload("Deployment", "web", "one", spec="replicas: 3, ", pod_spec=container)
    result = plan_of(h100 + n2, *nodes, template("one"), web)
    assert [o.node for o in result.outcomes] == ["n1", "", ""]
    assert result.outcomes[1].error == (
        "0/2 nodes are available: 1 Insufficient cpu, 1 node(s) had untolerated taint {dedicated: x}."
    )
    tolerating = container + ", tolerations: [{key: dedicated, operator: Exists}]"
    result = plan_of(
        h100 + n2,
        *nodes,
        template("one"),
        workload("Deployment", "web", "one", spec="replicas: 3, ", pod_spec=tolerating),
    )
    assert sorted(o.node for o in result.outcomes) == ["n1", "n2", "n2"]


def gang_claim(name: str, size: int = 4, opt_in: bool = True) -> str:
    labels = f"gpu.fgpu.dev/gang: train, gpu.fgpu.dev/gang-size: '{size}'"
    labels += ", gpu.fgpu.dev/allocator: fgpu" if opt_in else ""
    return (
        f"kind: ResourceClaim\nmetadata: {{name: {name}, labels: {{{labels}}}}}\n"
        "spec: {devices: {requests: [{name: gpu, exactly: {deviceClassName: gpu.fgpu.dev}}]}}\n"
    )


def test_gangs_as_the_controller_places_them(h100: list[Manifest]):
    waiting = plan_of(h100, *(gang_claim(f"t{i}") for i in range(3)))
    assert {o.error for o in waiting.outcomes} == {"gang default/train waits for 1 more claim(s) of 4"}
    whole = plan_of(h100, *(gang_claim(f"t{i}") for i in range(4)))
    assert whole.failed == 0 and len({o.devices for o in whole.outcomes}) == 4
    too_big = plan_of(h100, *(gang_claim(f"t{i}", size=9) for i in range(9)))
    assert too_big.failed == 9 and all(o.error.startswith("gang cannot be placed whole") for o in too_big.outcomes)
    assert too_big.nodes["n1"] == [f"  gpu-{i}-counters: free" for i in range(8)]  # none kept
    bad_size = plan_of(h100, gang_claim("t0", size=0).replace("'0'", "four"))
    assert [o.error for o in bad_size.outcomes] == ["label gpu.fgpu.dev/gang-size must be a whole number"]
    alone = plan_of(h100, *(gang_claim(f"t{i}", size=9, opt_in=False) for i in range(2)))
    assert alone.failed == 0  # no opt-in: kube-scheduler allocates each alone
    assert alone.notes[0].startswith(
        "resourceclaim default/t0: labelled gpu.fgpu.dev/gang without gpu.fgpu.dev/allocator=fgpu"
    )


def test_the_same_object_twice(h100: list[Manifest]):
    result = plan_of(h100, template("t"), template("t", cls="mig.gpu.fgpu.dev"), workload("Pod", "p", "t"))
    assert result.notes == [
        "resourceclaimtemplate default/t: given twice, differently (f.yaml: document 1; f.yaml: document 2): the later"
    ]
    assert re.fullmatch(r"gpu-\d-mig-.*", result.outcomes[0].devices[0])


def test_a_missing_class_of_ours_is_a_failure_with_its_reason(h100: list[Manifest]):
    result = plan_of([m for m in h100 if m.ref.kind != "DeviceClass"], template("t"), workload("Pod", "p", "t"))
    error = result.outcomes[0].error
    assert re.fullmatch(r"claim default/p-gpu-\w{5}, request gpu: could not retrieve device class gpu.fgpu.dev", error)
    assert "no DeviceClasses: give them (daemonset/deviceclasses.yaml) or --kubeconfig" in result.notes


def test_pods_of_rejects_what_no_controller_would_run():
    with pytest.raises(ValueError, match=r"job default/j: spec.parallelism must be a whole number, not -1"):
        pods_of(manifest(yaml.safe_load(workload("Job", "j", "t", spec="parallelism: -1, ")), "f"), [])
    with pytest.raises(ValueError, match=r"deployment default/d: spec.template is missing"):
        pods_of(manifest({"kind": "Deployment", "metadata": {"name": "d"}, "spec": {}}, "f"), [])


def test_plan_writes_nothing_to_stdout_on_bad_input():
    run = fgpu(
        "plan", "-", stdin="kind: Pod\nmetadata: {name: p}\nspec: {resourceClaims: [{name: g, resourceClaimName: c}]}\n"
    )
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == (
        "fgpu plan: stdin: document 1: pod default/p: claim g names ResourceClaim default/c, "
        "which is not in the input\n"
    )


def test_an_unreachable_cluster_is_one_line(tmp_path: Path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG)
    run = fgpu("plan", "--kubeconfig", str(kubeconfig), str(EXAMPLES / "mig.yaml"))
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.startswith("fgpu plan: API server unreachable: ") and len(run.stderr.splitlines()) == 1
