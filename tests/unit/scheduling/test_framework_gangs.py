"""Each operator's gang as read from the labels and annotations its pods carry
(driver/scheduling/framework_gangs.py): the labels are those the operators' own code sets (JobSet
v0.12 labelAndAnnotateObject, LWS v0.9 pod annotations, KubeRay v1.6 labelPod)."""

from __future__ import annotations

from driver.scheduling.framework_gangs import FrameworkGang, framework_gang, pod_framework_gang

JOBSET = {
    "jobset.sigs.k8s.io/jobset-name": "train",
    "jobset.sigs.k8s.io/replicatedjob-name": "workers",
    "jobset.sigs.k8s.io/replicatedjob-replicas": "4",
    "jobset.sigs.k8s.io/global-replicas": "4",
    "jobset.sigs.k8s.io/job-index": "1",
    "jobset.sigs.k8s.io/restart-attempt": "0",
}
LWS = {
    "leaderworkerset.sigs.k8s.io/name": "serve",
    "leaderworkerset.sigs.k8s.io/group-index": "0",
    "leaderworkerset.sigs.k8s.io/group-key": "5f1d0e6c9a",
    "leaderworkerset.sigs.k8s.io/worker-index": "1",
}
RAY = {"ray.io/cluster": "rc", "ray.io/group": "workers", "ray.io/node-type": "worker"}


def test_a_jobset_is_one_gang_of_its_jobs_and_a_restart_is_a_new_gang():
    assert framework_gang(JOBSET, JOBSET) == FrameworkGang(
        "JobSet", "jobset:train", 4, "jobset.sigs.k8s.io/global-replicas"
    )
    restarted = {**JOBSET, "jobset.sigs.k8s.io/restart-attempt": "2"}
    assert framework_gang(restarted, {}).name == "jobset:train/restart-2"  # type: ignore[union-attr]


def test_a_jobs_pod_count_comes_from_the_pod_templates_gang_size_label():
    """A TrainJob's nodes are one Job of numNodes pods: global-replicas says 1."""
    trainer = {**JOBSET, "jobset.sigs.k8s.io/global-replicas": "1", "gpu.fgpu.dev/gang-size": "4"}
    assert framework_gang(trainer, {}) == FrameworkGang("JobSet", "jobset:train", 4, "gpu.fgpu.dev/gang-size")


def test_a_leaderworkerset_group_is_a_gang_of_its_size_annotation():
    gang = framework_gang(LWS, {"leaderworkerset.sigs.k8s.io/size": "2"})
    assert gang == FrameworkGang("LeaderWorkerSet", "lws:serve/0", 2, "leaderworkerset.sigs.k8s.io/size")
    assert framework_gang(LWS, {}).size == 0  # type: ignore[union-attr]  # unreadable: never placed


def test_a_raycluster_is_a_gang_only_with_its_size_given():
    assert framework_gang(RAY, {}) is None
    assert framework_gang({**RAY, "gpu.fgpu.dev/gang-size": "3"}, {}) == FrameworkGang(
        "RayCluster", "ray:rc", 3, "gpu.fgpu.dev/gang-size"
    )
    assert framework_gang({**RAY, "gpu.fgpu.dev/gang-size": "x"}, {}).size == 0  # type: ignore[union-attr]


def test_a_kueue_pod_group_is_a_gang_of_its_total_count():
    labels, annotations = {"kueue.x-k8s.io/pod-group-name": "g"}, {"kueue.x-k8s.io/pod-group-total-count": "3"}
    assert framework_gang(labels, annotations) == FrameworkGang(
        "Kueue pod group", "kueue:g", 3, "kueue.x-k8s.io/pod-group-total-count"
    )
    under_kueue = framework_gang({**LWS, **labels}, {**annotations, "leaderworkerset.sigs.k8s.io/size": "2"})
    assert under_kueue.framework == "LeaderWorkerSet"  # type: ignore[union-attr]


def test_other_pods_are_in_no_operators_gang():
    assert framework_gang({"app": "x", "gpu.fgpu.dev/gang-size": "3"}, {}) is None
    assert pod_framework_gang({"metadata": {"labels": {"app": "x"}}}) is None
    assert pod_framework_gang({"metadata": {"labels": LWS, "annotations": {"leaderworkerset.sigs.k8s.io/size": "2"}}})
