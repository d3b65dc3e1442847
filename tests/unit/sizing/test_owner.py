"""Whose a claim is (driver/sizing/owner.py): the workload at the top of its pod's ownership chain,
from the pod alone, and the template and request it came from."""

from __future__ import annotations

from typing import Any

from driver.sizing.history import Workload
from driver.sizing.owner import request_index, template_of, workload_of


def pod(name: str, owner: tuple[str, str] | None = None, labels: dict[str, str] | None = None) -> dict[str, Any]:
    refs = [{"kind": owner[0], "name": owner[1], "controller": True}] if owner else []
    return {
        "metadata": {"name": name, "labels": labels or {}, "ownerReferences": refs},
        "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "mps-10gi"}, {"name": "x"}]},
    }


def test_a_deployments_pod_names_the_deployment_without_reading_its_replicaset():
    assert workload_of(pod("web-7d4b9c-x2x", ("ReplicaSet", "web-7d4b9c"), {"pod-template-hash": "7d4b9c"})) == (
        Workload("Deployment", "web")
    )
    # A ReplicaSet of its own: no hash label, it is the workload.
    assert workload_of(pod("rs-abcde", ("ReplicaSet", "rs"))) == Workload("ReplicaSet", "rs")


def test_other_owners_sets_and_bare_pods():
    assert workload_of(pod("db-0", ("StatefulSet", "db"))) == Workload("StatefulSet", "db")
    assert workload_of(pod("train-0-abc", ("Job", "train-workers-0"), {"jobset.sigs.k8s.io/jobset-name": "train"})) == (
        Workload("JobSet", "train")
    )
    assert workload_of(pod("lonely")) == Workload("Pod", "lonely")
    not_controller = pod("p")
    not_controller["metadata"]["ownerReferences"] = [{"kind": "Node", "name": "n1"}]
    assert workload_of(not_controller) == Workload("Pod", "p")


def test_the_template_comes_from_the_pods_claim_entry_and_the_request_index_from_the_claim():
    claim = {
        "metadata": {"annotations": {"resource.kubernetes.io/pod-claim-name": "gpu"}},
        "spec": {"devices": {"requests": [{"name": "a"}, {"name": "gpu"}]}},
    }
    assert template_of(pod("p"), claim) == "mps-10gi"
    assert template_of(pod("p"), {"metadata": {}}) == ""  # not made from a template
    claim_of_x = {"metadata": {"annotations": {"resource.kubernetes.io/pod-claim-name": "x"}}}
    assert template_of(pod("p"), claim_of_x) == ""  # the pod names a claim of its own for it
    assert request_index(claim, "gpu") == 1 and request_index(claim, "other") == -1
