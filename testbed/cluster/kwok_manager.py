"""kwok (sigs.k8s.io/kwok, built by build.sh) against the test control plane: nodes without a
kubelet, for fleets. kwok keeps the nodes it manages Ready (their status and Lease) and plays the
pods kube-scheduler binds to them (Running, then Succeeded or deleted) with the stages copied from
its module (kwok-config/: node-initialize, node-heartbeat-with-lease, pod-ready, pod-complete,
pod-delete).

Its nodes carry kwok's annotation (what it manages), a taint that keeps every other test's pods
off them, and fgpu's machine label, for `fgpu simulate-fleet` to publish their devices. Nothing is
prepared there: kwok runs no container."""

from __future__ import annotations

import contextlib
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes

from driver.fleet.machine_types import MACHINE_LABEL, OFFER_ANNOTATION
from testbed.cluster.harness import Cluster, check_alive, free_port, node_object, poll_until, spawn, stop_process

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_TAINT = {"key": KWOK_ANNOTATION, "value": "fake", "effect": "NoSchedule"}
KWOK_TOLERATION = {"key": KWOK_ANNOTATION, "operator": "Exists", "effect": "NoSchedule"}
# What a pod meant for the fleet's nodes carries: it tolerates kwok's taint and goes only to nodes
# with a machine type (kwok's or Karpenter's), never to a fake node another test left with slices.
ON_FLEET_NODES: dict[str, Any] = {
    "tolerations": [KWOK_TOLERATION],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": MACHINE_LABEL, "operator": "Exists"}]}]}}},
}  # fmt: skip
START_TIMEOUT_S = 60
CREATORS = 8  # concurrent node writes


def kwok_node(name: str, machine: str, offer: str | None, taints: list[dict[str, str]]) -> dict[str, Any]:
    """A Node kwok manages, of this machine type."""
    body = node_object(name, {MACHINE_LABEL: machine, "type": "kwok"})
    body["metadata"]["annotations"] = {KWOK_ANNOTATION: "fake", **({OFFER_ANNOTATION: offer} if offer else {})}
    body["spec"] = {"taints": taints}
    del body["status"]  # kwok writes it (node-initialize), as a kubelet would
    return body


@dataclass
class Kwok:
    cluster: Cluster
    workdir: Path
    lease_s: int = 40  # kwok renews each node's Lease every quarter of it: longer for thousands of nodes
    nodes: list[str] = field(default_factory=list)  # the nodes this test bed created, deleted at stop
    _process: Any = None

    def start(self) -> Kwok:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> Kwok:
        assert self.cluster.binaries is not None and self.cluster.kubeconfig is not None
        self.workdir.mkdir(parents=True, exist_ok=True)
        stages = sorted((self.cluster.binaries / "kwok-config").glob("*.yaml"))
        port = free_port()
        argv = [str(self.cluster.binaries / "kwok"), f"--kubeconfig={self.cluster.kubeconfig}",
                f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
                f"--node-lease-duration-seconds={self.lease_s}", "--cidr=10.64.0.0/12",
                f"--server-address=127.0.0.1:{port}",
                *(f"--config={stage}" for stage in stages)]  # fmt: skip
        self._process = spawn(argv, self.workdir / "kwok.log")
        poll_until("kwok", lambda: _answers(f"http://127.0.0.1:{port}/readyz"), START_TIMEOUT_S, self._alive)
        return self

    def _alive(self) -> None:
        check_alive({"kwok": self._process}, self.workdir)

    def add_nodes(self, names: list[str], machine: str, offer: str | None = None, tainted: bool = True) -> None:
        """Create the nodes (`tainted`: with kwok's taint, which only pods that tolerate it pass)
        and wait until kwok reports them Ready."""
        core = kubernetes.client.CoreV1Api(self.cluster.api_client())
        taints = [KWOK_TAINT] if tainted else []

        def create(name: str) -> None:
            core.create_node(kwok_node(name, machine, offer, taints), _preload_content=False)

        with ThreadPoolExecutor(CREATORS) as creators:
            list(creators.map(create, names))
            self.nodes += names
            wanted = set(names)

            def ready() -> bool:
                listed = core.list_node(label_selector="type=kwok", _preload_content=False)
                return wanted <= {n["metadata"]["name"] for n in json.loads(listed.data)["items"] if _ready(n)}

            # Listed less often the more there are: at 5,000 a list is megabytes.
            interval = min(5.0, 0.2 + len(names) / 1000)
            poll_until(
                f"{len(names)} kwok node(s) Ready", ready, START_TIMEOUT_S + len(names) / 50, self._alive, interval
            )
            # The TaintNodesByCondition admission plugin tainted them not-ready; the node lifecycle
            # controller that lifts it once the node is Ready is off in the test bed (harness.py).
            body = {"spec": {"taints": taints or None}}
            list(creators.map(lambda name: core.patch_node(name, body, _preload_content=False), names))

    def delete_node(self, name: str) -> None:
        core = kubernetes.client.CoreV1Api(self.cluster.api_client())
        core.delete_node(name)
        self.nodes.remove(name)

    def stop(self) -> None:
        core = kubernetes.client.CoreV1Api(self.cluster.api_client())

        def delete(name: str) -> None:
            with contextlib.suppress(kubernetes.client.ApiException):
                core.delete_node(name, _preload_content=False)

        with ThreadPoolExecutor(CREATORS) as deleters:
            list(deleters.map(delete, self.nodes))
        self.nodes.clear()
        if self._process is not None:
            stop_process(self._process)
            self._process = None


def _answers(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as response:
        return response.status == 200


def _ready(node: dict[str, Any]) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True" for c in (node.get("status") or {}).get("conditions") or []
    )
