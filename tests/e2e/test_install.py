"""fgpu installed the way an operator installs it, on the real node: the image built from the
Dockerfile (testbed/cluster/image_build.py) and imported into the node's containerd, `helm install`
of the chart with mock NVML, then the plugin DaemonSet registered with the real kubelet, the
controller Deployment, the plugin's service account held to its own node, `helm upgrade` to a new
image tag under running MIG, MPS and time-sliced pods, and `helm uninstall`.

Test-bed specifics, all chart values a user would set on such a cluster: the apiserver binds
127.0.0.1 and there is no service network, so the pods use the node's network (hostNetwork) and
`apiServer.host/port`; kubelet's root, the CDI dir and the state dir are the real node's, and the
state dir is made a shared mount (systemd does that for / on real hosts) for the MPS tmpfs's
Bidirectional propagation."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from kubernetes.dynamic import DynamicClient
from kubernetes.stream import stream

from driver.controller.ledger import LEDGER_LABEL, POOL_ANNOTATION, ledger_name
from driver.scheduling.opt_in import OPT_IN_LABEL, OPT_IN_VALUE
from partitioner.mps import IDENTITY_FILE, DaemonIdentity
from testbed.cluster.harness import Cluster, free_port
from testbed.cluster.image_build import build_image
from testbed.cluster.images import BUSYBOX_IMAGE
from testbed.cluster.node import RealNode
from testbed.workloads import (
    claim_template,
    delete_namespace,
    pod,
    pod_events,
    unique,
    wait_running,
    wait_until,
)
from tests.support.chart import CHART, KUBE_VERSION, NAMESPACE, ROOT, helm, helm_command, set_flags
from tests.support.controller import by_kube_scheduler
from tests.support.pools import complete_pool

# The first run on a machine makes the base (mmdebstrap, about 5 min) and the image (about 80 s),
# and a node may wait for another test's node to go.
pytestmark = [pytest.mark.cluster, pytest.mark.real_node, pytest.mark.timeout(900)]
REPOSITORY = "fgpu.test/fgpu"
TAGS = ("dev", "next")  # the same image under two tags: an upgrade changes the pod template's image
RELEASE = "fgpu"
NS = "default"
ON_GPU = 'device.attributes["gpu.fgpu.dev"].index == {}'
KEPT_FOR_GPU_PODS = "gpu.fgpu.dev/gpu-pods-only"


@dataclass
class Release:
    cluster: Cluster
    node: RealNode
    values: dict[str, object]

    def helm(self, *args: str, timeout_s: float = 300) -> str:
        return helm(*args, "--namespace", NAMESPACE, kubeconfig=self.cluster.kubeconfig, timeout_s=timeout_s)

    def start_helm(self, *args: str) -> subprocess.Popen[str]:
        """helm in the background, e.g. an upgrade to watch while it rolls."""
        argv, env = helm_command(*args, "--namespace", NAMESPACE, kubeconfig=self.cluster.kubeconfig)
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def install(self) -> None:
        self.helm("install", RELEASE, str(CHART), "--create-namespace", *set_flags(self.values),
                  "--wait", "--timeout=4m")  # fmt: skip

    def upgrade_command(self, tag: str) -> list[str]:
        return ["upgrade", RELEASE, str(CHART), "--reuse-values", f"--set=image.tag={tag}", "--wait", "--timeout=4m"]

    def plugin_pods(self) -> list[Any]:
        core = kubernetes.client.CoreV1Api(self.cluster.api_client())
        selector = "app.kubernetes.io/component=kubelet-plugin"
        return core.list_namespaced_pod(NAMESPACE, label_selector=selector).items

    def single_plugin_pod(self) -> Any:
        """The plugin pod when only one is left (none while two overlap)."""
        pods = self.plugin_pods()
        return pods[0] if len(pods) == 1 else None

    def diagnosis(self) -> str:
        """The release's pods: phase, container states, events and log tails."""
        core = kubernetes.client.CoreV1Api(self.cluster.api_client())
        lines = []
        for item in core.list_namespaced_pod(NAMESPACE).items:
            name = item.metadata.name
            lines.append(f"{name} on {item.spec.node_name}: {item.status.phase} {item.status.container_statuses}")
            lines += [f"  event: {line}" for line in pod_events(core, name, NAMESPACE)]
            with contextlib.suppress(kubernetes.client.ApiException):
                lines.append(core.read_namespaced_pod_log(name, NAMESPACE, tail_lines=30))
        return "\n".join(lines)


def api_port(cluster: Cluster) -> str:
    assert cluster.kubeconfig is not None
    server = json.loads(cluster.kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    return server.rsplit(":", 1)[1]


def values_for_test_bed(cluster: Cluster, node: RealNode, state_dir: Path) -> dict[str, object]:
    on_node = {"kubernetes.io/hostname": node.name}  # the fake nodes have no kubelet to run pods
    return {
        "image.repository": REPOSITORY,
        "image.tag": TAGS[0],
        "image.pullPolicy": "Never",
        "nvml": "mock:dgx-h100",
        "offer": ["whole", "mig", "mps", "timeslice", "mig-mps"],  # examples/mig-mps-shares.yaml
        "migShareProfiles": ["3g.40gb"],
        "logFormat": "json",
        "apiServer.host": "127.0.0.1",
        "apiServer.port": api_port(cluster),
        "kubeletPlugin.hostNetwork": True,
        "kubeletPlugin.healthcheckPort": free_port(),
        "kubeletPlugin.kubeletRegistrarDirectoryPath": str(node.registrar_dir),
        # kubelet dials the DRA socket at the path the plugin registers, anywhere; a short one,
        # since the node's temp dir and a pod UID in the name would pass a socket path's 107 bytes.
        "kubeletPlugin.kubeletPluginsDirectoryPath": str(node.workdir / "p"),
        "kubeletPlugin.cdiDir": str(node.cdi_dir),
        "kubeletPlugin.stateDir": str(state_dir),
        "kubeletPlugin.nodeSelector": on_node,
        "controller.hostNetwork": True,
        # On the node's network a container port is a host port: two replicas on one node need none.
        "controller.metricsPort": 0,
        "controller.healthPort": 0,  # likewise its liveness port (and so no probe)
        "controller.nodeSelector": on_node,
        "webhook.nodeSelector": on_node,
        "webhook.replicas": 1,
        # Self-managed certificates: it calls the API server, at the node's loopback like the others;
        # kube-apiserver calls it at the node's address (aggregator routing), on a port free here.
        "webhook.hostNetwork": True,
        "webhook.port": free_port(),
        # The session's cluster fixture already made the DeviceClasses, for every test.
        "deviceClasses.create": False,
        # Pods with fgpu's claims tolerate the nodes kept for pods with GPUs (docs/admission.md).
        "webhook.gpuPodsToleration": KEPT_FOR_GPU_PODS,
    }


def shared_mount(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
    subprocess.run(["mount", "--make-shared", str(path)], check=True)


@pytest.fixture(scope="module")
def release(cluster: Cluster, real_node: RealNode) -> Iterator[Release]:
    archive = build_image(f"{REPOSITORY}:{TAGS[0]}")
    real_node.import_image(archive)
    tagged = real_node.ctr("images", "tag", "--force", f"{REPOSITORY}:{TAGS[0]}", f"{REPOSITORY}:{TAGS[1]}")
    assert tagged.returncode == 0, tagged.stderr
    state_dir = real_node.workdir / "fgpu-state"
    shared_mount(state_dir)
    remove_other_nodes_slices(cluster, real_node.name)
    installed = Release(cluster, real_node, values_for_test_bed(cluster, real_node, state_dir))
    try:
        installed.install()
        resource_api = kubernetes.client.ResourceV1Api(cluster.api_client())
        try:
            wait_until("the node's pool", lambda: complete_pool(resource_api, real_node.name))
        except AssertionError as err:
            raise AssertionError(f"{err}\n{installed.diagnosis()}") from None
        yield installed
    finally:
        cleanup(installed)


def remove_other_nodes_slices(cluster: Cluster, node: str) -> None:
    """Slices that plugins of earlier tests left on the fake nodes: the controller would place the
    gang there, where no kubelet runs its pods."""
    resource = kubernetes.client.ResourceV1Api(cluster.api_client())
    for stale in resource.list_resource_slice(field_selector="spec.driver=gpu.fgpu.dev").items:
        if stale.spec.node_name != node:
            resource.delete_resource_slice(stale.metadata.name)


def cleanup(installed: Release) -> None:
    """Pods with claims go while a plugin still serves (kubelet unprepares through it), then the
    release and its namespace; the node's stop unmounts the state dir."""
    core = kubernetes.client.CoreV1Api(installed.cluster.api_client())
    on_node = f"spec.nodeName={installed.node.name}"
    for item in core.list_namespaced_pod(NS, field_selector=on_node).items:
        core.delete_namespaced_pod(item.metadata.name, NS, grace_period_seconds=1)
    wait_until("test pods gone", lambda: not core.list_namespaced_pod(NS, field_selector=on_node).items, timeout_s=120)
    with contextlib.suppress(AssertionError):  # a test may have uninstalled it
        installed.helm("uninstall", RELEASE, "--wait", "--timeout=2m")
    delete_namespace(core, NAMESPACE)


def claim_pod(cluster: Cluster, node: RealNode, device_class: str, wait: bool = True, **template_args: Any) -> str:
    """A pod on the real node with a claim from a new template; returns its name (once Running)."""
    client = cluster.api_client()
    template = claim_template(unique("tpl"), device_class, **template_args)
    name = unique("pod")
    kubernetes.utils.create_from_dict(client, template, namespace=NS)
    kubernetes.utils.create_from_dict(client, pod(name, node.name, template["metadata"]["name"]), namespace=NS)
    if wait:
        wait_running(kubernetes.client.CoreV1Api(client), name)
    return name


def container_ids(core: kubernetes.client.CoreV1Api, names: list[str]) -> dict[str, str]:
    """pod -> its container's ID, while Running (a restart or a new container changes it)."""
    found = {}
    for name in names:
        item = core.read_namespaced_pod(name, NS)
        assert item.status.phase == "Running", f"{name}: {item.status.phase}"
        found[name] = item.status.container_statuses[0].container_id
    return found


# --- installed --------------------------------------------------------------------------------


def test_plugin_daemonset_serves_the_real_kubelet(cluster, real_node, release: Release) -> None:
    (plugin,) = release.plugin_pods()
    assert plugin.spec.node_name == real_node.name and plugin.status.phase == "Running"
    assert plugin.spec.containers[0].image == f"{REPOSITORY}:{TAGS[0]}"
    # Slices from the pod (the fixture waited for them); kubelet prepares through it:
    pod_name = claim_pod(cluster, real_node, "gpu.fgpu.dev")
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    logged = [json.loads(line) for line in core.read_namespaced_pod_log(plugin.metadata.name, NAMESPACE).splitlines()]
    # logFormat json; the claim generated for the pod is named after it
    assert any(e["msg"].startswith("prepared claim") and pod_name in e["msg"] for e in logged), logged[-5:]
    # The claim's status.devices, written under the chart's RBAC (associated-node:update)
    claims = kubernetes.client.ResourceV1Api(cluster.api_client()).list_namespaced_resource_claim(NS).items
    (claim,) = [c for c in claims if c.metadata.name.startswith(f"{pod_name}-")]
    (entry,) = claim.status.devices
    assert entry.driver == "gpu.fgpu.dev" and entry.conditions[0].type == "Ready"
    assert entry.data["gpuUUID"].startswith("GPU-")


def refused_template(cluster: Cluster) -> str | None:
    """The message refusing a template with a bad config, or None when it was admitted (then deleted)."""
    resource = kubernetes.client.ResourceV1Api(cluster.api_client())
    parameters = {"apiVersion": "gpu.fgpu.dev/v1alpha1", "kind": "ShareConfig", "sharing": {"strategy": "Shared"}}
    config = {"opaque": {"driver": "gpu.fgpu.dev", "parameters": parameters}}
    template = claim_template(unique("tpl"), "mps.gpu.fgpu.dev", config=[config])
    try:
        resource.create_namespaced_resource_claim_template(NS, template)
    except kubernetes.client.ApiException as err:
        return json.loads(err.body)["message"]
    # Admitted (failurePolicy Ignore) while the Service has no ready endpoint or caBundle yet.
    resource.delete_namespaced_resource_claim_template(template["metadata"]["name"], NS)
    return None


REFUSAL = 'admission webhook "resourceclaimtemplates.gpu.fgpu.dev" denied the request: '
BAD_STRATEGY = "sharing.strategy must be MPS or TimeSlicing, got 'Shared'"


def test_the_webhook_refuses_a_bad_config_through_its_service(cluster, release: Release) -> None:
    message = wait_until("the webhook answering through its Service", lambda: refused_template(cluster), timeout_s=90)
    assert message.startswith(REFUSAL) and BAD_STRATEGY in message
    # Its certificate is its own: a Secret it made, whose CA it wrote into the configuration.
    secret = webhook_secret(cluster)
    admission = kubernetes.client.AdmissionregistrationV1Api(cluster.api_client())
    configuration = admission.read_validating_webhook_configuration(f"{RELEASE}-webhook")
    assert {w.client_config.ca_bundle for w in configuration.webhooks} == {secret["ca.crt"]}


def webhook_secret(cluster: Cluster) -> dict[str, str]:
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    return core.read_namespaced_secret(f"{RELEASE}-webhook-certs", NAMESPACE).data


def workloads_state(cluster: Cluster) -> dict[str, Any]:
    """What a no-op apply leaves as it is: the workloads' generations, the pods (UID, restarts)."""
    apps = kubernetes.client.AppsV1Api(cluster.api_client())
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    state: dict[str, Any] = {}
    for item in [*apps.list_namespaced_deployment(NAMESPACE).items, *apps.list_namespaced_daemon_set(NAMESPACE).items]:
        state[f"{item.kind or type(item).__name__} {item.metadata.name}"] = item.metadata.generation
    for item in core.list_namespaced_pod(NAMESPACE).items:
        restarts = sum(c.restart_count for c in item.status.container_statuses or [])
        state[f"pod {item.metadata.name}"] = (item.metadata.uid, restarts)
    return state


def tolerating_pod(core: kubernetes.client.CoreV1Api, cluster: Cluster, node: RealNode) -> str | None:
    """A pod of a whole-GPU claim created, and its name once the webhook gave it the toleration (a pod
    created before its configuration's caBundle was written was admitted without: deleted)."""
    name = claim_pod(cluster, node, "gpu.fgpu.dev", wait=False)
    if any(t.key == KEPT_FOR_GPU_PODS for t in core.read_namespaced_pod(name, NS).spec.tolerations or ()):
        return name
    core.delete_namespaced_pod(name, NS, grace_period_seconds=0)
    return None


def ready_pod(pod: Any) -> bool:
    return pod.status.phase == "Running" and any(
        c.type == "Ready" and c.status == "True" for c in pod.status.conditions or ()
    )


def ready_replacement(release: Release, uid: str) -> bool:
    """Whether the one plugin pod is another than `uid`, Running and Ready."""
    pod = release.single_plugin_pod()
    return pod is not None and pod.metadata.uid != uid and ready_pod(pod)


def test_on_a_node_kept_for_gpu_pods_a_pod_of_fgpus_claims_runs_and_a_pod_without_claims_does_not(
    cluster, real_node, release: Release
) -> None:
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    before = [t.to_dict() for t in core.read_node(real_node.name).spec.taints or ()]
    taint = {"key": KEPT_FOR_GPU_PODS, "value": "true", "effect": "NoSchedule"}
    core.patch_node(real_node.name, {"spec": {"taints": [*before, taint]}})
    plain = unique("cpu-only")
    try:
        # The plugin made again on the tainted node (a rollout; a node added already tainted): the
        # chart's toleration of the key lets it back.
        (old,) = release.plugin_pods()
        core.delete_namespaced_pod(old.metadata.name, NAMESPACE)
        wait_until("the plugin back on the tainted node", lambda: ready_replacement(release, old.metadata.uid), 120)
        name = wait_until("a GPU pod given the toleration", lambda: tolerating_pod(core, cluster, real_node), 90)
        wait_running(core, name)
        container = {"name": "main", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never", "command": ["sleep", "3600"]}
        spec = {"nodeSelector": {"kubernetes.io/hostname": real_node.name}, "containers": [container]}
        core.create_namespaced_pod(NS, {"metadata": {"name": plain}, "spec": spec})

        def refused() -> str | None:
            conditions = core.read_namespaced_pod(plain, NS).status.conditions or ()
            return next(
                (c.message for c in conditions if c.type == "PodScheduled" and c.reason == "Unschedulable"), None
            )

        message = wait_until("kube-scheduler keeping the pod without claims off the node", refused)
        assert "untolerated taint" in message, message
    finally:
        core.patch_node(real_node.name, {"spec": {"taints": before or None}})
        with contextlib.suppress(kubernetes.client.ApiException):
            core.delete_namespaced_pod(plain, NS, grace_period_seconds=0)


def test_applied_again_as_gitops_tools_do_the_webhook_keeps_refusing(cluster, release: Release) -> None:
    """The chart rendered with the release's values (`helm template`, as Argo CD does) and
    server-side applied twice over the installed objects (Flux, Argo CD with ServerSideApply):
    nothing changes, nothing restarts, the webhook's certificate and caBundle stay, and a bad config
    is refused after each apply."""
    wait_until("the webhook refusing", lambda: refused_template(cluster), timeout_s=90)
    rendered = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION,
                    *set_flags(release.values))  # fmt: skip
    documents = [d for d in yaml.safe_load_all(rendered) if d]
    assert "PRIVATE KEY" not in rendered and "Secret" not in {d["kind"] for d in documents}
    (configuration,) = [d for d in documents if d["kind"] == "ValidatingWebhookConfiguration"]
    assert not [w for w in configuration["webhooks"] if "caBundle" in w["clientConfig"]]  # the webhook's field
    dynamic = DynamicClient(cluster.api_client(), cache_file=cluster.discovery_cache)
    before, secret = workloads_state(cluster), webhook_secret(cluster)
    for _ in range(2):
        for document in documents:
            resource = dynamic.resources.get(api_version=document["apiVersion"], kind=document["kind"])
            dynamic.server_side_apply(resource, body=document, name=document["metadata"]["name"],
                                      namespace=document["metadata"].get("namespace") if resource.namespaced else None,
                                      field_manager="gitops", force_conflicts=True)  # fmt: skip
        message = refused_template(cluster)  # at once: the caBundle was never touched
        assert message is not None and message.startswith(REFUSAL) and BAD_STRATEGY in message, message
        assert workloads_state(cluster) == before and webhook_secret(cluster) == secret
        admission = kubernetes.client.AdmissionregistrationV1Api(cluster.api_client())
        live = admission.read_validating_webhook_configuration(f"{RELEASE}-webhook")
        assert {w.client_config.ca_bundle for w in live.webhooks} == {secret["ca.crt"]}


def test_controller_deployment_runs_and_leads(cluster, release: Release) -> None:
    apps = kubernetes.client.AppsV1Api(cluster.api_client())
    deployment = apps.read_namespaced_deployment(f"{RELEASE}-controller", NAMESPACE)
    assert deployment.status.ready_replicas == 2
    coordination = kubernetes.client.CoordinationV1Api(cluster.api_client())
    leases = wait_until("a leader", lambda: coordination.list_namespaced_lease(NAMESPACE).items)
    assert leases[0].spec.holder_identity


def test_the_controller_deletes_the_empty_ledger_of_a_pool_that_is_gone(cluster, release: Release) -> None:
    """A node an autoscaler removed leaves its pool's ledger; once it records nothing the leader
    deletes it, with the chart's RBAC. A ledger of a pool that is there stays."""
    core = kubernetes.client.CoreV1Api(cluster.api_client())

    def ledger(node: str) -> dict[str, Any]:
        pool = ("gpu.fgpu.dev", node)
        metadata = {"name": ledger_name(pool), "labels": {LEDGER_LABEL: "true"},
                    "annotations": {POOL_ANNOTATION: "/".join(pool)}}  # fmt: skip
        return {"metadata": metadata, "data": {}}

    gone, there = ledger(unique("removed-node")), ledger(release.node.name)
    made = []
    try:
        for body in (gone, there):
            with contextlib.suppress(kubernetes.client.ApiException):  # the node's own may exist
                made.append(core.create_namespaced_config_map(NAMESPACE, body).metadata.name)
        wait_until("the gone pool's ledger deleted", lambda: gone["metadata"]["name"] not in names_now(core), 60)
        assert there["metadata"]["name"] in names_now(core)
    finally:
        for name in made:  # as it was made, empty: one the controller has written to since is its own
            with contextlib.suppress(kubernetes.client.ApiException):
                made_now = core.read_namespaced_config_map(name, NAMESPACE)
                preconditions = {"resourceVersion": made_now.metadata.resource_version}
                if not made_now.data:
                    core.delete_namespaced_config_map(name, NAMESPACE, body={"preconditions": preconditions})


def names_now(core: kubernetes.client.CoreV1Api) -> set[str]:
    return {c.metadata.name for c in core.list_namespaced_config_map(NAMESPACE).items}


def test_a_drain_takes_one_controller_replica_at_a_time_and_a_standby_leads(cluster, release: Release) -> None:
    """Two replicas and the chart's PodDisruptionBudget: evicting both at once (what a drain or an
    autoscaler removing their node does) is refused for the second while the first is replaced; then
    two replicas run again and one of them holds the Lease."""
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    policy = kubernetes.client.PolicyV1Api(cluster.api_client())
    budget = f"{RELEASE}-controller"
    wait_until(
        "the budget counted",
        lambda: policy.read_namespaced_pod_disruption_budget(budget, NAMESPACE).status.disruptions_allowed == 1,
    )
    selector = "app.kubernetes.io/component=controller"
    first, second = (p.metadata.name for p in core.list_namespaced_pod(NAMESPACE, label_selector=selector).items)

    def evict(name: str) -> None:
        body = {"metadata": {"name": name, "namespace": NAMESPACE}}
        core.create_namespaced_pod_eviction(name, NAMESPACE, body)

    evict(first)
    with pytest.raises(kubernetes.client.ApiException) as refused:
        evict(second)
    assert refused.value.status == 429 and "disruption budget" in refused.value.body

    def leading() -> bool:
        pods = core.list_namespaced_pod(NAMESPACE, label_selector=selector).items
        ready = {p.metadata.name for p in pods if p.metadata.deletion_timestamp is None and ready_pod(p)}
        coordination = kubernetes.client.CoordinationV1Api(cluster.api_client())
        holders = {lease.spec.holder_identity for lease in coordination.list_namespaced_lease(NAMESPACE).items}
        return len(ready) == 2 and first not in ready and bool(holders & ready)

    wait_until("two replicas again, one leading", leading, 90)


# --- the plugin's service account ---------------------------------------------------------------


def plugin_client(cluster: Cluster, release: Release) -> kubernetes.client.ApiClient:
    """A client with the token kubelet gives the plugin pod: bound to that pod, so it carries the
    pod's node (extra authentication.kubernetes.io/node-name)."""
    (plugin,) = release.plugin_pods()
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    request = {
        "spec": {
            "audiences": ["https://kubernetes.default.svc"],
            "expirationSeconds": 600,
            "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": plugin.metadata.name,
                               "uid": plugin.metadata.uid},
        }
    }  # fmt: skip
    token = core.create_namespaced_service_account_token(plugin.spec.service_account_name, NAMESPACE, request)
    client = cluster.api_client()
    client.configuration.cert_file = client.configuration.key_file = None
    client.configuration.api_key = {"authorization": f"Bearer {token.status.token}"}
    return kubernetes.client.ApiClient(client.configuration)


def slice_of(node: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": unique(f"probe-{node}")},
        "spec": {
            "driver": "gpu.fgpu.dev",
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [],
        },
    }


def outcome(call: Any) -> tuple[int, str]:
    """(HTTP status, message) of an API call."""
    try:
        call()
    except kubernetes.client.ApiException as err:
        return err.status, json.loads(err.body).get("message", "")
    return 200, ""


def test_plugin_service_account_is_held_to_its_node(cluster, real_node, release: Release) -> None:
    client = plugin_client(cluster, release)
    resource = kubernetes.client.ResourceV1Api(client)
    core = kubernetes.client.CoreV1Api(client)
    assert outcome(lambda: resource.create_resource_slice(slice_of(real_node.name), dry_run="All")) == (200, "")
    # The admission policy, on the node the pod-bound token names (a policy's denial is 422 Invalid):
    status, message = outcome(lambda: resource.create_resource_slice(slice_of("node-a"), dry_run="All"))
    assert status == 422 and f"node '{real_node.name}' may not write ResourceSlices of node 'node-a'" in message
    # Reads it does not need, and writes to anything but slices and its retry annotation (RBAC):
    for call in (
        core.list_secret_for_all_namespaces,
        core.list_pod_for_all_namespaces,
        lambda: core.patch_node(real_node.name, {"metadata": {"labels": {"x": "y"}}}),
        lambda: core.create_namespaced_config_map(NS, {"metadata": {"name": "x"}}),
    ):
        assert outcome(call)[0] == 403
    assert outcome(lambda: core.read_node(real_node.name))[0] == 200
    assert outcome(resource.list_resource_claim_for_all_namespaces)[0] == 200  # what names waiting pods


def test_plugin_may_only_annotate_its_own_nodes_pods_for_a_retry(cluster, real_node, release: Release) -> None:
    admin = kubernetes.client.CoreV1Api(cluster.api_client())
    core = kubernetes.client.CoreV1Api(plugin_client(cluster, release))
    here, elsewhere = unique("here"), unique("elsewhere")
    for name, node in ((here, real_node.name), (elsewhere, "node-a")):  # no kubelet runs node-a: Pending
        manifest = {
            "metadata": {"name": name},
            "spec": {
                "nodeName": node,
                "terminationGracePeriodSeconds": 0,
                "containers": [{"name": "c", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                                "command": ["sleep", "3600"]}],
            },
        }  # fmt: skip
        admin.create_namespaced_pod(NS, manifest)

    def patch(name: str, metadata: dict[str, Any]) -> tuple[int, str]:
        body = {"metadata": metadata}
        return outcome(lambda: core.patch_namespaced_pod(name, NS, body, dry_run="All"))

    try:
        retry = {"annotations": {"gpu.fgpu.dev/prepare-retry": "2026-12-01T00:00:00.000000Z"}}
        assert patch(here, retry) == (200, "")
        status, message = patch(elsewhere, retry)
        assert status == 422 and f"node '{real_node.name}' may not change pods of another node" in message
        for other in ({"labels": {"x": "y"}}, {"annotations": {"x": "y"}}, {"finalizers": ["example.com/x"]}):
            status, message = patch(here, other)
            assert status == 422 and "may change only the annotation gpu.fgpu.dev/prepare-retry" in message
        # It gets a pod by name (a claim's owner, for the usage history), never lists or watches them.
        assert outcome(lambda: core.read_namespaced_pod(here, NS))[0] == 200
        assert outcome(lambda: core.list_namespaced_pod(NS))[0] == 403
    finally:
        for name in (here, elsewhere):
            with contextlib.suppress(kubernetes.client.ApiException):  # pod GC may have taken node-a's
                admin.delete_namespaced_pod(name, NS, grace_period_seconds=0)


# --- the examples users apply ---------------------------------------------------------------------

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def on_test_node(document: dict[str, Any], node: str) -> dict[str, Any]:
    """The example as the test runs it: its pods on the real node (the fake ones run nothing) and
    their containers on the test image (the examples name CUDA images this machine has no registry
    for; a Job's finish after 15 s, the others sleep), all else as users apply it."""
    if document["kind"] not in WORKLOADS:
        return document
    spec = document["spec"] if document["kind"] == "Pod" else document["spec"]["template"]["spec"]
    spec.update(nodeSelector={"kubernetes.io/hostname": node}, terminationGracePeriodSeconds=1)
    command = "sleep 15" if document["kind"] == "Job" else "exec sleep 3600"
    for container in spec["containers"]:
        container.update(image=BUSYBOX_IMAGE, imagePullPolicy="Never", command=["sh", "-c", command])
    return document


WORKLOADS = ("Pod", "Deployment", "Job")


def example_pods(core: kubernetes.client.CoreV1Api, documents: list[dict[str, Any]]) -> list[Any]:
    """The pods of an example's Pods, Deployments (by their selector) and Jobs (by job-name); None
    for a workload whose pods are not all there yet."""
    found = []
    for document in documents:
        if document["kind"] == "Pod":
            found.append(core.read_namespaced_pod(document["metadata"]["name"], NS))
        elif document["kind"] in ("Deployment", "Job"):
            if document["kind"] == "Deployment":
                labels, count = document["spec"]["selector"]["matchLabels"], document["spec"]["replicas"]
            else:
                labels, count = {"job-name": document["metadata"]["name"]}, document["spec"]["parallelism"]
            selector = ",".join(f"{key}={value}" for key, value in labels.items())
            replicas = core.list_namespaced_pod(NS, label_selector=selector).items
            found += replicas if len(replicas) >= count else [None]
    return found


def delete_example(cluster: Cluster, client: kubernetes.client.ApiClient, documents: list[dict[str, Any]]) -> None:
    """Workloads first, their pods gone before the claims and templates (kubelet unprepares)."""
    dynamic = DynamicClient(client, cache_file=cluster.discovery_cache)
    core = kubernetes.client.CoreV1Api(client)
    workloads = [d for d in documents if d["kind"] in WORKLOADS]
    for group in (workloads, [d for d in documents if d not in workloads]):
        for document in group:
            resource = dynamic.resources.get(api_version=document["apiVersion"], kind=document["kind"])
            with contextlib.suppress(kubernetes.client.ApiException):
                resource.delete(name=document["metadata"]["name"], namespace=NS, propagation_policy="Foreground")
        wait_until("the example's pods gone", lambda: not example_pods_left(core, workloads), timeout_s=120)


def example_pods_left(core: kubernetes.client.CoreV1Api, workloads: list[dict[str, Any]]) -> bool:
    names = {d["metadata"]["name"] for d in workloads if d["kind"] == "Pod"}
    prefixes = tuple(f"{d['metadata']['name']}-" for d in workloads if d["kind"] != "Pod")
    return any(
        p.metadata.name in names or p.metadata.name.startswith(prefixes) for p in core.list_namespaced_pod(NS).items
    )


def placed_by_the_controller(resource: kubernetes.client.ResourceV1Api) -> list[str]:
    """The opt-in claims there are now, each allocated by fgpu's controller (kube-scheduler owns
    none of their allocations): the pods were held at create by the webhook's gate."""
    claims = resource.list_namespaced_resource_claim(NS, label_selector=f"{OPT_IN_LABEL}={OPT_IN_VALUE}").items
    assert all(c.status and c.status.allocation for c in claims), [c.metadata.name for c in claims]
    assert not [c.metadata.name for c in claims if by_kube_scheduler(resource, c.metadata.name)]
    return [c.metadata.name for c in claims]


def in_plugin_pod(core: kubernetes.client.CoreV1Api, release: Release, *command: str) -> str:
    """`kubectl exec` into the plugin's pod, as an operator would."""
    (plugin,) = release.plugin_pods()
    return stream(core.connect_get_namespaced_pod_exec, plugin.metadata.name, NAMESPACE, command=list(command),
                  stderr=True, stdin=False, stdout=True, tty=False)  # fmt: skip


def test_a_mock_fault_in_the_plugin_pod_taints_and_an_operator_clears_it(cluster, real_node, release) -> None:
    core = kubernetes.client.CoreV1Api(cluster.api_client())

    def tainted() -> set[str]:
        slices = kubernetes.client.ResourceV1Api(cluster.api_client()).list_resource_slice(
            field_selector=f"spec.nodeName={real_node.name}"
        )
        return {d.name for s in slices.items for d in s.spec.devices or [] if d.taints}

    in_plugin_pod(core, release, "fgpu", "mock", "fault", "--gpu", "7", "xid", "--xid", "79")  # the chart's env
    wait_until("GPU 7 tainted", lambda: "gpu-7" in tainted())
    assert {name.split("-")[1] for name in tainted()} == {"7"}
    assert "cleared all faults" in in_plugin_pod(core, release, "fgpu", "health", "clear")
    wait_until("the taints gone", lambda: not tainted())


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(cluster, real_node, release: Release, path: Path) -> None:
    """Every example's pods run (a Job's run to completion); opt-in claims are placed by the
    controller, with no gate written by the user (examples/gang.yaml)."""
    client = cluster.api_client()
    core = kubernetes.client.CoreV1Api(client)
    documents = [on_test_node(d, real_node.name) for d in yaml.safe_load_all(path.read_text()) if d]
    try:
        for document in documents:
            kubernetes.utils.create_from_dict(client, document, namespace=NS)

        def all_running() -> bool:
            pods = example_pods(core, documents)
            return bool(pods) and all(p is not None and p.status.phase in ("Running", "Succeeded") for p in pods)

        try:
            wait_until(f"the pods of {path.name} running", all_running, timeout_s=120)
        except AssertionError as err:
            events = [e for p in example_pods(core, documents) if p for e in pod_events(core, p.metadata.name)]
            raise AssertionError(f"{err}; events: {events}") from None
        jobs = [d for d in documents if d["kind"] == "Job"]
        if jobs:
            assert len(placed_by_the_controller(kubernetes.client.ResourceV1Api(client))) == sum(
                d["spec"]["parallelism"] for d in jobs
            )
        batch = kubernetes.client.BatchV1Api(client)
        for job in jobs:
            name, completions = job["metadata"]["name"], job["spec"]["completions"]
            wait_until(f"job {name} complete", lambda n=name, c=completions: read_succeeded(batch, n) == c)
    finally:
        delete_example(cluster, client, documents)


def read_succeeded(batch: kubernetes.client.BatchV1Api, name: str) -> int:
    return batch.read_namespaced_job(name, NS).status.succeeded or 0


# --- upgrade and uninstall ----------------------------------------------------------------------


def shared_pods(cluster: Cluster, node: RealNode) -> list[str]:
    """A MIG, an MPS and a time-sliced pod on GPUs of their own."""
    return [
        claim_pod(cluster, node, "mig.gpu.fgpu.dev", selector='device.attributes["gpu.fgpu.dev"].profile == "1g.10gb"'),
        claim_pod(cluster, node, "mps.gpu.fgpu.dev", selector=ON_GPU.format(6), capacity={"memory": "4Gi"}),
        claim_pod(cluster, node, "timeslice.gpu.fgpu.dev", selector=ON_GPU.format(7)),
    ]


def mps_daemons(release: Release) -> dict[str, int]:
    """GPU UUID -> pid of its running MPS control daemon, from the plugin's records in the state dir
    (partitioner/mps.py: the daemon it started, never a file in the tenants' pipe directory)."""
    running = {}
    for record in Path(str(release.values["kubeletPlugin.stateDir"])).glob(f"mps/*/{IDENTITY_FILE}"):
        with contextlib.suppress(OSError):
            identity = DaemonIdentity.parse(record.read_text())
            if identity is not None and identity.alive():
                running[record.parent.name] = identity.pid
    return running


def test_upgrade_to_a_new_tag_keeps_pods_and_prepares_new_claims(cluster, real_node, release: Release) -> None:
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    running = shared_pods(cluster, real_node)
    before = container_ids(core, running)
    daemons = mps_daemons(release)
    assert len(daemons) == 1, daemons
    (old,) = release.plugin_pods()
    certificates = webhook_secret(cluster)
    upgrade = release.start_helm(*release.upgrade_command(TAGS[1]))
    try:
        # During the rollout: a new plugin pod beside the old one, and a claim prepared meanwhile.
        wait_until("a second plugin pod", lambda: len(release.plugin_pods()) == 2)
        during = claim_pod(cluster, real_node, "mps.gpu.fgpu.dev", wait=False, selector=ON_GPU.format(6))
        output, _ = upgrade.communicate(timeout=300)
    finally:
        if upgrade.poll() is None:
            upgrade.kill()
    assert upgrade.returncode == 0, output
    # helm's --wait ends when the new pod is ready; the old one may still be stopping.
    new = wait_until("the old plugin pod gone", release.single_plugin_pod)
    assert new.metadata.uid != old.metadata.uid and new.spec.containers[0].image == f"{REPOSITORY}:{TAGS[1]}"
    assert container_ids(core, running) == before  # not restarted, not replaced
    daemons_after = mps_daemons(release)
    after = claim_pod(cluster, real_node, "mig.gpu.fgpu.dev", selector=ON_GPU.format(5))
    # A prepare that reached the old plugin as it stopped fails ("broken pipe" on its socket) and
    # kubelet retries it only at the pod's next periodic sync, a minute or two later: the plugin
    # stops serving before kubelet has dropped its registration (no drain on SIGTERM yet).
    wait_until(f"pod {during} running", lambda: core.read_namespaced_pod(during, NS).status.phase == "Running",
               timeout_s=240)  # fmt: skip
    container_ids(core, [during, after])
    # The MPS daemon joined the host init's cgroups (hostPID), so it outlived the old plugin's container.
    assert daemons_after == daemons
    # The webhook's Secret is its own, not the release's: the new pod serves the same certificate.
    assert webhook_secret(cluster) == certificates


def test_uninstall_leaves_prepared_pods_alone(cluster, real_node, release: Release) -> None:
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    running = shared_pods(cluster, real_node)
    before = container_ids(core, running)
    specs = sorted(p.name for p in real_node.cdi_dir.glob("*.json"))
    release.helm("uninstall", RELEASE, "--wait", "--timeout=2m")
    wait_until("the plugin gone", lambda: not release.plugin_pods())
    time.sleep(5)  # long enough for anything the plugin's exit might have undone to show
    assert container_ids(core, running) == before
    assert sorted(p.name for p in real_node.cdi_dir.glob("*.json")) == specs
    # Installed again, the plugin takes the prepared claims over and unprepares them as pods go.
    release.install()
    for name in running:
        core.delete_namespaced_pod(name, NS, grace_period_seconds=1)
    wait_until("pods gone", lambda: not any(p.metadata.name in running for p in core.list_namespaced_pod(NS).items))
    wait_until("their CDI specs removed", lambda: len(list(real_node.cdi_dir.glob("*.json"))) < len(specs))
