"""End to end on the real node: kube-scheduler allocates, kubelet (from upstream) calls our plugin
through its plugin watcher and DRA gRPC, containerd applies our CDI specs, and each test asserts
what the container itself sees (env, device nodes, mounts, /dev/shm), read through the apiserver's
logs and exec endpoints."""

from __future__ import annotations

import os
import shutil
import signal
import uuid

import kubernetes
import pytest
from grpc_health.v1 import health_pb2
from kubernetes.stream import stream

from bench import pod_start
from driver.common.testhooks import STALL_ENV, STALL_SECONDS_ENV
from testbed.cluster.node import RealNode
from testbed.node_plugin import NodePlugin
from testbed.workloads import (
    NS,
    claim_template,
    delete_namespace,
    deployment,
    pod,
    pod_events,
    report,
    unique,
    wait_running,
    wait_until,
)
from tests.support.pools import complete_pool

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]

MOCK_NODE = "c 1:3"  # mock GPUs' device nodes come from /dev/null (see driver/node/cdi.py)


def create(cluster, created: list, *objects: dict) -> None:
    client = cluster.api_client()
    for obj in objects:
        kubernetes.utils.create_from_dict(client, obj, namespace=NS)
        created.append((obj["kind"], obj["metadata"]["name"]))


def claim_of(resource_api, pod_name: str) -> kubernetes.client.V1ResourceClaim:
    claims = resource_api.list_namespaced_resource_claim(NS).items
    return next(c for c in claims if any(r.name == pod_name for r in c.status.reserved_for or []))


def run_pod(cluster, core_api, workloads, node: RealNode, device_class: str, **template_args) -> str:
    template = claim_template(unique("tpl"), device_class, **template_args)
    name = unique("pod")
    create(cluster, workloads, template, pod(name, node.name, template["metadata"]["name"]))
    wait_running(core_api, name)
    return name


def test_whole_gpu(cluster, core_api, resource_api, real_node, node_plugin, workloads):
    name = run_pod(cluster, core_api, workloads, real_node, "gpu.fgpu.dev")
    seen = report(core_api, name)
    allocated = claim_of(resource_api, name).status.allocation.devices.results
    assert len(allocated) == 1 and allocated[0].device.startswith("gpu-")
    index = allocated[0].device.removeprefix("gpu-")
    assert seen.devices.get(f"/dev/nvidia{index}") == MOCK_NODE
    assert seen.devices.get("/dev/nvidiactl") == MOCK_NODE
    assert seen.env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert "/usr/bin/nvidia-smi" in seen.mounts  # the driver root's tools, bind-mounted
    assert any("libnvidia-ml.so" in m for m in seen.mounts)
    # kubectl exec reaches the same container through kubelet and containerd's stream server.
    listing = stream(core_api.connect_get_namespaced_pod_exec, name, NS, command=["ls", "/dev"],
                     stderr=True, stdin=False, stdout=True, tty=False)  # fmt: skip
    assert f"nvidia{index}" in listing.split()


def test_an_unchanged_pod_asking_for_nvidia_com_gpu_gets_a_whole_gpu(
    cluster, core_api, resource_api, real_node, node_plugin, workloads
):
    """Extended resources through DRA: the class gpu.fgpu.dev carries extendedResourceName
    nvidia.com/gpu, so kube-scheduler makes a claim for the pod, as for a device plugin's resource."""
    name = unique("pod")
    manifest = pod(name, real_node.name, "unused")
    del manifest["spec"]["resourceClaims"]
    manifest["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    create(cluster, workloads, manifest)
    wait_running(core_api, name)
    seen = report(core_api, name)
    allocated = claim_of(resource_api, name).status.allocation.devices.results
    assert len(allocated) == 1 and allocated[0].device.startswith("gpu-") and "-" not in allocated[0].device[4:]
    gpus = [path for path in seen.devices if path.removeprefix("/dev/nvidia").isdigit()]
    assert gpus == [f"/dev/nvidia{allocated[0].device.removeprefix('gpu-')}"]


def test_admin_access_monitors_a_gpu_in_use_without_touching_it(
    cluster, core_api, resource_api, real_node, node_plugin, workloads
):
    """KEP-5018: a claim with adminAccess, in a namespace labelled for it, gets a device another pod
    holds; the container sees the GPU and none of the share's MPS settings, and nothing changes."""
    on_gpu0 = 'device.attributes["gpu.fgpu.dev"].index == 0'
    user = run_pod(cluster, core_api, workloads, real_node, "mps.gpu.fgpu.dev", selector=on_gpu0,
                   capacity={"memory": "2Gi"})  # fmt: skip
    daemons = node_plugin.logs().count("daemon started")
    namespace = unique("admin")
    client = cluster.api_client()
    core_api.create_namespace(
        {"metadata": {"name": namespace, "labels": {"resource.kubernetes.io/admin-access": "true"}}}
    )
    try:
        template = claim_template(unique("tpl"), "mps.gpu.fgpu.dev", selector=on_gpu0)
        template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["adminAccess"] = True
        name = unique("monitor")
        kubernetes.utils.create_from_dict(client, template, namespace=namespace)
        kubernetes.utils.create_from_dict(
            client, pod(name, real_node.name, template["metadata"]["name"]), namespace=namespace
        )
        wait_running(core_api, name, namespace)
        seen = report(core_api, name, namespace)
        assert seen.devices.get("/dev/nvidia0") == MOCK_NODE
        assert not [k for k in seen.env if k.startswith("CUDA_MPS")]
        assert node_plugin.logs().count("daemon started") == daemons  # nothing started for the monitor
    finally:
        delete_namespace(core_api, namespace)
    assert "admin access ended, nothing destroyed" in node_plugin.logs()
    assert core_api.read_namespaced_pod(user, NS).status.phase == "Running"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in report(core_api, user).env


def test_two_mig_devices_of_one_claim_on_one_gpu(cluster, core_api, resource_api, real_node, node_plugin, workloads):
    name = run_pod(
        cluster, core_api, workloads, real_node, "mig.gpu.fgpu.dev", count=2,
        selector='device.attributes["gpu.fgpu.dev"].profile == "1g.10gb"',
        constraints=[{"requests": ["gpu"], "matchAttribute": "gpu.fgpu.dev/parentUUID"}],
    )  # fmt: skip
    seen = report(core_api, name)
    caps = {path for path in seen.devices if path.startswith("/dev/nvidia-caps/")}
    assert len(caps) == 4, seen.devices  # a GPU instance and a compute instance per MIG device
    gpus = {path for path in seen.devices if path.removeprefix("/dev/nvidia").isdigit()}
    assert len(gpus) == 1, seen.devices
    instances = node_plugin.gpus().gpu_instances(int(next(iter(gpus)).removeprefix("/dev/nvidia")))
    assert len(instances) == 2


def test_two_mps_shares_with_different_limits_on_one_gpu(
    cluster, core_api, resource_api, real_node, node_plugin, workloads
):
    on_gpu0 = 'device.attributes["gpu.fgpu.dev"].index == 0'
    small = run_pod(cluster, core_api, workloads, real_node, "mps.gpu.fgpu.dev", selector=on_gpu0,
                    capacity={"memory": "4Gi", "compute": "20"})  # fmt: skip
    large = run_pod(cluster, core_api, workloads, real_node, "mps.gpu.fgpu.dev", selector=on_gpu0,
                    capacity={"memory": "10Gi", "compute": "50"})  # fmt: skip
    seen_small, seen_large = report(core_api, small), report(core_api, large)
    assert seen_small.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "20"
    assert seen_large.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert seen_small.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    assert seen_large.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"
    for seen in (seen_small, seen_large):
        assert "/tmp/nvidia-mps" in seen.mounts and "/dev/shm" in seen.mounts
        assert seen.devices.get("/dev/nvidia0") == MOCK_NODE
    # One daemon serves both: both containers see the segment it made in the shared /dev/shm.
    assert seen_small.shm & seen_large.shm, (seen_small.shm, seen_large.shm)
    assert any(name.startswith("cuda.shm") for name in seen_small.shm & seen_large.shm)


def test_two_mps_shares_inside_one_mig_partition(cluster, core_api, resource_api, real_node, node_plugin, workloads):
    in_gpu3 = 'device.attributes["gpu.fgpu.dev"].index == 3 && device.attributes["gpu.fgpu.dev"].profile == "3g.40gb"'
    shares = [
        run_pod(
            cluster,
            core_api,
            workloads,
            real_node,
            "mig-mps.gpu.fgpu.dev",
            selector=in_gpu3,
            capacity={"memory": memory, "compute": compute},
        )
        for memory, compute in (("4Gi", "20"), ("10Gi", "50"))
    ]
    devices = {claim_of(resource_api, name).status.allocation.devices.results[0].device for name in shares}
    assert len(devices) == 1 and next(iter(devices)).endswith("-mps"), devices  # one partition, two shares
    [instance] = node_plugin.gpus().gpu_instances(3)
    mig_uuid = instance.compute_instances[0][1]
    small, large = (report(core_api, name) for name in shares)
    assert (small.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], large.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]) == (
        "20",
        "50",
    )
    assert small.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    assert large.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"
    # Both containers see the same MIG device (the GPU's node and the instance's two capabilities)
    # and the partition's own daemon, whose segment is in the /dev/shm they share.
    assert small.devices == large.devices and len([p for p in small.devices if "nvidia-caps" in p]) == 2
    assert small.devices.get("/dev/nvidia3") == MOCK_NODE
    assert any(name.startswith("cuda.shm") for name in small.shm & large.shm), (small.shm, large.shm)
    assert (node_plugin.state_dir / "mps" / mig_uuid / "pipe" / "nvidia-cuda-mps-control.pid").exists()

    # The whole GPU waits: the partition's counters are drawn while a share holds it.
    whole_template = claim_template(
        unique("tpl"), "gpu.fgpu.dev", selector='device.attributes["gpu.fgpu.dev"].index == 3'
    )
    whole = unique("pod")
    create(cluster, workloads, whole_template, pod(whole, real_node.name, whole_template["metadata"]["name"]))
    wait_until("kube-scheduler finding no room for the whole GPU", lambda: unschedulable(core_api, whole))
    core_api.delete_namespaced_pod(shares[0], NS, grace_period_seconds=1)
    wait_until("the first share gone", lambda: not [p for p in core_api.list_namespaced_pod(NS).items
                                                    if p.metadata.name == shares[0]])  # fmt: skip
    assert node_plugin.gpus().gpu_instances(3) == [instance]  # kept for the other share
    assert core_api.read_namespaced_pod(whole, NS).status.phase == "Pending"
    core_api.delete_namespaced_pod(shares[1], NS, grace_period_seconds=1)
    wait_running(core_api, whole)
    assert node_plugin.gpus().gpu_instances(3) == []  # destroyed with the last share
    assert not (node_plugin.state_dir / "mps" / mig_uuid).exists()  # its daemon stopped, tmpfs gone


def unschedulable(core_api, name: str) -> bool:
    conditions = core_api.read_namespaced_pod(name, NS).status.conditions or []
    return any(c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable" for c in conditions)


def test_time_sliced_share(cluster, core_api, resource_api, real_node, node_plugin, workloads):
    name = run_pod(cluster, core_api, workloads, real_node, "timeslice.gpu.fgpu.dev", capacity={"memory": "2Gi"})
    seen = report(core_api, name)
    device = claim_of(resource_api, name).status.allocation.devices.results[0].device
    index = device.removeprefix("gpu-").split("-")[0]
    assert seen.devices.get(f"/dev/nvidia{index}") == MOCK_NODE


def test_claim_template_shared_by_a_deployment(cluster, core_api, resource_api, real_node, node_plugin, workloads):
    template = claim_template(unique("tpl"), "mps.gpu.fgpu.dev", capacity={"memory": "2Gi", "compute": "10"})
    name = unique("deploy")
    create(cluster, workloads, template, deployment(name, real_node.name, template["metadata"]["name"], replicas=3))

    def all_running() -> list:
        pods = core_api.list_namespaced_pod(NS, label_selector=f"app={name}").items
        return pods if len(pods) == 3 and all(p.status.phase == "Running" for p in pods) else []

    pods = wait_until("3 replicas running", all_running)
    claims = {claim_of(resource_api, p.metadata.name).metadata.uid for p in pods}
    assert len(claims) == 3  # a claim per pod from the one template
    for p in pods:
        assert report(core_api, p.metadata.name).env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"


def test_unprepare_on_pod_deletion(cluster, core_api, resource_api, real_node, node_plugin, workloads):
    mig = run_pod(cluster, core_api, workloads, real_node, "mig.gpu.fgpu.dev",
                  selector='device.attributes["gpu.fgpu.dev"].profile == "3g.40gb"')  # fmt: skip
    mps = run_pod(cluster, core_api, workloads, real_node, "mps.gpu.fgpu.dev",
                  selector='device.attributes["gpu.fgpu.dev"].index == 7')  # fmt: skip
    claims = {name: claim_of(resource_api, name) for name in (mig, mps)}
    specs = {name: node_plugin.cdi_dir.glob(f"*{c.metadata.uid}*") for name, c in claims.items()}
    assert all(list(found) for found in specs.values())
    mig_gpu = int(claims[mig].status.allocation.devices.results[0].device.split("-")[1])
    assert node_plugin.gpus().gpu_instances(mig_gpu)
    assert mps_daemon_running(node_plugin, 7)

    for name in (mig, mps):
        core_api.delete_namespaced_pod(name, NS, grace_period_seconds=1)
    wait_until("CDI specs removed", lambda: not any(node_plugin.cdi_dir.glob("*.json")))
    wait_until("MIG instance destroyed", lambda: not node_plugin.gpus().gpu_instances(mig_gpu))
    wait_until("MPS daemon stopped with the last share", lambda: not mps_daemon_running(node_plugin, 7))


def mps_daemon_pid(plugin: NodePlugin, gpu_index: int) -> int | None:
    """The GPU's running MPS control daemon, if any."""
    uuid = plugin.gpus().describe(gpu_index).uuid
    pid_file = plugin.state_dir / "mps" / uuid / "pipe" / "nvidia-cuda-mps-control.pid"
    try:
        pid = int(pid_file.read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def mps_daemon_running(plugin: NodePlugin, gpu_index: int) -> bool:
    return mps_daemon_pid(plugin, gpu_index) is not None


def test_bad_opaque_config_reaches_the_pods_events(cluster, core_api, resource_api, real_node, node_plugin, workloads):
    bad = {"opaque": {"driver": "gpu.fgpu.dev", "parameters": {
        "apiVersion": "gpu.fgpu.dev/v1alpha1", "kind": "ShareConfig",
        "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 150}}}}}  # fmt: skip
    template = claim_template(unique("tpl"), "mps.gpu.fgpu.dev", config=[bad])
    name = unique("pod")
    create(cluster, workloads, template, pod(name, real_node.name, template["metadata"]["name"]))

    def failure() -> list[str]:
        return [e for e in pod_events(core_api, name) if "activeThreadPercentage" in e]

    events = wait_until("the prepare failure in the pod's events", failure)
    assert "must be 1..100" in events[0]
    assert core_api.read_namespaced_pod(name, NS).status.phase == "Pending"


def test_pod_deleted_while_its_claim_is_prepared(cluster, core_api, resource_api, real_node, node_plugin, workloads):
    """kubelet is told mid-prepare that the pod is gone; what the prepare made is undone."""
    restart_with(node_plugin, {STALL_ENV: "prepare:device-ready", STALL_SECONDS_ENV: "8"})
    try:
        template = claim_template(unique("tpl"), "mig.gpu.fgpu.dev",
                                  selector='device.attributes["gpu.fgpu.dev"].profile == "1g.10gb"')  # fmt: skip
        name = unique("pod")
        create(cluster, workloads, template, pod(name, real_node.name, template["metadata"]["name"]))
        wait_until("prepare under way", lambda: "holding 8s at prepare:device-ready" in node_plugin.logs())
        assert any(node_plugin.gpus().gpu_instances(i) for i in range(8))  # the MIG instance exists
        core_api.delete_namespaced_pod(name, NS, grace_period_seconds=0)
        wait_until("pod gone", lambda: name not in {p.metadata.name for p in core_api.list_namespaced_pod(NS).items})
        wait_until("CDI spec removed", lambda: not any(node_plugin.cdi_dir.glob("*.json")))
        wait_until("MIG instance destroyed", lambda: not any(node_plugin.gpus().gpu_instances(i) for i in range(8)))
    finally:
        restart_with(node_plugin, {})


def restart_with(plugin: NodePlugin, fault_env: dict[str, str]) -> None:
    def restart() -> None:
        plugin.stop()
        plugin.extra_env = {k: v for k, v in plugin.extra_env.items() if not k.startswith("FGPU_STALL")}
        plugin.extra_env.update(fault_env)
        plugin.start()

    plugin.registered_after(restart)


def test_a_gpu_that_cannot_switch_mig_mode_publishes_no_mig_and_says_why(
    cluster, core_api, resource_api, real_node, node_plugin, workloads
):
    """An A100 with MIG mode off needs a GPU reset to enable it: the plugin publishes no MIG device
    and its log says why, so a MIG pod stays unscheduled with the scheduler's reason instead of
    being placed on a device that prepare cannot make."""
    node_plugin.stop()
    a100 = NodePlugin.on(real_node, nvml="mock:dgx-a100-40gb")
    try:
        a100.start_registered()
        wait_until("the A100 pool", lambda: _pool_product(resource_api, real_node.name) == "NVIDIA A100-SXM4-40GB")
        assert "GPU 0 (NVIDIA A100-SXM4-40GB) offers no mig: MIG mode is off" in a100.logs()
        template = claim_template(unique("tpl"), "mig.gpu.fgpu.dev")
        name = unique("pod")
        create(cluster, workloads, template, pod(name, real_node.name, template["metadata"]["name"]))

        def unschedulable() -> str | None:
            conditions = core_api.read_namespaced_pod(name, NS).status.conditions or []
            return next((c.message for c in conditions if c.type == "PodScheduled" and c.status == "False"), None)

        assert "cannot allocate all claims" in wait_until("the scheduler's reason", unschedulable)
        assert not any(a100.cdi_dir.glob("*.json"))
        core_api.delete_namespaced_pod(name, NS, grace_period_seconds=0)
        wait_until("pod gone", lambda: name not in {p.metadata.name for p in core_api.list_namespaced_pod(NS).items})
    finally:
        a100.remove()
        node_plugin.start_registered()
        wait_until("the H100 pool back", lambda: _pool_product(resource_api, real_node.name) == "NVIDIA H100 80GB HBM3")


def _pool_product(resource_api, node: str) -> str | None:
    devices = [d for s in complete_pool(resource_api, node) or [] for d in s.spec.devices or []]
    products = {d.attributes["productName"].string for d in devices if "productName" in (d.attributes or {})}
    return products.pop() if len(products) == 1 else None


def test_plugin_and_kubelet_restarts_keep_pods_running(
    cluster, core_api, resource_api, real_node, node_plugin, workloads
):
    """Pods keep running through plugin restarts (SIGKILL, SIGTERM) and a kubelet restart, and new
    claims are prepared after each; the plugin is registered again every time."""
    first = run_pod(cluster, core_api, workloads, real_node, "mps.gpu.fgpu.dev", capacity={"memory": "2Gi"})
    started = _container_started(core_api, first)
    mps_gpu = int(claim_of(resource_api, first).status.allocation.devices.results[0].device.split("-")[1])
    daemon = mps_daemon_pid(node_plugin, mps_gpu)
    for restart in (lambda: node_plugin.restart(signal.SIGKILL),
                    lambda: node_plugin.restart(signal.SIGTERM),
                    lambda: node_plugin.registered_after(real_node.restart_kubelet)):  # fmt: skip
        restart()
        after = run_pod(cluster, core_api, workloads, real_node, "timeslice.gpu.fgpu.dev")
        assert report(core_api, after).devices
        assert _container_started(core_api, first) == started  # the same container, never restarted
        assert mps_daemon_pid(node_plugin, mps_gpu) == daemon  # its MPS server outlives the plugin
    uid = claim_of(resource_api, first).metadata.uid
    core_api.delete_namespaced_pod(first, NS, grace_period_seconds=1)
    wait_until("the MPS share unprepared after the restarts", lambda: not list(node_plugin.cdi_dir.glob(f"*{uid}*")))


def test_a_pod_that_met_no_plugin_starts_once_the_plugin_is_back(
    cluster, core_api, resource_api, real_node, node_plugin, workloads
):
    """A pod created while the plugin is down (killed, its container not back yet): kubelet's
    prepare fails and kubelet would try again only at its next sync of the pod, 60-90 s later.
    The plugin, once registered again, annotates the pod, and kubelet starts it at once."""
    node_plugin.stop(signal.SIGKILL)
    template = claim_template(unique("tpl"), "mig.gpu.fgpu.dev")
    name = unique("pod")
    create(cluster, workloads, template, pod(name, real_node.name, template["metadata"]["name"]))
    wait_until("kubelet failed to prepare the pod's claim", lambda: failed_prepares(core_api, name))
    node_plugin.start_registered()
    # Well inside kubelet's own retry (its pod resync comes 60 s or more after the failure).
    wait_until(f"pod {name} running", lambda: running(core_api, name), timeout_s=40)
    events = pod_events(core_api, name)
    assert [e for e in events if e.startswith("PrepareRetried: the gpu.fgpu.dev plugin is registered with kubelet")]
    assert "gpu.fgpu.dev/prepare-retry" in core_api.read_namespaced_pod(name, NS).metadata.annotations
    assert report(core_api, name).devices  # it got its MIG device


def failed_prepares(core_api, name: str) -> list[str]:
    return [e for e in pod_events(core_api, name) if e.startswith("FailedPrepareDynamicResources")]


def running(core_api, name: str) -> bool:
    return core_api.read_namespaced_pod(name, NS).status.phase == "Running"


def _container_started(core_api, name: str) -> tuple[str, int]:
    status = core_api.read_namespaced_pod(name, NS).status.container_statuses[0]
    return status.container_id, status.restart_count


def test_the_pod_start_benchmark_measures_a_pod(cluster, real_node, node_plugin):
    result = pod_start.measure(cluster.api_client(), real_node, node_plugin, "mig", pods=1)
    assert result["pods"] == 1 and 0 < result["start_p50_s"] < 90
    assert result["kubelet_prepare_mean_ms"] > 0  # kubelet's own histogram moved
    assert result["plugin_prepare_p50_ms"] is not None  # and the plugin logged its prepare


def test_the_gap_benchmark_times_pods_created_through_a_crash_and_rollouts(cluster, real_node, node_plugin):
    figures = pod_start.gaps(cluster.api_client(), real_node, node_plugin, times=1)
    assert [f["scenario"] for f in figures] == ["crash", "rollout", "rollout without readiness"]
    crash, rollout, unready = figures
    assert crash["pods"] == 1 and rollout["pods"] >= 2 and unready["pods"] >= 2
    assert crash["no_plugin_s"][0] > 0 and rollout["no_plugin_s"] == [0]  # the new one registered first
    # Every pod started before kubelet's own retry of a failed prepare could have come (60 s at
    # the earliest): the crash's pod met no plugin and was retried once the plugin was back.
    assert max(f["pod_start_max_s"] for f in figures) < 60, figures
    assert node_plugin.health() == health_pb2.HealthCheckResponse.SERVING  # the node's plugin serves again


def test_rolling_update_with_two_instances_on_the_node(
    cluster, core_api, resource_api, real_node, node_plugin, workloads
):
    """maxSurge 1: the new pod's plugin registers beside the old one (sockets named after each pod's
    UID), kubelet uses either, and the old one's exit leaves no moment without a registered driver."""
    node_plugin.stop()
    old = NodePlugin.on(real_node, uid=str(uuid.uuid4()), sharing_state_of=node_plugin).start_registered()
    new = NodePlugin.on(real_node, uid=str(uuid.uuid4()), sharing_state_of=node_plugin)
    try:
        before = run_pod(cluster, core_api, workloads, real_node, "mps.gpu.fgpu.dev", capacity={"memory": "2Gi"})
        new.start_registered()
        assert old.registration_socket.exists() and new.registration_socket.exists()
        during = run_pod(cluster, core_api, workloads, real_node, "mig.gpu.fgpu.dev")
        old.stop()  # SIGTERM: it removes only its own sockets
        after = run_pod(cluster, core_api, workloads, real_node, "gpu.fgpu.dev")
        assert not [e for e in pod_events(core_api, after) if "not registered" in e]
        assert new.health() == health_pb2.HealthCheckResponse.SERVING
        for name in (before, during, after):
            assert core_api.read_namespaced_pod(name, NS).status.phase == "Running"
        # The old instance prepared `before`; the new one unprepares it, and stops the MPS daemon.
        uid = claim_of(resource_api, before).metadata.uid
        core_api.delete_namespaced_pod(before, NS, grace_period_seconds=1)
        wait_until("the old instance's claim unprepared by the new", lambda: not list(new.cdi_dir.glob(f"*{uid}*")))
        assert f"unprepared claim default/{before}" in new.logs()
    finally:
        for instance in (old, new):
            instance.stop()
            shutil.rmtree(instance.root, ignore_errors=True)  # the state stays in node_plugin's root
        node_plugin.start_registered()
