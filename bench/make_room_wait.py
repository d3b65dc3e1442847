"""Benchmark: how long a claim that fits only after a move waits, on the real node (kube-apiserver,
kube-scheduler, kube-controller-manager, kubelet and containerd from upstream; `fgpu controller
--make-room`; `fgpu kubelet-plugin` on mock dgx-h100 GPUs, of which the claims may use GPUs 0 and 1).

Each round: GPU 0 holds a pod that is not movable and GPU 1 one movable pod of a Deployment (MPS
shares of 10 GiB; the Deployment's pod has room beside the other), so no GPU is free; then a pod
whose opt-in claim asks for a whole GPU. Seen by polling the API every 50 ms, from that pod's
creation: the eviction (the controller's EvictedToMakeRoom Event), the evicted pod's claim gone
(its grace period, 1 s, kubelet's unprepare, kube-controller-manager deleting it), the pending
claim allocated (by the controller, on the GPU reserved for it), the pod Running. The issue's
target: no longer than one controller pass plus the evictions' grace, i.e. the two controller
steps (creation -> eviction, claim gone -> allocated) each within a pass.

  python -m bench.make_room_wait --rounds 5   # needs root
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import time
from typing import Any

import kubernetes

from driver.scheduling.opt_in import MOVABLE_ANNOTATION, OPT_IN_LABEL, OPT_IN_VALUE, SCHEDULING_GATE
from testbed.cluster.harness import free_port
from testbed.local_cluster import local_cluster
from testbed.workloads import NS, claim_template, deployment, pod, unique, wait_until

GPU = 'device.attributes["gpu.fgpu.dev"].index'
STEPS = ("evicted", "victim_claim_gone", "allocated", "running")


def opt_in_template(name: str, device_class: str, selector: str, memory: str = "") -> dict[str, Any]:
    template = claim_template(name, device_class, selector=selector, capacity={"memory": memory} if memory else None)
    template["spec"]["metadata"] = {"labels": {OPT_IN_LABEL: OPT_IN_VALUE}}
    return template


def templates() -> list[dict[str, Any]]:
    """The claim templates a round's pods use (in namespace default)."""
    return [
        opt_in_template("small", "mps.gpu.fgpu.dev", f"{GPU} <= 1", "10Gi"),
        opt_in_template("anchor", "mps.gpu.fgpu.dev", f"{GPU} == 0", "10Gi"),
        opt_in_template("filler", "mps.gpu.fgpu.dev", f"{GPU} == 0", "65Gi"),
        opt_in_template("whole", "gpu.fgpu.dev", f"{GPU} <= 1"),
    ]


def gated_pod(node: str, template: str) -> dict[str, Any]:
    obj = pod(unique("p"), node, template)
    obj["spec"]["schedulingGates"] = [{"name": SCHEDULING_GATE}]
    return obj


class Round:
    """One round's objects on the node, created and removed through the API."""

    def __init__(self, client: kubernetes.client.ApiClient, node: str) -> None:
        self.core = kubernetes.client.CoreV1Api(client)
        self.apps = kubernetes.client.AppsV1Api(client)
        self.resource = kubernetes.client.ResourceV1Api(client)
        self.client, self.node = client, node

    def running(self, name: str) -> bool:
        try:
            return self.core.read_namespaced_pod(name, NS).status.phase == "Running"
        except kubernetes.client.ApiException as err:
            if err.status == 404:
                return False
            raise

    def start(self, obj: dict[str, Any]) -> str:
        kubernetes.utils.create_from_dict(self.client, obj, namespace=NS)
        return obj["metadata"]["name"]

    def claim_of(self, pod_name: str) -> str:
        def named() -> str | None:
            statuses = self.core.read_namespaced_pod(pod_name, NS).status.resource_claim_statuses or []
            return statuses[0].resource_claim_name if statuses else None

        return wait_until(f"the claim of {pod_name}", named)

    def app_pods(self, app: str) -> list[Any]:
        return self.core.list_namespaced_pod(NS, label_selector=f"app={app}").items

    def fragment(self) -> tuple[str, str]:
        """GPU 0: a pod that stays and (for a while) one that fills it; GPU 1: the movable pod.
        Returns the pod that stays and the Deployment's name."""
        anchor = self.start(gated_pod(self.node, "anchor"))
        filler = self.start(gated_pod(self.node, "filler"))
        wait_until("GPU 0 filled", lambda: self.running(anchor) and self.running(filler))
        app = unique("infer")
        spec = deployment(app, self.node, "small", replicas=1)
        template = spec["spec"]["template"]
        template["metadata"]["annotations"] = {MOVABLE_ANNOTATION: "true"}
        template["spec"]["schedulingGates"] = [{"name": SCHEDULING_GATE}]
        self.start(spec)
        wait_until("the movable pod runs", lambda: any(p.status.phase == "Running" for p in self.app_pods(app)))
        self.core.delete_namespaced_pod(filler, NS, grace_period_seconds=0)
        wait_until("the filler is gone", lambda: not self.running(filler) and not self._pods_named(filler))
        return anchor, app

    def _pods_named(self, name: str) -> list[Any]:
        return [p for p in self.core.list_namespaced_pod(NS).items if p.metadata.name == name]

    def measure(self) -> dict[str, float]:
        """Seconds from the whole-GPU pod's creation to each step."""
        anchor, app = self.fragment()
        (victim,) = self.app_pods(app)
        victim_claim = self.claim_of(victim.metadata.name)
        started = time.monotonic()
        pending = self.start(gated_pod(self.node, "whole"))
        seen: dict[str, float] = {}
        while "running" not in seen:
            assert time.monotonic() - started < 120, f"the whole-GPU pod did not run: {seen}"
            now = time.monotonic() - started
            if "evicted" not in seen and self._evicted(victim.metadata.name):
                seen["evicted"] = now
            if "victim_claim_gone" not in seen and not self._claim_exists(victim_claim):
                seen["victim_claim_gone"] = now
            if "allocated" not in seen and self._allocated(pending):
                seen["allocated"] = now
            if self.running(pending):
                seen["running"] = now
            time.sleep(0.05)
        for name in (pending, anchor):
            self.core.delete_namespaced_pod(name, NS, grace_period_seconds=0)
        self.apps.delete_namespaced_deployment(app, NS, propagation_policy="Foreground")
        wait_until("the round's pods gone", lambda: not self.core.list_namespaced_pod(NS).items, timeout_s=120)
        wait_until("the round's claims gone", lambda: not self.resource.list_namespaced_resource_claim(NS).items)
        return seen

    def _evicted(self, name: str) -> bool:
        selector = f"involvedObject.name={name},reason=EvictedToMakeRoom"
        return bool(self.core.list_namespaced_event(NS, field_selector=selector).items)

    def _claim_exists(self, name: str) -> bool:
        try:
            self.resource.read_namespaced_resource_claim(name, NS)
        except kubernetes.client.ApiException as err:
            if err.status == 404:
                return False
            raise
        return True

    def _allocated(self, pod_name: str) -> bool:
        statuses = self.core.read_namespaced_pod(pod_name, NS).status.resource_claim_statuses or []
        if not statuses:
            return False
        claim = self.resource.read_namespaced_resource_claim(statuses[0].resource_claim_name, NS)
        return bool(claim.status and claim.status.allocation)


def summary(rounds: list[dict[str, float]]) -> dict[str, Any]:
    def stats(values: list[float]) -> dict[str, float]:
        return {"mean": round(statistics.mean(values), 2), "max": round(max(values), 2)}

    steps = {step: stats([r[step] for r in rounds]) for step in STEPS}
    waits = {
        "creation_to_eviction": stats([r["evicted"] for r in rounds]),
        "eviction_to_victim_claim_gone": stats([r["victim_claim_gone"] - r["evicted"] for r in rounds]),
        "victim_claim_gone_to_allocated": stats([r["allocated"] - r["victim_claim_gone"] for r in rounds]),
        "allocated_to_running": stats([r["running"] - r["allocated"] for r in rounds]),
    }
    return {"rounds": len(rounds), "seconds_from_creation": steps, "steps": waits}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with local_cluster(purpose="bench-") as local:
        for template in templates():
            kubernetes.utils.create_from_dict(local.client, template, namespace=NS)
        argv = [sys.executable, "-m", "driver.cli", "controller", f"--kubeconfig={local.cluster.kubeconfig}"]
        argv += [
            "--lease-namespace=default",
            "--make-room",
            "--evictions-per-minute=60",
            f"--metrics-port={free_port()}",
        ]
        controller = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
        try:
            bench = Round(local.client, local.node.name)
            rounds = [bench.measure() for _ in range(args.rounds)]
        finally:
            controller.terminate()
            controller.wait(timeout=15)
    print(json.dumps(summary(rounds), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
