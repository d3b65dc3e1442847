"""The gang a workload operator's pod belongs to, read from the labels and annotations the operator
puts on every pod it creates: JobSet (and Kubeflow Trainer's TrainJobs, which run as JobSets),
LeaderWorkerSet and KubeRay. None of these versions (JobSet v0.12, LWS v0.9, Trainer v2.2, KubeRay
v1.6) creates an upstream Workload or PodGroup (scheduling.k8s.io); their own gang options make
Volcano's, scheduler-plugins' or KAI's PodGroups, which kube-scheduler does not read. So the
controller groups their pods itself, as it groups a PodGroup's (driver/controller/groups.py).

- LeaderWorkerSet: one gang per group (leader and its workers): the label
  `leaderworkerset.sigs.k8s.io/group-key` (a hash unique to the group) and the annotation
  `leaderworkerset.sigs.k8s.io/size`, both on the leader and on every worker.
- JobSet: one gang per JobSet run: `jobset.sigs.k8s.io/jobset-name` and `jobset.sigs.k8s.io/restart-attempt`
  (a restart recreates every Job: the new pods are a new gang). Its pods carry the number of Jobs
  (`jobset.sigs.k8s.io/global-replicas`) but not each Job's parallelism, so the size is that number
  (one pod per Job, JobSet's usual form) unless the pod template says it with `gpu.fgpu.dev/gang-size`
  (a Trainer TrainJob's nodes are one Job of numNodes pods: its runtime's template needs the label).
- KubeRay: one gang per RayCluster (`ray.io/cluster`, head and workers). Its pods carry no size, so
  a RayCluster's pods are a gang only with `gpu.fgpu.dev/gang-size` on their templates (every
  group's: the head's and each worker group's, the same number: 1 + the workers).
- Kueue's plain pod groups (its pod integration, and LWS under Kueue): the label
  `kueue.x-k8s.io/pod-group-name` and the annotation `kueue.x-k8s.io/pod-group-total-count`, when
  no operator's labels above say more.

The pod label `gpu.fgpu.dev/gang-size` gives the size for any of them. No I/O here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from driver.scheduling.opt_in import GANG_SIZE_LABEL, gang_size

JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
JOBSET_RESTARTS = "jobset.sigs.k8s.io/restart-attempt"
JOBSET_JOBS = "jobset.sigs.k8s.io/global-replicas"
LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_KEY = "leaderworkerset.sigs.k8s.io/group-key"
LWS_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
LWS_SIZE = "leaderworkerset.sigs.k8s.io/size"
RAY_CLUSTER = "ray.io/cluster"
KUEUE_GROUP = "kueue.x-k8s.io/pod-group-name"
KUEUE_GROUP_COUNT = "kueue.x-k8s.io/pod-group-total-count"


@dataclass(frozen=True)
class FrameworkGang:
    """A pod's gang as its operator means it: `name` is unique in the namespace (`jobset:train`,
    `lws:serve/0`, `ray:rc`); `size` the pods it needs together (0: the size cannot be read, the
    gang is never placed and its claims say why)."""

    framework: str
    name: str
    size: int
    signal: str  # where the size came from, for the docs and messages


def framework_gang(labels: Mapping[str, str], annotations: Mapping[str, str]) -> FrameworkGang | None:
    """The gang of a pod with these labels and annotations, or None (no operator's pod, or a Ray
    pod whose size is not given: placed one by one)."""
    given = gang_size(dict(labels)) if GANG_SIZE_LABEL in labels else None
    if (group := labels.get(LWS_GROUP_KEY)) and labels.get(LWS_NAME):
        size = given if given is not None else _whole_number(annotations.get(LWS_SIZE))
        index = labels.get(LWS_GROUP_INDEX, group[:12])
        return FrameworkGang("LeaderWorkerSet", f"lws:{labels[LWS_NAME]}/{index}", size, LWS_SIZE)
    if name := labels.get(JOBSET_NAME):
        restarts = labels.get(JOBSET_RESTARTS, "0")
        suffix = "" if restarts == "0" else f"/restart-{restarts}"
        if given is not None:
            return FrameworkGang("JobSet", f"jobset:{name}{suffix}", given, GANG_SIZE_LABEL)
        return FrameworkGang("JobSet", f"jobset:{name}{suffix}", _whole_number(labels.get(JOBSET_JOBS)), JOBSET_JOBS)
    if (cluster := labels.get(RAY_CLUSTER)) and given is not None:
        return FrameworkGang("RayCluster", f"ray:{cluster}", given, GANG_SIZE_LABEL)
    if group := labels.get(KUEUE_GROUP):
        size = given if given is not None else _whole_number(annotations.get(KUEUE_GROUP_COUNT))
        return FrameworkGang("Kueue pod group", f"kueue:{group}", size, KUEUE_GROUP_COUNT)
    return None


def pod_framework_gang(pod: Mapping[str, object]) -> FrameworkGang | None:
    """framework_gang of a pod object."""
    meta = pod.get("metadata")
    if not isinstance(meta, Mapping):
        return None
    return framework_gang(meta.get("labels") or {}, meta.get("annotations") or {})


def _whole_number(value: str | None) -> int:
    try:
        return max(0, int(value or ""))
    except ValueError:
        return 0
