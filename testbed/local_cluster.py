"""A whole local cluster for `make run` and the benchmarks: the test control plane with fgpu's
DeviceClasses, a real node, and `fgpu kubelet-plugin` registered with its kubelet. Taken down in
the order that leaves the machine as it was: pods first (the plugin still there to unprepare their
claims), then the plugin and what it leaves by design (MPS daemons, their tmpfs), then the rest."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import kubernetes
import yaml

from testbed.cluster.harness import Cluster
from testbed.cluster.host_state import short_temp_dir
from testbed.cluster.node import RealNode
from testbed.node_plugin import NodePlugin

DEVICE_CLASSES = Path(__file__).resolve().parents[1] / "daemonset" / "deviceclasses.yaml"


@dataclass(frozen=True)
class LocalCluster:
    cluster: Cluster
    client: kubernetes.client.ApiClient
    node: RealNode
    plugin: NodePlugin


@contextmanager
def local_cluster(nvml: str = "mock:dgx-h100", purpose: str = "run-") -> Iterator[LocalCluster]:
    workdir = short_temp_dir(purpose)
    cluster = Cluster(workdir / "cluster")
    node = plugin = None
    try:
        cluster.start()
        client = cluster.api_client()
        for document in yaml.safe_load_all(DEVICE_CLASSES.read_text()):
            kubernetes.utils.create_from_dict(client, document)
        node = RealNode(cluster).start()
        plugin = NodePlugin.on(node, nvml=nvml).start_registered()
        yield LocalCluster(cluster, client, node, plugin)
    finally:
        if node:
            node.stop()
        if plugin:
            plugin.remove()
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
