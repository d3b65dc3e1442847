"""Karpenter (sigs.k8s.io/karpenter, its kwok cloud provider, built by build.sh from
testbed/cluster/karpenter/) against the test control plane, as a process on the host: DRA on
(--ignore-dra-requests=false), its CRDs and a KWOKNodeClass installed, a NodePool per GPU node type.

Each instance type is one of fgpu's bundled machines: its CPU and memory in kwok's instance types
file, its devices from `fgpu slice-template --format karpenter` (one <instance type>.json per type:
what our wrapper of kwok's provider gives Karpenter as the type's DynamicResources), and fgpu's
machine label (and offer annotation) on its nodes, which `fgpu simulate-fleet` publishes the slices
for. The test bed's kwok (kwok_manager.Kwok) runs Karpenter's nodes: they carry kwok's annotation.

Karpenter's nodes carry kwok's taint (NodePool taints), so only pods that tolerate it, this test
bed's fleet pods, make it add nodes: other tests' pending pods do not."""

from __future__ import annotations

import contextlib
import datetime
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
import yaml

from driver.fleet.machine_types import MACHINE_LABEL, OFFER_ANNOTATION
from testbed.cluster.harness import Cluster, free_port, poll_until, spawn, stop_process
from testbed.cluster.host_manager import AppliedObjects, exited_check, wait_established, wait_ready
from testbed.cluster.kwok_manager import KWOK_TAINT

KARPENTER_GROUP = "karpenter.sh"
NODE_CLASS_GROUP = "karpenter.kwok.sh"
NODE_CLASS = "fgpu"
ZONE = "test-zone-a"
START_TIMEOUT_S = 90
STOP_TIMEOUT_S = 90
PROVIDER_PREFIX = "kwok://"


@dataclass(frozen=True)
class InstanceType:
    """A node type Karpenter may launch: one of fgpu's bundled machines with an offer."""

    name: str  # Karpenter's instance type (the node's node.kubernetes.io/instance-type)
    machine: str  # a bundled machine profile (driver/nvml/machines)
    cpu: str
    memory: str
    price: float  # per hour: Karpenter launches the cheapest type that fits
    offer: str | None = None  # the GPUs' kinds, as --offer; None: fgpu's default

    def kwok_entry(self) -> dict[str, Any]:
        """Its entry in kwok's instance types file, with the node metadata our wrapper reads."""
        requirements = [
            {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]},
            {"key": "topology.kubernetes.io/zone", "operator": "In", "values": [ZONE]},
        ]
        return {
            "name": self.name,
            "offerings": [{"Price": self.price, "Available": True, "Requirements": requirements}],
            "architecture": "amd64",
            "operatingSystems": ["linux"],
            "resources": {"cpu": self.cpu, "memory": self.memory, "pods": "110", "ephemeral-storage": "1Ti"},
            "labels": {MACHINE_LABEL: self.machine},
            "annotations": {OFFER_ANNOTATION: self.offer} if self.offer else {},
        }


# What the machines' boards hold besides GPUs (DGX H100: 2 x 56-core Xeon, 2 TiB; an L4 server).
DGX_H100 = InstanceType("dgx-h100", "dgx-h100", cpu="224", memory="2Ti", price=98.0)
L4X4 = InstanceType("l4x4", "l4x4", cpu="48", memory="192Gi", price=4.0)


@dataclass(frozen=True)
class NodePool:
    """A Karpenter NodePool of one GPU node type, at most `max_nodes` nodes, emptied nodes
    removed after `consolidate_after`. Karpenter tries NodePools by `weight`, highest first, then
    by name in reverse order, and takes the first whose types fit a pod. Its nodes carry kwok's
    taint, and `taint_key` (NoSchedule) where given: nodes kept for the pods that tolerate it."""

    name: str
    instance_types: tuple[str, ...]
    max_nodes: int = 2
    consolidate_after: str = "0s"
    weight: int | None = None
    taint_key: str = ""

    def body(self) -> dict[str, Any]:
        requirements = [
            {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": list(self.instance_types)},
            {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]},
        ]
        return {
            "apiVersion": f"{KARPENTER_GROUP}/v1",
            "kind": "NodePool",
            "metadata": {"name": self.name},
            "spec": {
                **({"weight": self.weight} if self.weight is not None else {}),
                "limits": {"nodes": str(self.max_nodes)},
                "disruption": {
                    "consolidationPolicy": "WhenEmptyOrUnderutilized",
                    "consolidateAfter": self.consolidate_after,
                    "budgets": [{"nodes": "100%"}],
                },
                "template": {
                    "spec": {
                        "expireAfter": "Never",
                        "taints": [KWOK_TAINT, *self._kept_for()],
                        "requirements": requirements,
                        "nodeClassRef": {"group": NODE_CLASS_GROUP, "kind": "KWOKNodeClass", "name": NODE_CLASS},
                    }
                },
            },
        }

    def _kept_for(self) -> list[dict[str, str]]:
        return [{"key": self.taint_key, "value": "true", "effect": "NoSchedule"}] if self.taint_key else []


def slice_template(instance_type: InstanceType) -> str:
    """`fgpu slice-template --format karpenter -o json` for the type's machine and offer."""
    argv = [sys.executable, "-m", "driver.cli", "slice-template", f"--machine={instance_type.machine}",
            "--format=karpenter", "-o", "json"]  # fmt: skip
    if instance_type.offer:
        argv.append(f"--offer={instance_type.offer}")
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def _crd_files(config_dir: Path) -> list[Path]:
    return sorted((config_dir / "crds").glob("*.yaml"))


@dataclass
class KarpenterManager:
    cluster: Cluster
    workdir: Path
    instance_types: tuple[InstanceType, ...] = (DGX_H100, L4X4)
    node_pools: tuple[NodePool, ...] = (NodePool("dgx-h100", ("dgx-h100",)), NodePool("l4x4", ("l4x4",)))
    batch_idle: str = "500ms"  # Karpenter waits this long for more pending pods before it launches
    # Karpenter v1.15.0 charges a shared (MPS, time-sliced) device's counters per share where
    # kube-scheduler charges them once, so it plans one share per GPU: leave them out of the
    # templates (karpenter/options.go, ShareCountersOnce).
    share_counters_once: bool = False
    process: subprocess.Popen[bytes] | None = None
    _crds: list[dict[str, Any]] = field(default_factory=list, repr=False)
    _applied: AppliedObjects | None = field(default=None, repr=False)

    def start(self) -> KarpenterManager:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> KarpenterManager:
        assert self.cluster.binaries is not None and self.cluster.kubeconfig is not None
        started = datetime.datetime.now()
        self.workdir.mkdir(parents=True, exist_ok=True)
        config_dir = self.cluster.binaries / "karpenter-config"
        applied = self._applied = AppliedObjects(self.cluster)
        self._crds = [yaml.safe_load(path.read_text()) for path in _crd_files(config_dir)]
        for crd in self._crds:
            applied.apply(crd)  # removed by stop() after the objects of their kinds, not by `applied`
        wait_established(self.cluster, [crd["metadata"]["name"] for crd in self._crds], START_TIMEOUT_S)
        instance_types_file, templates_dir = self._write_instance_types()
        metrics_port, health_port = free_port(), free_port()
        argv = [str(self.cluster.binaries / "karpenter"), "--ignore-dra-requests=false",
                "--disable-leader-election=true", f"--metrics-port={metrics_port}",
                f"--health-probe-port={health_port}", f"--instance-types-file-path={instance_types_file}",
                f"--dynamic-resources-dir={templates_dir}", "--lift-not-ready-taint=true",
                "--batch-max-duration=5s", f"--batch-idle-duration={self.batch_idle}", "--log-level=debug",
                f"--share-counters-once={str(self.share_counters_once).lower()}"]  # fmt: skip
        env = {"KUBECONFIG": str(self.cluster.kubeconfig), "PATH": "/usr/bin:/bin"}
        logs = self.workdir / "karpenter.log"
        self.process = spawn(argv, logs, env=env)
        alive = exited_check("karpenter", self.process, logs)
        wait_ready("karpenter", health_port, START_TIMEOUT_S, alive)
        applied.apply(self._node_class(), created=True)
        for pool in self.node_pools:
            applied.apply(pool.body(), created=True)
        poll_until("the NodePools Ready", self._node_pools_ready, START_TIMEOUT_S, alive)
        print(f"karpenter up in {(datetime.datetime.now() - started).total_seconds():.1f}s ({logs})")
        return self

    def _write_instance_types(self) -> tuple[Path, Path]:
        templates = self.workdir / "dynamic-resources"
        templates.mkdir(exist_ok=True)
        for instance_type in self.instance_types:
            (templates / f"{instance_type.name}.json").write_text(slice_template(instance_type))
        path = self.workdir / "instance-types.json"
        path.write_text(json.dumps([t.kwok_entry() for t in self.instance_types], indent=1))
        return path, templates

    @staticmethod
    def _node_class() -> dict[str, Any]:
        return {"apiVersion": f"{NODE_CLASS_GROUP}/v1alpha1", "kind": "KWOKNodeClass", "metadata": {"name": NODE_CLASS}}

    def _custom(self) -> kubernetes.client.CustomObjectsApi:
        return kubernetes.client.CustomObjectsApi(self.cluster.api_client())

    def _node_pools_ready(self) -> bool:
        pools = self._custom().list_cluster_custom_object(KARPENTER_GROUP, "v1", "nodepools")["items"]
        ready = {p["metadata"]["name"] for p in pools if _condition(p, "Ready") == "True"}
        return {pool.name for pool in self.node_pools} <= ready

    def node_claims(self, pool: str | None = None) -> list[dict[str, Any]]:
        selector = f"karpenter.sh/nodepool={pool}" if pool else None
        listed = self._custom().list_cluster_custom_object(KARPENTER_GROUP, "v1", "nodeclaims", label_selector=selector)
        return listed["items"]

    def stop(self) -> None:
        """NodeClaims first (Karpenter drains and removes their nodes), then the NodePools and the
        class, Karpenter, its CRDs; finalizers are taken off what Karpenter did not finish."""
        try:
            if self.process is not None and self.process.poll() is None:
                self._delete_node_claims()
            if self._applied is not None:
                with contextlib.suppress(TimeoutError):
                    self._applied.remove(STOP_TIMEOUT_S)
        finally:
            if self.process is not None:
                stop_process(self.process)
                self.process = None
            self._release_leftovers()
            self._delete_crds()

    def _delete_node_claims(self) -> None:
        custom = self._custom()
        for claim in self.node_claims():
            with contextlib.suppress(kubernetes.client.ApiException):
                custom.delete_cluster_custom_object(KARPENTER_GROUP, "v1", "nodeclaims", claim["metadata"]["name"])
        with contextlib.suppress(TimeoutError):
            poll_until("Karpenter's nodes gone", lambda: not self.node_claims() and not self._nodes(),
                       STOP_TIMEOUT_S, lambda: None, interval_s=1.0)  # fmt: skip

    def _nodes(self) -> list[Any]:
        core = kubernetes.client.CoreV1Api(self.cluster.api_client())
        return [n for n in core.list_node().items if (n.spec.provider_id or "").startswith(PROVIDER_PREFIX)]

    def _release_leftovers(self) -> None:
        """What Karpenter no longer runs to finish: its finalizers off, its nodes deleted."""
        if not self._crds:
            return
        custom, core = self._custom(), kubernetes.client.CoreV1Api(self.cluster.api_client())
        unfinalized = {"metadata": {"finalizers": None}}
        for plural in ("nodeclaims", "nodepools"):
            with contextlib.suppress(kubernetes.client.ApiException):
                for item in custom.list_cluster_custom_object(KARPENTER_GROUP, "v1", plural)["items"]:
                    name = item["metadata"]["name"]
                    custom.patch_cluster_custom_object(KARPENTER_GROUP, "v1", plural, name, unfinalized)
                    custom.delete_cluster_custom_object(KARPENTER_GROUP, "v1", plural, name)
        with contextlib.suppress(kubernetes.client.ApiException):
            custom.patch_cluster_custom_object(NODE_CLASS_GROUP, "v1alpha1", "kwoknodeclasses", NODE_CLASS, unfinalized)
        for node in self._nodes():
            with contextlib.suppress(kubernetes.client.ApiException):
                core.patch_node(node.metadata.name, unfinalized)
                core.delete_node(node.metadata.name)

    def _delete_crds(self) -> None:
        extensions = kubernetes.client.ApiextensionsV1Api(self.cluster.api_client())
        names = [crd["metadata"]["name"] for crd in self._crds]
        for name in names:
            with contextlib.suppress(kubernetes.client.ApiException):
                extensions.delete_custom_resource_definition(name)

        def gone() -> bool:
            listed = {crd.metadata.name for crd in extensions.list_custom_resource_definition().items}
            return not listed & set(names)

        with contextlib.suppress(TimeoutError):
            poll_until("Karpenter's CRDs gone", gone, STOP_TIMEOUT_S, lambda: None)
        self._crds.clear()


def _condition(obj: dict[str, Any], kind: str) -> str | None:
    for condition in (obj.get("status") or {}).get("conditions") or []:
        if condition["type"] == kind:
            return condition["status"]
    return None
