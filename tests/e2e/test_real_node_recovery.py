"""End to end on the real node: a reboot and a GPU reset under running pods (issue 26). The reboot
is a power cut (testbed/reboot.py: containers, kubelet, containerd and the plugin killed; mounts,
MIG instances, compute modes, time-slice intervals, MPS daemons and CDI specs gone; the disks
kept), then containerd, kubelet and the plugin started again: kubelet starts the pods again and
prepares their claims, which must get devices that exist, never the record of ones that do not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import kubernetes
import pytest

from driver.nvml.mock_driver_root import SMI_STATE_ENV, fake_tools_env
from driver.nvml.session import MOCK_STATE_ENV
from partitioner.mig import caps_minor
from testbed.node_plugin import NodePlugin
from testbed.reboot import reboot
from testbed.workloads import NS, claim_template, deployment, pod, report, unique, wait_until
from tests.support.cli import fgpu
from tests.support.configs import timeslice_interval
from tests.support.pools import node_slices

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]

RECONCILE_S = 60  # the plugin's --reconcile-interval default

IN_GPU3 = 'device.attributes["gpu.fgpu.dev"].index == 3 && device.attributes["gpu.fgpu.dev"].profile == "3g.40gb"'
GPU = 'device.attributes["gpu.fgpu.dev"].index == {}'
TS_LONG_CLASS = "timeslice-long.test.fgpu.dev"  # the interval is the GPU's: only a DeviceClass sets it
# Each kind on a GPU of its own: the pods are created together and kube-scheduler allocates their
# claims in any order (a share placed first on GPU 0 left the whole-GPU claim nowhere to go).
KINDS = {  # pod -> (device class, claim template arguments)
    "whole": ("gpu.fgpu.dev", {"selector": GPU.format(0)}),
    "mig": (
        "mig.gpu.fgpu.dev",
        {"selector": GPU.format(1) + ' && device.attributes["gpu.fgpu.dev"].profile == "1g.10gb"'},
    ),
    "mps": ("mps.gpu.fgpu.dev", {"selector": GPU.format(2), "capacity": {"memory": "2Gi", "compute": "10"}}),
    "ts": (TS_LONG_CLASS, {"selector": GPU.format(4), "capacity": {"memory": "2Gi"}}),
    "part-a": ("mig-mps.gpu.fgpu.dev", {"selector": IN_GPU3, "capacity": {"memory": "4Gi", "compute": "20"}}),
    "part-b": ("mig-mps.gpu.fgpu.dev", {"selector": IN_GPU3, "capacity": {"memory": "8Gi", "compute": "30"}}),
}


@pytest.fixture(autouse=True, scope="module")
def long_timeslice_class(cluster) -> Iterator[None]:
    """The devices of timeslice.gpu.fgpu.dev, time-sliced at Long (a claim's own config cannot set it)."""
    resource = kubernetes.client.ResourceV1Api(cluster.api_client())
    base = resource.read_device_class("timeslice.gpu.fgpu.dev")
    selectors = [{"cel": {"expression": s.cel.expression}} for s in base.spec.selectors]
    spec = {"selectors": selectors, "config": [timeslice_interval("Long")]}
    metadata = {"name": TS_LONG_CLASS}
    resource.create_device_class(
        {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": metadata, "spec": spec}
    )
    yield
    resource.delete_device_class(TS_LONG_CLASS)


def start_pods(cluster, core_api, workloads, node_name: str) -> dict[str, str]:
    """One pod per kind, created together; their names by kind once all run."""
    client = cluster.api_client()
    names = {}
    for kind, (device_class, arguments) in KINDS.items():
        template = claim_template(unique(f"{kind}-tpl"), device_class, **arguments)
        names[kind] = unique(kind)
        for obj in (template, pod(names[kind], node_name, template["metadata"]["name"])):
            kubernetes.utils.create_from_dict(client, obj, namespace=NS)
            workloads.append((obj["kind"], obj["metadata"]["name"]))
    wait_until("every pod running", lambda: all(running(core_api, name) for name in names.values()))
    return names


def running(core_api, name: str) -> str | None:
    """The running container's id."""
    found = core_api.read_namespaced_pod(name, NS)
    statuses = found.status.container_statuses or []
    ready = found.status.phase == "Running" and statuses and statuses[0].state.running
    return statuses[0].container_id if ready else None


def all_back(core_api, names: dict[str, str], containers: dict[str, str | None]) -> bool:
    """Every pod running in a container other than the one it ran in before."""
    return all(running(core_api, name) not in (None, containers[kind]) for kind, name in names.items())


def failed_prepare(core_api, name: str) -> bool:
    """Kubelet reported that it could not prepare the pod's claims."""
    selector = f"involvedObject.name={name},reason=FailedPrepareDynamicResources"
    return bool(core_api.list_namespaced_event(NS, field_selector=selector).items)


def claim_of(resource_api, pod_name: str):
    claims = resource_api.list_namespaced_resource_claim(NS).items
    return next(c for c in claims if any(r.name == pod_name for r in c.status.reserved_for or []))


def mig_status(resource_api, pod_name: str) -> dict:
    return claim_of(resource_api, pod_name).status.devices[0].data["mig"]


def caps_of(gpu: int, gi: int, ci: int) -> set[str]:
    return {f"/dev/nvidia-caps/nvidia-cap{caps_minor(gpu, gi, c, Path('/nonexistent'))}" for c in (None, ci)}


def checkpoint(plugin: NodePlugin) -> dict:
    return json.loads((plugin.state_dir / "checkpoint.json").read_text())["claims"]


def no_orphans(plugin: NodePlugin) -> None:
    """The sweeps' invariant: MIG instances, CDI specs and MPS daemons are those of prepared claims."""
    claims = checkpoint(plugin)
    owned = {
        (d["gpu_index"], d["mig_profile_id"], d["mig_start"]) for c in claims.values() for d in c["devices"]
        if d["mig_profile_id"] is not None
    }  # fmt: skip
    gpus = plugin.gpus()
    try:
        existing = {(i, r.profile_id, r.start) for i in range(gpus.gpu_count()) for r in gpus.gpu_instances(i)}
    finally:
        gpus.close()
    assert existing == owned
    assert {p.name.split("_", 1)[1].removesuffix(".json") for p in plugin.cdi_dir.glob("*.json")} == set(claims)


def test_a_reboot_brings_every_pod_back_with_devices_that_exist(
    cluster, core_api, resource_api, real_node, node_plugin, workloads
):
    names = start_pods(cluster, core_api, workloads, real_node.name)
    containers = {kind: running(core_api, name) for kind, name in names.items()}
    before = mig_status(resource_api, names["mig"])
    partition_before = mig_status(resource_api, names["part-a"])

    reboot(real_node, node_plugin)

    wait_until("every pod running again in a new container", lambda: all_back(core_api, names, containers), 180)
    seen = {kind: report(core_api, name) for kind, name in names.items()}

    # MIG 1g: a new instance at the same placement, its UUID and ids in the claim's status, and
    # the container has that instance's capabilities, not the ids of the one before the reboot.
    after = mig_status(resource_api, names["mig"])
    assert after["uuid"] != before["uuid"] and after["placement"] == before["placement"]
    gpu = claim_of(resource_api, names["mig"]).status.devices[0].data["gpuIndex"]
    gpus = node_plugin.gpus()
    try:
        [instance] = [r for r in gpus.gpu_instances(gpu) if r.start == before["placement"]["start"]]
    finally:
        gpus.close()
    assert (instance.gi_id, instance.compute_instances[0][1]) == (after["gpuInstanceID"], after["uuid"])
    caps = {path for path in seen["mig"].devices if "nvidia-caps" in path}
    assert caps == caps_of(gpu, after["gpuInstanceID"], after["computeInstanceID"])

    # The time-sliced share's interval is set again; the MPS shares have their daemons and limits.
    smi = json.loads(Path(fake_tools_env(node_plugin.state_dir)[SMI_STATE_ENV]).read_text())
    ts_gpu = claim_of(resource_api, names["ts"]).status.devices[0].data["gpuUUID"]
    assert smi[ts_gpu]["timeslice"] == 3
    assert seen["mps"].env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"
    partition = mig_status(resource_api, names["part-a"])
    assert partition["uuid"] != partition_before["uuid"]
    assert mig_status(resource_api, names["part-b"])["uuid"] == partition["uuid"]
    assert seen["part-a"].devices == seen["part-b"].devices  # one partition, both shares
    assert any(name.startswith("cuda.shm") for name in seen["part-a"].shm & seen["part-b"].shm)
    assert (node_plugin.state_dir / "mps" / partition["uuid"] / "pipe" / "nvidia-cuda-mps-control.pid").exists()
    assert not (node_plugin.state_dir / "mps" / partition_before["uuid"]).exists()
    no_orphans(node_plugin)


def test_a_reboot_with_the_plugin_late_brings_the_pods_back_once_it_registers(
    cluster, core_api, resource_api, real_node, node_plugin, workloads
):
    """A DaemonSet's pod may start after kubelet has tried its pods' claims again: those prepares
    fail (no gpu.fgpu.dev registered), and kubelet tries each again at its next sync of the pod,
    once the plugin is there (the plugin starts here only once kubelet reported a failure for
    every pod)."""
    names = start_pods(cluster, core_api, workloads, real_node.name)
    containers = {kind: running(core_api, name) for kind, name in names.items()}
    assert not any(failed_prepare(core_api, name) for name in names.values())

    def kubelet_tried_every_pod() -> bool:
        return all(failed_prepare(core_api, name) for name in names.values())

    reboot(
        real_node,
        node_plugin,
        before_plugin=lambda: wait_until("kubelet failing to prepare every pod's claims", kubelet_tried_every_pod),
    )

    wait_until("every pod running again in a new container", lambda: all_back(core_api, names, containers), 240)
    no_orphans(node_plugin)


def test_an_admins_gpu_reset_under_a_running_mig_pod_makes_its_instance_again(
    cluster, core_api, resource_api, real_node, node_plugin, workloads
):
    """`nvidia-smi -r` (here `fgpu mock fault --gpu I reset`) of a healthy GPU: no NVML event says
    so; the plugin's reconciler pass finds the claim's MIG instance gone and makes it again at its
    placement (the container's processes died with the reset; its owner restarts it, and a new
    container gets the new instance)."""
    client = cluster.api_client()
    template = claim_template(unique("tpl"), "mig.gpu.fgpu.dev",
                              selector='device.attributes["gpu.fgpu.dev"].profile == "2g.20gb"')  # fmt: skip
    name = unique("mig")
    for obj in (template, pod(name, real_node.name, template["metadata"]["name"])):
        kubernetes.utils.create_from_dict(client, obj, namespace=NS)
        workloads.append((obj["kind"], obj["metadata"]["name"]))
    wait_until("the pod running", lambda: running(core_api, name))
    before = mig_status(resource_api, name)
    gpu = claim_of(resource_api, name).status.devices[0].data["gpuIndex"]
    env = {**os.environ, MOCK_STATE_ENV: str(node_plugin.mock_state)}
    argv = [sys.executable, "-m", "driver.cli", "mock", "fault", f"--nvml={node_plugin.nvml}", f"--gpu={gpu}", "reset"]
    done = subprocess.run([*argv, f"--state-dir={node_plugin.state_dir}"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr

    def made_again() -> bool:
        return mig_status(resource_api, name)["uuid"] != before["uuid"]

    wait_until("the claim's status naming a new instance (a reconciler pass)", made_again, timeout_s=RECONCILE_S + 30)
    after = mig_status(resource_api, name)
    assert after["placement"] == before["placement"]
    spec = next(node_plugin.cdi_dir.glob(f"*{claim_of(resource_api, name).metadata.uid}*")).read_text()
    assert all(path in spec for path in caps_of(gpu, after["gpuInstanceID"], after["computeInstanceID"]))
    assert "a prepared claim's MIG instance is gone (a GPU reset)" in node_plugin.logs()
    no_orphans(node_plugin)


NEW_DRIVER = "580.105.08"


def test_the_driver_gone_and_back_under_a_running_deployment(
    cluster, core_api, resource_api, real_node, node_plugin, workloads
):
    """An NVIDIA driver upgrade as the GPU operator's driver container does it (`fgpu mock driver
    unload`, then `load --version`), under a pod that holds a MIG 1g device but runs nothing on it
    (a process on the GPU would keep the driver loaded). While no driver answers, every device is
    tainted NoExecute (`gpu.fgpu.dev/unreachable=driver-not-loaded`): kube-controller-manager
    evicts the pod, kubelet unprepares its claim (what it held went with the driver) and the
    replacement's claim is not allocated. Once the new driver answers, the taints go, the new
    version is published, and the replacement runs on a MIG instance that exists."""
    client = cluster.api_client()
    template = claim_template(unique("tpl"), "mig.gpu.fgpu.dev",
                              selector='device.attributes["gpu.fgpu.dev"].profile == "1g.10gb"')  # fmt: skip
    name = unique("upgrade")
    for obj in (template, deployment(name, real_node.name, template["metadata"]["name"], replicas=1)):
        kubernetes.utils.create_from_dict(client, obj, namespace=NS)
        workloads.append((obj["kind"], obj["metadata"]["name"]))
    (first,) = wait_until("the replica running", lambda: replicas(core_api, name, running_only=True))
    first_claim = claim_of(resource_api, first).metadata.uid
    env = {MOCK_STATE_ENV: str(node_plugin.mock_state), "NVML": node_plugin.nvml}

    fgpu("mock", "driver", "unload", "--state-dir", str(node_plugin.state_dir), env=env)
    wait_until("every device tainted", lambda: driver_tainted(resource_api, real_node.name))
    wait_until("the replica evicted", lambda: first not in replicas(core_api, name))
    wait_until("its claim unprepared", lambda: first_claim not in checkpoint(node_plugin))
    (second,) = wait_until("the replacement created", lambda: replicas(core_api, name))
    wait_until("kube-scheduler finding no device for it", lambda: failed_scheduling(core_api, second))
    assert not allocated(resource_api, second)

    fgpu("mock", "driver", "load", "--version", NEW_DRIVER, env=env)
    wait_until("the replacement running", lambda: running(core_api, second), timeout_s=120)
    assert not driver_tainted(resource_api, real_node.name)
    assert driver_versions(resource_api, real_node.name) == {"580.105.8"}
    status = mig_status(resource_api, second)
    caps = {path for path in report(core_api, second).devices if "nvidia-caps" in path}
    gpu = claim_of(resource_api, second).status.devices[0].data["gpuIndex"]
    assert caps == caps_of(gpu, status["gpuInstanceID"], status["computeInstanceID"])
    no_orphans(node_plugin)  # the evicted replica's instance is not made again by the new driver


def replicas(core_api, deployment_name: str, running_only: bool = False) -> list[str]:
    """The Deployment's pods that are not being deleted (each Running, if asked)."""
    pods = core_api.list_namespaced_pod(NS, label_selector=f"app={deployment_name}").items
    live = [p.metadata.name for p in pods if p.metadata.deletion_timestamp is None]
    return [n for n in live if running(core_api, n)] if running_only else live


def failed_scheduling(core_api, name: str) -> bool:
    selector = f"involvedObject.name={name},reason=FailedScheduling"
    return bool(core_api.list_namespaced_event(NS, field_selector=selector).items)


def allocated(resource_api, pod_name: str) -> bool:
    claims = resource_api.list_namespaced_resource_claim(NS).items
    return any(c.metadata.name.startswith(f"{pod_name}-") and c.status and c.status.allocation for c in claims)


def node_devices(resource_api, node: str) -> list:
    return [d for s in node_slices(resource_api, node) for d in s.spec.devices or []]


def driver_tainted(resource_api, node: str) -> bool:
    """Every device of the node carries the driver-not-loaded taint."""
    devices = node_devices(resource_api, node)
    return bool(devices) and all(
        any(t.key == "gpu.fgpu.dev/unreachable" and t.value == "driver-not-loaded" for t in d.taints or [])
        for d in devices
    )


def driver_versions(resource_api, node: str) -> set[str]:
    return {d.attributes["driverVersion"].version for d in node_devices(resource_api, node)}
