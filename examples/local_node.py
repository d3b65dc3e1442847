"""A local fgpu cluster on this machine: the real control plane and a real node (kubelet and
containerd from upstream, testbed/cluster), `fgpu kubelet-plugin` on mock GPUs (or real NVML)
registered with that kubelet, and example pods that really run. Prints what their containers see,
then serves until Ctrl-C, after which the machine is as it was (killed instead: `python -m
testbed.cluster.node cleanup` puts it back). Needs root (kubelet and containerd manage cgroups,
mounts and network namespaces).

  python -m examples.local_node [--nvml mock:hgx-h200] [--once]
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import uuid

import kubernetes

from driver.nvml.machine import MachineProfileError
from driver.nvml.session import NvmlSession, NvmlUnavailableError
from testbed.cluster.host_state import RUN_MARKER
from testbed.cluster.node import RealNode
from testbed.local_cluster import local_cluster
from testbed.workloads import claim_template, pod, report, wait_running, wait_until

NEEDS_ROOT = "make run needs root: kubelet and containerd manage cgroups, mounts and network namespaces"
EXAMPLES = {
    "whole-gpu": ("gpu.fgpu.dev", {}),
    "mig-1g": ("mig.gpu.fgpu.dev", {"selector": 'device.attributes["gpu.fgpu.dev"].profile == "1g.10gb"'}),
    "mps-share": ("mps.gpu.fgpu.dev", {"capacity": {"memory": "10Gi", "compute": "25"}}),
    "timeslice-share": ("timeslice.gpu.fgpu.dev", {"capacity": {"memory": "4Gi"}}),
}
SHOWN_ENV = ("NVIDIA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
             "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")  # fmt: skip


def run_examples(client: kubernetes.client.ApiClient, node: RealNode) -> None:
    core = kubernetes.client.CoreV1Api(client)
    for name, (device_class, args) in EXAMPLES.items():
        kubernetes.utils.create_from_dict(client, claim_template(name, device_class, **args), namespace="default")
        kubernetes.utils.create_from_dict(client, pod(name, node.name, name), namespace="default")
    for name in EXAMPLES:
        running = wait_running(core, name)
        seen = report(core, name)
        print(f"\npod {name}: {running.status.phase} on {running.spec.node_name}")
        print(f"  devices: {', '.join(f'{path} ({kind})' for path, kind in sorted(seen.devices.items()))}")
        for key in SHOWN_ENV:
            if key in seen.env:
                print(f"  env {key}={seen.env[key]}")
        gpu_mounts = sorted(m for m in seen.mounts if "nvidia" in m or m in ("/dev/shm", "/tmp/nvidia-mps"))
        print(f"  mounts: {', '.join(gpu_mounts)}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nvml", default="mock:dgx-h100")
    parser.add_argument("--once", action="store_true", help="exit after the example pods ran")
    args = parser.parse_args()
    try:  # the plugin's own message, before minutes of starting a control plane it would not join
        NvmlSession.open(args.nvml).close()
    except (MachineProfileError, NvmlUnavailableError) as err:
        print(f"fgpu: {err}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print(NEEDS_ROOT, file=sys.stderr)
        return 1
    # Its temp dirs and processes named after this run: `python -m testbed.cluster.node cleanup`
    # removes exactly them if it is killed.
    os.environ.setdefault(RUN_MARKER, uuid.uuid4().hex)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # clean up on SIGTERM as on Ctrl-C
    logging.getLogger("kubernetes").setLevel(logging.WARNING)

    try:
        with local_cluster(args.nvml) as local:
            resource = kubernetes.client.ResourceV1Api(local.client)
            wait_until("the node's ResourceSlices", lambda: resource.list_resource_slice().items)
            run_examples(local.client, local.node)
            kubeconfig, plugin_log = local.cluster.kubeconfig, local.plugin.log_path
            print(f"\nexport KUBECONFIG={kubeconfig}\nplugin log: {plugin_log}\nnode logs: {local.node.logs}")
            if not args.once:
                print("serving; Ctrl-C to stop")
                while True:
                    time.sleep(3600)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
