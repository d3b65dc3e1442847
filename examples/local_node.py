"""A local fgpu node: the real control plane (tests/cluster), `fgpu kubelet-plugin` on mock GPUs
(or real NVML), and a kubelet stand-in. Applies examples/pod-one-gpu.yaml, shows what the pod got,
then serves until Ctrl-C so you can `kubectl --kubeconfig ... apply` your own claims.

  python -m examples.local_node [--nvml mock:hgx-h200] [--once]
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import time
from pathlib import Path

import kubernetes
import yaml

from driver.nvml.session import MOCK_STATE_ENV
from tests.cluster.harness import Cluster
from tests.cluster.kubelet_standin import KubeletStandIn
from tests.node_env import fake_tools_env, stop_fake_daemons
from tests.plugin_process import PluginUnderTest, short_tempdir

ROOT = Path(__file__).resolve().parents[1]
NODE = "node-0"


def apply_file(client: kubernetes.client.ApiClient, path: Path) -> None:
    for document in yaml.safe_load_all(path.read_text()):
        kubernetes.utils.create_from_dict(client, document, namespace="default")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nvml", default="mock:dgx-h100")
    parser.add_argument("--once", action="store_true", help="exit after the example pod ran")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # clean up on SIGTERM as on Ctrl-C
    logging.getLogger("kubernetes").setLevel(logging.WARNING)

    workdir = short_tempdir()
    cluster = Cluster(workdir / "cluster").start()
    plugin = kubelet = None
    try:
        cluster.add_node(NODE, labels={"nvidia.com/gpu.present": "true"})
        client = cluster.api_client()
        apply_file(client, ROOT / "daemonset" / "deviceclasses.yaml")
        plugin = PluginUnderTest(node=NODE, kubeconfig=str(cluster.kubeconfig), root=workdir, nvml=args.nvml)
        if args.nvml.startswith("mock:"):  # mock GPUs get the fake nvidia-smi and MPS control too
            plugin.extra_env = {**fake_tools_env(workdir), MOCK_STATE_ENV: str(workdir / "gpus.json")}
        plugin.start()
        kubelet = KubeletStandIn(NODE, str(cluster.kubeconfig), plugin.registrar_dir).start()
        apply_file(client, ROOT / "examples" / "pod-one-gpu.yaml")
        core = kubernetes.client.CoreV1Api(client)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and core.read_namespaced_pod("cuda-job", "default").status.phase != "Running":
            time.sleep(0.5)
        pod = core.read_namespaced_pod("cuda-job", "default")
        print(f"\npod cuda-job: {pod.status.phase} on {pod.spec.node_name}")
        for prepared in kubelet.prepared.values():
            print(f"  CDI devices: {', '.join(prepared.cdi_ids)}")
        for spec in sorted(plugin.cdi_dir.glob("*.json")):
            print(f"  CDI spec {spec}:\n{json.dumps(json.loads(spec.read_text()), indent=2)}")
        print(f"\nkubeconfig: {cluster.kubeconfig}\nplugin log: {plugin.log_path}")
        if not args.once:
            print("serving; Ctrl-C to stop")
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if kubelet:
            kubelet.stop()
        if plugin:
            plugin.stop()
        cluster.stop()
        stop_fake_daemons(workdir)


if __name__ == "__main__":
    main()
