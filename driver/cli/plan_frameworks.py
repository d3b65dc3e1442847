"""The pods workload operators would create, for `fgpu plan`: Kubeflow Trainer's TrainJob (from
its TrainingRuntime or ClusterTrainingRuntime, which must be in the input), JobSet,
LeaderWorkerSet, KubeRay's RayCluster and RayJob. Each pod carries the labels and annotations its
operator puts on it (JobSet v0.12, LWS v0.9, Trainer v2.2, KubeRay v1.6), so that its gang is read
from them exactly as the controller reads it (driver/scheduling/framework_gangs.py). Names follow
each operator; their random parts are made up, stable from run to run. No I/O."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from driver.allocator.model import ObjectError
from driver.cli.plan_inputs import Manifest, NotPlanned, Pod, Ref, count_of, made_up, mapping_of, pod_claims
from driver.scheduling.framework_gangs import (
    JOBSET_JOBS,
    JOBSET_NAME,
    JOBSET_RESTARTS,
    LWS_GROUP_INDEX,
    LWS_GROUP_KEY,
    LWS_NAME,
    LWS_SIZE,
    RAY_CLUSTER,
    framework_gang,
)

Find = Callable[[Ref], Manifest | None]  # an object of the input by kind, namespace and name
TRAINER_STEP = "trainer.kubeflow.org/trainjob-ancestor-step"  # marks the runtime's node Job


@dataclass(frozen=True)
class Template:
    """One kind of pod an operator makes: its role in the subject, its name, metadata and spec."""

    role: str
    name: str
    labels: dict[str, str]
    annotations: dict[str, str]
    spec: dict[str, Any]


def framework_pods(workload: Manifest, find: Find) -> list[Pod]:
    """The pods the operator of `workload` runs for it at once."""
    ref, spec = workload.ref, mapping_of(workload.obj.get("spec"), workload.ref, "spec")
    if ref.kind == "TrainJob":
        templates = list(_jobset(ref, ref.name, _trainjob_jobset(ref, spec, find)))
    elif ref.kind == "JobSet":
        templates = list(_jobset(ref, ref.name, spec))
    elif ref.kind == "LeaderWorkerSet":
        templates = list(_leaderworkerset(ref, spec))
    elif ref.kind == "RayCluster":
        templates = list(_raycluster(ref, ref.name, spec))
    else:
        templates = list(_rayjob(ref, spec))
    if not templates:
        raise NotPlanned("runs no pods (replicas 0)")
    pods = []
    for i, template in enumerate(templates):
        gang = framework_gang(template.labels, template.annotations)
        pod = Pod(ref, i, template.name, pod_claims(ref, template.spec), gang=gang, role=template.role)
        pods.append(pod.with_needs(template.spec))
    return pods


def _pod_template(value: Any, ref: Ref, field: str) -> tuple[dict[str, str], dict[str, str], dict[str, Any]]:
    """A pod template's labels, annotations and spec."""
    template = mapping_of(value, ref, field)
    meta = template.get("metadata") or {}
    labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    annotations = {str(k): str(v) for k, v in (meta.get("annotations") or {}).items()}
    return labels, annotations, mapping_of(template.get("spec"), ref, f"{field}.spec")


# JobSet, and TrainJobs as Trainer runs them


def _trainjob_jobset(ref: Ref, spec: dict[str, Any], find: Find) -> dict[str, Any]:
    """The JobSet spec Trainer makes of a TrainJob: its runtime's, with the node Job's pods set to
    numNodes (the TrainJob's, else the runtime's mlPolicy)."""
    runtime_ref = mapping_of(spec.get("runtimeRef"), ref, "spec.runtimeRef")
    kind = str(runtime_ref.get("kind") or "ClusterTrainingRuntime")
    if kind not in ("TrainingRuntime", "ClusterTrainingRuntime"):
        raise ObjectError(f"{ref}: spec.runtimeRef.kind must be TrainingRuntime or ClusterTrainingRuntime, not {kind}")
    wanted = Ref(kind, ref.namespace if kind == "TrainingRuntime" else "", str(runtime_ref.get("name") or ""))
    runtime = find(wanted)
    if runtime is None:
        raise NotPlanned(
            f"its runtime {wanted} is not in the input: the pods are in the runtime's template; give the "
            f"{kind} too (fgpu plan does not read runtimes from a cluster)"
        )
    runtime_spec = mapping_of(runtime.obj.get("spec"), runtime.ref, "spec")
    jobset = mapping_of(mapping_of(runtime_spec.get("template"), runtime.ref, "spec.template").get("spec"),
                        runtime.ref, "spec.template.spec")  # fmt: skip
    nodes = (spec.get("trainer") or {}).get("numNodes") or (runtime_spec.get("mlPolicy") or {}).get("numNodes")
    if nodes is None:
        return jobset
    replicated = []
    for rjob in jobset.get("replicatedJobs") or []:
        template = (rjob or {}).get("template") or {}
        if ((template.get("metadata") or {}).get("labels") or {}).get(TRAINER_STEP) == "trainer":
            job_spec = {**(template.get("spec") or {}), "parallelism": nodes, "completions": nodes}
            rjob = {**rjob, "template": {**template, "spec": job_spec}}
        replicated.append(rjob)
    return {**jobset, "replicatedJobs": replicated}


def _jobset(ref: Ref, name: str, spec: dict[str, Any]) -> Iterator[Template]:
    """Per replicated job, `replicas` Jobs of min(parallelism, completions) pods each, labelled as
    JobSet labels them (global-replicas: the number of Jobs)."""
    rjobs = spec.get("replicatedJobs")
    if not isinstance(rjobs, list) or not rjobs:
        raise ObjectError(f"{ref}: replicatedJobs is missing or not a list")
    jobs = sum(count_of(ref, rjob, "replicas") for rjob in rjobs)
    for rjob in rjobs:
        rjob_name = str(rjob.get("name") or "")
        job = mapping_of(rjob.get("template"), ref, f"replicatedJobs[{rjob_name}].template")
        job_spec = mapping_of(job.get("spec"), ref, f"replicatedJobs[{rjob_name}].template.spec")
        labels, annotations, pod_spec = _pod_template(
            job_spec.get("template"), ref, f"replicatedJobs[{rjob_name}] pod template"
        )
        parallelism = count_of(ref, job_spec, "parallelism")
        if job_spec.get("completions") is not None:
            parallelism = min(parallelism, count_of(ref, job_spec, "completions"))
        ours = {JOBSET_NAME: name, "jobset.sigs.k8s.io/replicatedjob-name": rjob_name,
                JOBSET_RESTARTS: "0", JOBSET_JOBS: str(jobs)}  # fmt: skip
        for j in range(count_of(ref, rjob, "replicas")):
            job_name = f"{name}-{rjob_name}-{j}"
            for p in range(parallelism):
                pod_name = f"{job_name}-{p}-{made_up(f'{ref}/{job_name}/{p}', 5)}"
                job_labels = {**labels, **ours, "jobset.sigs.k8s.io/job-index": str(j)}
                yield Template(f"{rjob_name} {j} pod {p}", pod_name, job_labels, annotations, pod_spec)


# LeaderWorkerSet


def _leaderworkerset(ref: Ref, spec: dict[str, Any]) -> Iterator[Template]:
    """`replicas` groups of `size` pods: a leader (leaderTemplate, else workerTemplate) and size - 1
    workers, each carrying the group's key and size."""
    lwt = mapping_of(spec.get("leaderWorkerTemplate"), ref, "spec.leaderWorkerTemplate")
    size = count_of(ref, lwt, "size")
    worker = _pod_template(lwt.get("workerTemplate"), ref, "leaderWorkerTemplate.workerTemplate")
    leader = (
        _pod_template(lwt["leaderTemplate"], ref, "leaderWorkerTemplate.leaderTemplate")
        if lwt.get("leaderTemplate")
        else worker
    )
    for g in range(count_of(ref, spec, "replicas")):
        ours = {LWS_NAME: ref.name, LWS_GROUP_INDEX: str(g), LWS_GROUP_KEY: made_up(f"{ref}/{g}", 40)}
        for w in range(size):
            labels, annotations, pod_spec = leader if w == 0 else worker
            name = f"{ref.name}-{g}" if w == 0 else f"{ref.name}-{g}-{w}"
            role = f"group {g} leader" if w == 0 else f"group {g} worker {w}"
            yield Template(role, name, {**labels, **ours, "leaderworkerset.sigs.k8s.io/worker-index": str(w)},
                           {**annotations, LWS_SIZE: str(size)}, pod_spec)  # fmt: skip


# KubeRay


def _raycluster(ref: Ref, name: str, spec: dict[str, Any]) -> Iterator[Template]:
    """The head, then each worker group's replicas (within minReplicas..maxReplicas) times its
    numOfHosts, labelled with the cluster, group and node type as KubeRay labels them."""
    head = mapping_of(spec.get("headGroupSpec"), ref, "spec.headGroupSpec")
    labels, annotations, pod_spec = _pod_template(head.get("template"), ref, "headGroupSpec.template")
    ours = {RAY_CLUSTER: name, "ray.io/node-type": "head", "ray.io/group": "headgroup"}
    yield Template("head", f"{name}-head-{made_up(f'{ref}/head', 5)}", {**labels, **ours}, annotations, pod_spec)
    for group in spec.get("workerGroupSpecs") or []:
        group_name = str(group.get("groupName") or "")
        field = f"workerGroupSpecs[{group_name}]"
        labels, annotations, pod_spec = _pod_template(group.get("template"), ref, f"{field}.template")
        replicas = max(count_of(ref, group, "replicas"), count_of(ref, {"minReplicas": 0, **group}, "minReplicas"))
        if group.get("maxReplicas") is not None:
            replicas = min(replicas, count_of(ref, group, "maxReplicas"))
        if group.get("suspend"):
            replicas = 0
        ours = {RAY_CLUSTER: name, "ray.io/node-type": "worker", "ray.io/group": group_name}
        for i in range(replicas * count_of(ref, group, "numOfHosts")):
            pod_name = f"{name}-{group_name}-worker-{made_up(f'{ref}/{group_name}/{i}', 5)}"
            yield Template(f"{group_name} worker {i}", pod_name, {**labels, **ours}, annotations, pod_spec)


def _rayjob(ref: Ref, spec: dict[str, Any]) -> Iterator[Template]:
    """The pods of the cluster a RayJob brings up (named <rayjob>-<5 random>); its submitter is
    left out (it takes no claim in KubeRay's own template)."""
    if spec.get("clusterSelector"):
        raise NotPlanned("runs on an existing RayCluster (clusterSelector): plan that RayCluster")
    cluster = mapping_of(spec.get("rayClusterSpec"), ref, "spec.rayClusterSpec")
    yield from _raycluster(ref, f"{ref.name}-{made_up(str(ref), 5)}", cluster)
