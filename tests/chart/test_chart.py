"""The Helm chart: lint, what it renders for the values users set, and the rendered manifests under
daemonset/ match it (daemonset/render.sh). The apiserver's verdict on them: tests/e2e/test_install_manifests.py."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from driver.admission.lifetimes import Lifetimes
from driver.admission.settings import webhook_settings
from driver.cli.main import build_parser
from driver.controller.emptying import EMPTYING_TAINT
from driver.node.health.taints import HealthPolicy
from driver.node.kubelet.liveness import READY_SERVICE
from driver.node.settings import health_policy, sharing_config
from tests.support.chart import (
    CHART,
    KUBE_VERSION,
    RENDER,
    ROOT,
    container_env,
    find,
    helm,
    helm_binary,
    render,
    set_flags,
)

pytestmark = pytest.mark.go  # helm, or go for the pause image: see tests/conftest.py

MOCK = {"nvml": "mock:dgx-h100"}
CERT_MANAGER_MODULE, CERT_MANAGER_VERSION = "github.com/cert-manager/cert-manager", "v1.21.2"


def test_lint_default_and_mock_values() -> None:
    helm("lint", "--strict", str(CHART))
    helm("lint", "--strict", str(CHART), "--set", "nvml=mock:dgx-h100", "--set", "controller.enabled=false")


def test_rendered_manifests_match_the_chart(tmp_path: Path) -> None:
    subprocess.run([str(RENDER), str(tmp_path)], check=True, env={**os.environ, "HELM": str(helm_binary())})
    for name in ("plugin.yaml", "controller.yaml", "deviceclasses.yaml", "webhook.yaml"):
        checked_in = (ROOT / "daemonset" / name).read_text()
        assert checked_in == (tmp_path / name).read_text(), f"daemonset/{name} is stale: run daemonset/render.sh"


def test_rendered_manifests_parse_without_empty_documents() -> None:
    for path in sorted((ROOT / "daemonset").glob("*.yaml")):
        documents = list(yaml.safe_load_all(path.read_text()))
        assert documents and all(isinstance(d, dict) and d.get("kind") for d in documents), path


def test_daemonset_for_rolling_updates_and_kubelet() -> None:
    daemonset = find(render(), "DaemonSet")
    spec = daemonset["spec"]["template"]["spec"]
    assert daemonset["spec"]["updateStrategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    env = container_env(daemonset)
    assert env["POD_UID"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert spec["hostPID"] is True and "hostNetwork" not in spec
    container = spec["containers"][0]
    assert container["securityContext"]["privileged"] is True
    assert container["livenessProbe"]["grpc"]["port"] == int(env["HEALTHCHECK_PORT"])
    # Ready once kubelet registered it (driver/node/kubelet/liveness.py READY_SERVICE): no gap in an update.
    assert container["readinessProbe"]["grpc"] == {"port": int(env["HEALTHCHECK_PORT"]), "service": READY_SERVICE}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    # kubelet dials the socket path the plugin registers: mounted where the host has it.
    for name in ("plugins-registry", "plugins", "cdi", "state"):
        assert mounts[name]["mountPath"] == volumes[name]
    assert mounts["state"]["mountPropagation"] == "Bidirectional"
    assert env["PLUGIN_DIR"] == "/var/lib/kubelet/plugins/gpu.fgpu.dev"
    assert (env["DRIVER_ROOT"], env["HOST_DRIVER_ROOT"]) == ("/driver-root", "/")
    assert volumes["driver-root"] == "/"


def test_every_workload_requests_what_it_was_measured_to_use() -> None:
    """The plugin, which every GPU pod on its node needs, is scheduled and kept before other pods;
    each workload requests memory and CPU near its measured footprint (values.yaml says which); the
    plugin's and the webhook's memory is capped, the controller's grows with the cluster; no CPU is
    throttled."""
    objects = render()
    plugin = find(objects, "DaemonSet")["spec"]["template"]["spec"]
    assert plugin["priorityClassName"] == "system-node-critical"
    limits = {"plugin": {"memory"}, "controller": set(), "webhook": {"memory"}}
    workloads = [plugin] + [
        find(objects, "Deployment", name)["spec"]["template"]["spec"] for name in limits if name != "plugin"
    ]
    for name, workload in zip(limits, workloads, strict=True):
        resources = workload["containers"][0]["resources"]
        assert set(resources["requests"]) == {"cpu", "memory"}, name
        assert set(resources.get("limits", {})) == limits[name], name


def test_default_affinity_takes_gfd_or_nfd_labelled_nodes() -> None:
    terms = find(render(), "DaemonSet")["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    keys = [
        t["matchExpressions"][0]["key"]
        for t in terms["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    ]
    assert keys == ["nvidia.com/gpu.present", "feature.node.kubernetes.io/pci-10de.present"]


def test_mock_nvml_has_no_driver_root_mount() -> None:
    daemonset = find(render(MOCK), "DaemonSet")
    env = container_env(daemonset)
    assert env["NVML"] == "mock:dgx-h100" and "DRIVER_ROOT" not in env
    assert "driver-root" not in {v["name"] for v in daemonset["spec"]["template"]["spec"]["volumes"]}


def test_one_image_for_plugin_controller_and_webhook() -> None:
    objects = render({"image.repository": "registry.example/fgpu", "image.tag": "1.2.3"})
    images = {
        find(objects, kind, name)["spec"]["template"]["spec"]["containers"][0]["image"]
        for kind, name in (("DaemonSet", ""), ("Deployment", "controller"), ("Deployment", "webhook"))
    }
    assert images == {"registry.example/fgpu:1.2.3"}
    default = render()
    assert find(default, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":0.1.0")


def test_api_server_address_for_host_network_pods() -> None:
    objects = render({"apiServer.host": "127.0.0.1", "apiServer.port": "6443", "kubeletPlugin.hostNetwork": True})
    for kind, name in (("DaemonSet", ""), ("Deployment", "controller")):
        env = container_env(find(objects, kind, name))
        assert (env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"]) == ("127.0.0.1", "6443")
    assert find(objects, "DaemonSet")["spec"]["template"]["spec"]["hostNetwork"] is True
    with pytest.raises(AssertionError, match="go together"):
        render({"apiServer.host": "127.0.0.1"})


def test_shares_inside_mig_partitions_reach_the_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = find(render({"offer": ["mig", "mig-mps"], "migShareProfiles": ["3g.40gb", "7g.80gb"]}), "DaemonSet")
    for name, value in container_env(plugin).items():
        if isinstance(value, str):
            monkeypatch.setenv(name, value)
    args = build_parser().parse_args([*plugin["spec"]["template"]["spec"]["containers"][0]["args"], "--node-name=n"])
    sharing = sharing_config(args)
    assert sharing.default == {"mig", "mig-mps"} and sharing.mig_share_profiles == {"3g.40gb", "7g.80gb"}
    assert "MIG_SHARE_PROFILES" not in container_env(find(render(), "DaemonSet"))


def test_sharing_config_becomes_a_mounted_file() -> None:
    sharing = {"gpus": [{"index": 0, "offer": ["mig"]}]}
    objects = render({"sharing": sharing, "offer": ["whole", "mps"]})
    config = find(objects, "ConfigMap", "sharing")
    assert yaml.safe_load(config["data"]["sharing.yaml"]) == sharing
    env = container_env(find(objects, "DaemonSet"))
    assert (env["SHARING_CONFIG"], env["OFFER"]) == ("/etc/fgpu/sharing.yaml", "whole,mps")
    plain = find(render(), "DaemonSet")["spec"]["template"]["metadata"]["annotations"]["checksum/sharing"]
    assert find(objects, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]["checksum/sharing"] != plain


def test_controller_non_root_with_lease_in_release_namespace() -> None:
    objects = render({"controller.policy": "spread"}, namespace="gpus")
    deployment = find(objects, "Deployment", "controller")
    spec = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 2
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    args = spec["containers"][0]["args"]
    assert "--lease-namespace=gpus" in args and "--policy=spread" in args
    # Replicas on one node's network share host name and pid: the Lease needs the pod's name.
    assert "--identity=$(POD_NAME)" in args
    assert container_env(deployment)["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert find(objects, "Role", "controller")["metadata"]["namespace"] == "gpus"
    without = render({"controller.enabled": False})
    assert not [o for o in without if "controller" in o["metadata"]["name"]]


def test_making_room_is_off_unless_enabled_and_then_may_evict() -> None:
    def controller(values: dict) -> tuple[list[str], set[tuple[str, str]]]:
        objects = render(values)
        args = find(objects, "Deployment", "controller")["spec"]["template"]["spec"]["containers"][0]["args"]
        role = find(objects, "ClusterRole", "controller")
        granted = {(r, v) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}
        return args, granted

    args, granted = controller({})
    assert not [a for a in args if "room" in a or "evictions" in a]
    assert ("pods/eviction", "create") not in granted and ("pods", "delete") not in granted
    args, granted = controller({"controller.makeRoom.enabled": True, "controller.makeRoom.evictionsPerMinute": 3})
    assert "--make-room" in args and "--evictions-per-minute=3" in args and "--compact-when-idle" not in args
    assert ("pods/eviction", "create") in granted and ("pods", "delete") not in granted
    args, granted = controller({"controller.makeRoom.enabled": True, "controller.makeRoom.compactWhenIdle": True})
    assert "--compact-when-idle" in args and "--empty-nodes" not in args and ("nodes", "patch") not in granted
    args, granted = controller({"controller.makeRoom.enabled": True, "controller.makeRoom.compactWhenIdle": True,
                                "controller.makeRoom.emptyNodes": True})  # fmt: skip
    assert "--empty-nodes" in args and ("nodes", "patch") in granted


def test_the_controller_may_patch_pod_status_to_mark_pods_unschedulable_and_no_more() -> None:
    role = find(render({}), "ClusterRole", "controller")
    status = {verb for rule in role["rules"] if "pods/status" in rule["resources"] for verb in rule["verbs"]}
    assert status == {"patch"}  # the PodScheduled condition of its gated pods (docs/autoscaling.md)


def plugin_rules(objects: list[dict[str, Any]]) -> dict[tuple[str, ...], set[str]]:
    role = find(objects, "ClusterRole", "kubelet-plugin")
    return {
        (rule["apiGroups"][0], resource, *rule.get("resourceNames", [])): set(rule["verbs"])
        for rule in role["rules"]
        for resource in rule["resources"]
    }


def test_plugin_rbac_is_least_privilege() -> None:
    objects = render({"driverName": "gpu.example.com"})
    assert plugin_rules(objects) == {
        # list: the claims allocated to its node name the pods that wait for it (retryWaitingPods)
        ("resource.k8s.io", "resourceclaims"): {"get", "list"},
        # status.devices by a PUT of the status, of this driver's entries, on claims of its own node only
        ("resource.k8s.io", "resourceclaims/status"): {"update"},
        ("resource.k8s.io", "resourceclaims/driver", "gpu.example.com"): {"associated-node:update"},
        ("resource.k8s.io", "resourceslices"): {"get", "list", "watch", "create", "update", "delete"},
        ("", "nodes"): {"get"},
        ("", "events"): {"create"},  # a refused status write, on its claim; a retried prepare, on its pod
        # patch: the prepare-retry annotation only, on its node's pods (the policy below); get: the first
        # pod of each claim it prepared, once, for the usage history's owner and template
        ("", "pods"): {"get", "patch"},
    }
    # The usage history: its node's ConfigMap, in the driver's namespace only (docs/rightsizing.md).
    role = find(objects, "Role", "kubelet-plugin")
    assert role["metadata"]["namespace"] == "fgpu-system"
    assert [(r["apiGroups"], r["resources"], set(r["verbs"])) for r in role["rules"]] == [
        ([""], ["configmaps"], {"get", "create", "update"})
    ]
    binding = find(objects, "RoleBinding", "kubelet-plugin")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    history_namespace = container_env(find(objects, "DaemonSet"))["USAGE_HISTORY_NAMESPACE"]
    assert history_namespace == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    slices = find(objects, "ValidatingAdmissionPolicy", "own-slices")
    assert slices["spec"]["matchConstraints"]["resourceRules"][0]["resources"] == ["resourceslices"]
    pods = find(objects, "ValidatingAdmissionPolicy", "retry-annotation")
    assert {"name": "key", "expression": "'gpu.example.com/prepare-retry'"} in pods["spec"]["variables"]
    assert container_env(find(objects, "DaemonSet"))["RETRY_WAITING_PODS"] == "true"
    for policy in plugin_policies(render(namespace="gpus")):
        condition = policy["spec"]["matchConditions"][0]["expression"]
        assert '"system:serviceaccount:gpus:fgpu-kubelet-plugin"' in condition


def test_without_prepare_retries_the_plugin_neither_lists_claims_nor_patches_pods() -> None:
    objects = render({"kubeletPlugin": {"retryWaitingPods": False}})
    rules = plugin_rules(objects)
    assert rules[("resource.k8s.io", "resourceclaims")] == {"get"} and rules[("", "pods")] == {"get"}
    assert [p["metadata"]["name"] for p in plugin_policies(objects)] == ["fgpu-kubelet-plugin-own-slices"]
    assert container_env(find(objects, "DaemonSet"))["RETRY_WAITING_PODS"] == "false"


def find_all(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def plugin_policies(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The admission policies that bound the plugin (the webhook has its own)."""
    policies = find_all(objects, "ValidatingAdmissionPolicy")
    return [p for p in policies if p["metadata"]["name"].startswith("fgpu-kubelet-plugin-")]


def test_device_classes_follow_the_driver_name() -> None:
    classes = [o for o in render({"driverName": "gpu.example.com"}) if o["kind"] == "DeviceClass"]
    assert [c["metadata"]["name"] for c in classes] == [
        "gpu.example.com",
        "mig.gpu.example.com",
        "mps.gpu.example.com",
        "timeslice.gpu.example.com",
        "mig-mps.gpu.example.com",
        "mig-timeslice.gpu.example.com",
    ]
    assert all('device.driver == "gpu.example.com"' in c["spec"]["selectors"][0]["cel"]["expression"] for c in classes)


def test_log_format_feature_gates_and_lease_timings_reach_the_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    objects = render(
        {
            "logFormat": "json",
            "featureGates": {"ConsumableCapacity": False},
            "controller.leaderElection": {"leaseDuration": 30, "renewDeadline": 20, "retryPeriod": 4},
        }
    )
    plugin = find(objects, "DaemonSet")
    for name, value in container_env(plugin).items():
        if isinstance(value, str):
            monkeypatch.setenv(name, value)
    args = build_parser().parse_args([*plugin["spec"]["template"]["spec"]["containers"][0]["args"], "--node-name=n"])
    assert args.log_format == "json"
    assert sharing_config(args).default == {"whole", "mig"}  # the gate took the shares away
    assert health_policy(args) == HealthPolicy(recovery_s=300)  # the chart's health values are the defaults

    container = find(objects, "Deployment", "controller")["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(container["args"])
    timings = (args.leader_elect_lease_duration, args.leader_elect_renew_deadline, args.leader_elect_retry_period)
    assert (args.log_format, timings) == ("json", (30, 20, 4))


def test_plugin_metrics_port_reaches_the_flag_and_a_container_port(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = find(render({"kubeletPlugin.metricsPort": 9555}), "DaemonSet")
    container = plugin["spec"]["template"]["spec"]["containers"][0]
    assert container["ports"] == [{"name": "metrics", "containerPort": 9555}]
    for name, value in container_env(plugin).items():
        if isinstance(value, str):
            monkeypatch.setenv(name, value)
    assert build_parser().parse_args([*container["args"], "--node-name=n"]).metrics_port == 9555
    off = find(render({"kubeletPlugin.metricsPort": 0}), "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    assert "ports" not in off and "METRICS_PORT" not in {e["name"] for e in off["env"]}
    # On the node's network a declared port is a host port: the surge pod of an update would not fit.
    host = find(render({"kubeletPlugin.hostNetwork": True}), "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    assert "ports" not in host and {"name": "METRICS_PORT", "value": "9410"} in host["env"]


def test_plugin_metrics_name_no_tenant_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    for values, tenant_labels in (({}, False), ({"kubeletPlugin.metricsTenantLabels": True}, True)):
        plugin = find(render(values), "DaemonSet")
        with monkeypatch.context() as env:
            for name, value in container_env(plugin).items():
                if isinstance(value, str):
                    env.setenv(name, value)
            args = plugin["spec"]["template"]["spec"]["containers"][0]["args"]
            assert build_parser().parse_args([*args, "--node-name=n"]).metrics_tenant_labels is tenant_labels


def test_grafana_dashboard_is_an_opt_in_labelled_config_map() -> None:
    assert not [o for o in render() if "dashboard" in o["metadata"]["name"]]
    config = find(render({"metrics.dashboard.enabled": True}), "ConfigMap", "dashboard")
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config["data"]["fgpu.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "fgpu.json").read_text())
    assert all(target["expr"] for panel in dashboard["panels"] for target in panel["targets"])


def test_device_classes_carry_extended_resource_names() -> None:
    classes = {o["metadata"]["name"]: o["spec"] for o in render() if o["kind"] == "DeviceClass"}
    assert classes["gpu.fgpu.dev"]["extendedResourceName"] == "nvidia.com/gpu"
    assert not [name for name, spec in classes.items() if name != "gpu.fgpu.dev" and "extendedResourceName" in spec]
    profiles = render(
        {"deviceClasses.extendedResourceName": "", "deviceClasses.migProfiles": {"1g.10gb": "nvidia.com/mig-1g.10gb"}}
    )
    classes = {o["metadata"]["name"]: o["spec"] for o in profiles if o["kind"] == "DeviceClass"}
    assert "extendedResourceName" not in classes["gpu.fgpu.dev"]
    mig = classes["mig-1g.10gb.gpu.fgpu.dev"]
    assert mig["extendedResourceName"] == "nvidia.com/mig-1g.10gb"
    assert mig["selectors"][0]["cel"]["expression"].endswith('.profile == "1g.10gb"')


WEBHOOK_MODES = {
    "self-managed": {},
    "cert-manager": {"webhook.certManager.enabled": True},
    "cert-manager, own issuer": {
        "webhook.certManager.enabled": True,
        "webhook.certManager.issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"},
    },
    "existing Secret": {"webhook.tls.existingSecret": "corp-tls"},
    "existing Secret and CA": {"webhook.tls.existingSecret": "corp-tls", "webhook.tls.caBundle": "Q0EK"},
}


@pytest.mark.parametrize("values", list(WEBHOOK_MODES.values()), ids=list(WEBHOOK_MODES))
def test_the_same_values_render_the_same_bytes(values: dict[str, object]) -> None:
    # GitOps tools render on every sync: no certificate made, no lookup, nothing random.
    flags = ["--namespace", "gpus", "--kube-version", KUBE_VERSION, *set_flags(values)]
    first, second = (helm("template", "fgpu", str(CHART), *flags) for _ in range(2))
    assert first == second
    assert "PRIVATE KEY" not in first and "BEGIN CERTIFICATE" not in first


def webhook_args(objects: list[dict[str, Any]]) -> argparse.Namespace:
    container = find(objects, "Deployment", "webhook")["spec"]["template"]["spec"]["containers"][0]
    return build_parser().parse_args(container["args"])


def rbac_rules(objects: list[dict[str, Any]], kind: str, name: str) -> set[tuple[str, ...]]:
    role = find(objects, kind, name)
    return {
        (rule["apiGroups"][0], resource, verb, *rule.get("resourceNames", []))
        for rule in role["rules"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


# Gating pods: one get of the claim or template a pod names, at its create; no list, no watch, no write.
GATE_READS = {("resource.k8s.io", "resourceclaims", "get"), ("resource.k8s.io", "resourceclaimtemplates", "get")}
CA_WRITES = {
    ("admissionregistration.k8s.io", resource, verb, "fgpu-webhook")
    for resource in ("validatingwebhookconfigurations", "mutatingwebhookconfigurations")
    for verb in ("get", "patch")
}


def test_self_managed_webhook_keeps_its_own_certificate_with_least_privilege() -> None:
    objects = render({"webhook.failurePolicy": "Fail", "driverName": "gpu.example.com"}, namespace="gpus")
    args = webhook_args(objects)
    settings = webhook_settings(args)
    settings.check()  # the flags go together, as fgpu webhook checks them
    assert (settings.driver_name, settings.port, settings.tls_secret) == ("gpu.example.com", 8443, "fgpu-webhook-certs")
    assert settings.namespace == "gpus" and settings.webhook_configuration == "fgpu-webhook"
    assert settings.gate_pods and settings.mutating_configuration == "fgpu-webhook"
    service = find(objects, "Service", "webhook")
    assert f"{service['metadata']['name']}.gpus.svc" in settings.hosts  # the name kube-apiserver dials
    assert settings.lifetimes == Lifetimes(8760 * 3600, 720 * 3600, 87600 * 3600)
    assert 0.5 <= settings.check_interval_s <= 10
    spec = find(objects, "Deployment", "webhook")["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "fgpu-webhook" and spec["automountServiceAccountToken"] is True
    assert "volumes" not in spec and spec["securityContext"]["runAsNonRoot"] is True
    assert "checksum/tls" not in (spec.get("annotations") or {})
    assert not [o for o in objects if o["kind"] == "Secret"]  # the webhook makes it; nothing to render
    configuration = find(objects, "ValidatingWebhookConfiguration")
    assert [w["name"] for w in configuration["webhooks"]] == [
        "resourceclaims.gpu.example.com",
        "resourceclaimtemplates.gpu.example.com",
        "deviceclasses.gpu.example.com",
    ]
    for webhook in configuration["webhooks"]:
        assert webhook["failurePolicy"] == "Fail" and "caBundle" not in webhook["clientConfig"]
        assert webhook["clientConfig"]["service"] == {
            "name": service["metadata"]["name"], "namespace": "gpus", "path": "/validate", "port": 443
        }  # fmt: skip
        assert '== "gpu.example.com"' in webhook["matchConditions"][0]["expression"]
    # Its own configurations' caBundle, the claims and templates pods name, and its own Secret
    # (create cannot be held to a name).
    assert rbac_rules(objects, "ClusterRole", "webhook") == CA_WRITES | GATE_READS
    assert rbac_rules(objects, "Role", "webhook") == {
        ("", "secrets", "get", "fgpu-webhook-certs"),
        ("", "secrets", "update", "fgpu-webhook-certs"),
        ("", "secrets", "create"),
    }
    assert find(objects, "Role", "webhook")["metadata"]["namespace"] == "gpus"
    bindings = [
        o for o in objects if o["kind"] in ("ClusterRoleBinding", "RoleBinding") and "webhook" in o["metadata"]["name"]
    ]
    assert len(bindings) == 2
    assert all(
        b["subjects"] == [{"kind": "ServiceAccount", "name": "fgpu-webhook", "namespace": "gpus"}] for b in bindings
    )
    assert not [o for o in render({"webhook.enabled": False}) if "webhook" in o["metadata"]["name"]]


def test_the_webhook_may_patch_nothing_of_its_configurations_but_the_caBundle() -> None:
    objects = render(namespace="gpus")
    policy = find(objects, "ValidatingAdmissionPolicy", "webhook-ca-bundle-only")["spec"]
    assert policy["failurePolicy"] == "Fail"
    (rule,) = policy["matchConstraints"]["resourceRules"]
    assert set(rule["resources"]) == {"validatingwebhookconfigurations", "mutatingwebhookconfigurations"}
    assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    (who,) = policy["matchConditions"]
    assert who["expression"] == 'request.userInfo.username == "system:serviceaccount:gpus:fgpu-webhook"'
    compared = policy["validations"][1]["expression"]
    for field in ("service", "url", "rules", "failurePolicy", "namespaceSelector", "objectSelector", "matchConditions"):
        assert f"o.clientConfig.?{field} == w" in compared or f"o.?{field} == w.?{field}" in compared, field
    assert "caBundle" not in compared
    binding = find(objects, "ValidatingAdmissionPolicyBinding", "webhook-ca-bundle-only")["spec"]
    assert binding == {"policyName": "fgpu-webhook-ca-bundle-only", "validationActions": ["Deny"]}
    for mode in ("cert-manager", "existing Secret and CA"):  # the webhook writes no caBundle there
        assert not [o for o in render(WEBHOOK_MODES[mode]) if o["metadata"]["name"] == "fgpu-webhook-ca-bundle-only"]


def test_only_kube_apiservers_client_certificate_gets_reviews_once_its_ca_is_given() -> None:
    assert webhook_args(render()).client_ca_file is None
    objects = render({"webhook.clientAuth.caBundle": "Q0EK"})
    assert str(webhook_args(objects).client_ca_file) == "/client-ca/ca.crt"
    assert find(objects, "ConfigMap", "webhook-client-ca")["binaryData"] == {"ca.crt": "Q0EK"}
    spec = find(objects, "Deployment", "webhook")["spec"]["template"]
    assert {"name": "client-ca", "configMap": {"name": "fgpu-webhook-client-ca"}} in spec["spec"]["volumes"]
    mounts = spec["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "client-ca", "mountPath": "/client-ca", "readOnly": True} in mounts
    assert "gpu.fgpu.dev/client-ca-sha256" in spec["metadata"]["annotations"]  # a new CA rolls the pods


def test_webhook_on_the_nodes_network_reaches_an_explicit_api_server() -> None:
    objects = render({"webhook.hostNetwork": True, "apiServer.host": "127.0.0.1", "apiServer.port": "6443"})
    deployment = find(objects, "Deployment", "webhook")
    assert deployment["spec"]["template"]["spec"]["hostNetwork"] is True
    # Its port is the node's: a new pod of an update could not start beside the old one.
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert "strategy" not in find(render(), "Deployment", "webhook")["spec"]
    env = container_env(deployment)
    assert (env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"]) == ("127.0.0.1", "6443")


@pytest.mark.parametrize("component", ["controller", "webhook"])
def test_replicas_are_spread_and_kept_up_through_voluntary_disruptions(component: str) -> None:
    """Drains and autoscalers (Eviction API) take one replica at a time: a PodDisruptionBudget over
    exactly the Deployment's pods; the replicas spread over nodes where they can be. Both optional."""
    objects = render()
    deployment = find(objects, "Deployment", component)
    budget = find(objects, "PodDisruptionBudget", component)
    assert budget["spec"] == {"maxUnavailable": 1, "selector": deployment["spec"]["selector"]}
    (spread,) = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["labelSelector"] == deployment["spec"]["selector"]
    assert (spread["topologyKey"], spread["whenUnsatisfiable"]) == ("kubernetes.io/hostname", "ScheduleAnyway")
    off = render({f"{component}.maxUnavailable": 0, f"{component}.spreadAcrossNodes": False})
    assert not [o for o in off if o["kind"] == "PodDisruptionBudget" and component in o["metadata"]["name"]]
    assert "topologySpreadConstraints" not in find(off, "Deployment", component)["spec"]["template"]["spec"]


def test_cert_manager_mode_issues_the_certificate_and_injects_its_ca() -> None:
    objects = render(WEBHOOK_MODES["cert-manager"], namespace="gpus")
    for kind in ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"):
        configuration = find(objects, kind)
        assert configuration["metadata"]["annotations"] == {"cert-manager.io/inject-ca-from": "gpus/fgpu-webhook"}
        assert all("caBundle" not in w["clientConfig"] for w in configuration["webhooks"])
    serving = next(o for o in objects if o["kind"] == "Certificate" and o["metadata"]["name"] == "fgpu-webhook")
    assert serving["spec"]["secretName"] == "fgpu-webhook-tls"
    assert serving["spec"]["dnsNames"] == ["fgpu-webhook", "fgpu-webhook.gpus", "fgpu-webhook.gpus.svc"]
    assert (serving["spec"]["duration"], serving["spec"]["renewBefore"]) == ("8760h", "720h")
    # A self-signed Issuer makes the CA; a CA Issuer signs with it: a renewal keeps the caBundle valid.
    ca = find(objects, "Certificate", "-ca")
    assert ca["spec"]["isCA"] is True and ca["spec"]["issuerRef"]["name"] == "fgpu-webhook-selfsigned"
    issuers = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "Issuer"}
    assert issuers == {
        "fgpu-webhook-selfsigned": {"selfSigned": {}},
        "fgpu-webhook-ca": {"ca": {"secretName": "fgpu-webhook-ca"}},
    }
    assert serving["spec"]["issuerRef"] == {"name": "fgpu-webhook-ca", "kind": "Issuer", "group": "cert-manager.io"}
    # The webhook reads the mounted Secret (again when cert-manager renews it); its API access is
    # only the reads of gating pods (none without them).
    args = webhook_args(objects)
    assert (str(args.tls_cert_file), str(args.tls_private_key_file), args.tls_secret) == (
        "/tls/tls.crt",
        "/tls/tls.key",
        "",
    )
    assert args.gate_pods and (args.webhook_configuration, args.mutating_webhook_configuration) == ("", "")
    spec = find(objects, "Deployment", "webhook")["spec"]["template"]["spec"]
    assert spec["volumes"] == [{"name": "tls", "secret": {"secretName": "fgpu-webhook-tls"}}]
    assert spec["automountServiceAccountToken"] is True
    assert rbac_rules(objects, "ClusterRole", "webhook") == GATE_READS
    assert not [o for o in objects if o["kind"] == "Role" and "webhook" in o["metadata"]["name"]]
    ungated = render({**WEBHOOK_MODES["cert-manager"], "webhook.gatePods.enabled": False})
    assert find(ungated, "Deployment", "webhook")["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert not [o for o in ungated if o["kind"] in ("Role", "ClusterRole") and "webhook" in o["metadata"]["name"]]

    own = render(WEBHOOK_MODES["cert-manager, own issuer"])
    assert [o["metadata"]["name"] for o in own if o["kind"] in ("Issuer", "Certificate")] == ["fgpu-webhook"]
    assert find(own, "Certificate")["spec"]["issuerRef"] == {
        "name": "corp-ca",
        "kind": "ClusterIssuer",
        "group": "cert-manager.io",
    }


def test_an_operators_secret_with_or_without_its_ca() -> None:
    given = render(WEBHOOK_MODES["existing Secret and CA"])
    for kind in ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"):
        assert {w["clientConfig"]["caBundle"] for w in find(given, kind)["webhooks"]} == {"Q0EK"}
    spec = find(given, "Deployment", "webhook")["spec"]["template"]["spec"]
    assert spec["volumes"] == [{"name": "tls", "secret": {"secretName": "corp-tls"}}]
    assert webhook_args(given).ca_bundle_file is None and webhook_args(given).mutating_webhook_configuration == ""
    assert rbac_rules(given, "ClusterRole", "webhook") == GATE_READS  # only the reads of gating pods
    assert not [o for o in given if o["kind"] in ("Role", "Secret") and "webhook" in o["metadata"]["name"]]
    # Without the CA as a value, the webhook copies the Secret's ca.crt into the caBundle itself.
    read = render(WEBHOOK_MODES["existing Secret"])
    args = webhook_args(read)
    assert (str(args.ca_bundle_file), args.webhook_configuration) == ("/tls/ca.crt", "fgpu-webhook")
    assert args.mutating_webhook_configuration == "fgpu-webhook"
    webhook_settings(args).check()
    assert rbac_rules(read, "ClusterRole", "webhook") == CA_WRITES | GATE_READS
    assert not [o for o in read if o["kind"] == "Role" and "webhook" in o["metadata"]["name"]]  # no Secrets


def test_pods_of_opt_in_claims_are_gated_by_a_mutating_webhook_for_pods_with_claims_only() -> None:
    objects = render({"webhook.gatePods.failurePolicy": "Fail", "webhook.timeoutSeconds": 3}, namespace="gpus")
    (webhook,) = find(objects, "MutatingWebhookConfiguration")["webhooks"]
    assert webhook["name"] == "pods.gpu.fgpu.dev" and webhook["sideEffects"] == "None"
    assert (webhook["failurePolicy"], webhook["timeoutSeconds"], webhook["reinvocationPolicy"]) == ("Fail", 3, "Never")
    assert webhook["clientConfig"] == {
        "service": {"name": "fgpu-webhook", "namespace": "gpus", "path": "/mutate", "port": 443}
    }
    assert webhook["rules"] == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}
    ]
    assert webhook["matchConditions"] == [{
        "name": "has-resource-claims",
        "expression": "has(object.spec.resourceClaims) && size(object.spec.resourceClaims) > 0",
    }]  # fmt: skip
    assert find(render(), "MutatingWebhookConfiguration")["webhooks"][0]["failurePolicy"] == "Ignore"
    # The controller lifts the gate: without it (or with gatePods off) no pod is gated, nothing read.
    for values in ({"controller.enabled": False}, {"webhook.gatePods.enabled": False}):
        off = render(values)
        assert not [o for o in off if o["kind"] == "MutatingWebhookConfiguration"]
        args = webhook_args(off)
        assert not args.gate_pods and args.mutating_webhook_configuration == ""
        assert rbac_rules(off, "ClusterRole", "webhook") == {r for r in CA_WRITES if "validating" in r[1]}


def test_a_toleration_of_nodes_kept_for_gpu_pods_is_added_by_the_pods_webhook_with_or_without_the_controller() -> None:
    key = "gpu.fgpu.dev/gpu-pods-only"
    for values in ({"controller.enabled": False}, {"webhook.gatePods.enabled": False}, {}):
        objects = render({**values, "webhook.gpuPodsToleration": key})
        (webhook,) = find(objects, "MutatingWebhookConfiguration")["webhooks"]
        assert webhook["name"] == "pods.gpu.fgpu.dev" and webhook["clientConfig"]["service"]["path"] == "/mutate"
        args = webhook_args(objects)
        assert args.gpu_pods_toleration == key and args.gate_pods == (values == {})
        assert webhook_settings(args).gpu_pods_toleration == key
        assert rbac_rules(objects, "ClusterRole", "webhook") == CA_WRITES | GATE_READS
    assert webhook_args(render()).gpu_pods_toleration == ""


def test_the_plugin_tolerates_fgpus_own_node_taints() -> None:
    """The plugin runs where the controller empties a node (its pods' claims are unprepared there)
    and on the nodes kept for pods with GPUs: a plugin pod made again there (a rollout, a new node
    an autoscaler adds already tainted) must not be kept off by the taint the pods it serves tolerate."""
    key = "gpu.fgpu.dev/gpu-pods-only"

    def tolerated(values: dict[str, Any]) -> set[tuple[str, str, str]]:
        spec = find(render(values), "DaemonSet")["spec"]["template"]["spec"]
        return {(t["key"], t["operator"], t["effect"]) for t in spec["tolerations"]}

    emptying = (EMPTYING_TAINT, "Exists", "NoSchedule")
    assert tolerated({}) == {("nvidia.com/gpu", "Exists", "NoSchedule"), emptying}
    assert tolerated({"webhook.gpuPodsToleration": key}) >= {(key, "Exists", "NoSchedule"), emptying}
    assert tolerated({"kubeletPlugin.tolerations": []}) == {emptying}


def test_webhook_modes_that_do_not_go_together() -> None:
    with pytest.raises(AssertionError, match="choose one"):
        render({"webhook.certManager.enabled": True, "webhook.tls.existingSecret": "x"})
    with pytest.raises(AssertionError, match="goes with webhook"):
        render({"webhook.tls.caBundle": "Q0EK"})


def cert_manager_crds() -> dict[str, dict[str, Any]]:
    """kind -> the CustomResourceDefinition of cert-manager's Certificate and Issuer, from its Go
    module (deploy/crds), through the Go module proxy and cache."""
    listed = subprocess.run(["go", "mod", "download", "-json", f"{CERT_MANAGER_MODULE}@{CERT_MANAGER_VERSION}"],
                            capture_output=True, text=True, check=False, timeout=600, cwd="/",
                            env={**os.environ, "GOFLAGS": "-mod=mod", "GO111MODULE": "on"})  # fmt: skip
    assert listed.returncode == 0, listed.stdout + listed.stderr
    crds = Path(json.loads(listed.stdout)["Dir"]) / "deploy" / "crds"
    found = {}
    for name in ("cert-manager.io_certificates.yaml", "cert-manager.io_issuers.yaml"):
        crd = yaml.safe_load((crds / name).read_text())
        found[crd["spec"]["names"]["kind"]] = crd
    return found


def schema_errors(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """What of `value` a structural OpenAPI v3 schema does not allow: unknown fields, types, enums,
    required fields (what kube-apiserver's strict field validation checks of a custom resource)."""
    kind = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "integer": int, "number": (int, float)}
    if kind in types and not isinstance(value, types[kind]):
        return [f"{path}: {value!r} is not {kind}"]
    errors = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        errors += [f"{path}.{key}: required" for key in schema.get("required", []) if key not in value]
        for key, item in value.items():
            if key in properties:
                errors += schema_errors(item, properties[key], f"{path}.{key}")
            elif isinstance(schema.get("additionalProperties"), dict):
                errors += schema_errors(item, schema["additionalProperties"], f"{path}.{key}")
            elif (
                not schema.get("x-kubernetes-preserve-unknown-fields")
                and schema.get("additionalProperties") is not True
            ):
                errors.append(f"{path}.{key}: unknown field")
    if isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{path}[{index}]")
    return errors


@pytest.mark.parametrize("mode", ["cert-manager", "cert-manager, own issuer"])
def test_cert_manager_objects_fit_cert_managers_crds(mode: str) -> None:
    crds = cert_manager_crds()
    checked = 0
    for document in render(WEBHOOK_MODES[mode]):
        if document["apiVersion"].startswith("cert-manager.io/"):
            crd = crds[document["kind"]]
            (version,) = [
                v for v in crd["spec"]["versions"] if f"cert-manager.io/{v['name']}" == document["apiVersion"]
            ]
            assert version["served"] and version["storage"]
            spec_schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
            assert schema_errors(document["spec"], spec_schema, "spec") == [], document["metadata"]["name"]
            checked += 1
    assert checked == (4 if mode == "cert-manager" else 1)
    # The checker does find what the apiserver would refuse.
    certificate = crds["Certificate"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert set(schema_errors({"secretName": 1, "issuerRef": {}, "dnsName": []}, certificate, "spec")) == {
        "spec.issuerRef.name: required", "spec.secretName: 1 is not string", "spec.dnsName: unknown field"
    }  # fmt: skip


def test_the_rendered_manifests_carry_the_webhook_and_no_secret() -> None:
    # The webhook makes its certificate when it starts, so the plain manifests can have it again.
    webhook = (ROOT / "daemonset" / "webhook.yaml").read_text()
    kinds = [d["kind"] for d in yaml.safe_load_all(webhook) if d]
    assert "ValidatingWebhookConfiguration" in kinds and "Deployment" in kinds and "Secret" not in kinds
    for path in sorted((ROOT / "daemonset").glob("*.yaml")):
        assert "PRIVATE KEY" not in path.read_text()
    (configuration,) = [d for d in yaml.safe_load_all(webhook) if d and d["kind"] == "ValidatingWebhookConfiguration"]
    assert not [w for w in configuration["webhooks"] if "caBundle" in w["clientConfig"]]


def test_pods_without_claims_of_opted_in_namespaces_are_gated_and_placed_only_when_enabled() -> None:
    objects = render({"controller.placePods.enabled": True, "webhook.gatePods.failurePolicy": "Fail"}, namespace="gpus")
    claims, placed = find(objects, "MutatingWebhookConfiguration")["webhooks"]
    assert claims["name"] == "pods.gpu.fgpu.dev" and placed["name"] == "placed-pods.gpu.fgpu.dev"
    assert (placed["failurePolicy"], placed["reinvocationPolicy"]) == ("Fail", "Never")  # as the claims' rule
    assert placed["clientConfig"]["service"]["path"] == "/place-pods"
    assert placed["namespaceSelector"] == {
        "matchLabels": {"gpu.fgpu.dev/place-pods": "fgpu"},
        "matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system", "gpus"]}
        ],
    }
    assert [c["name"] for c in placed["matchConditions"]] == ["no-resource-claims", "not-bound", "not-a-daemonset-pod"]
    args = find(objects, "Deployment", "controller")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--place-pods" in args
    assert ("namespaces", "list") in {
        (r, v) for rule in find(objects, "ClusterRole", "controller")["rules"] for r in rule["resources"]
        for v in rule["verbs"]
    }  # fmt: skip
    # Without the rule for claims the configuration holds this one alone, its caBundle still written.
    alone = render({"controller.placePods.enabled": True, "webhook.gatePods.enabled": False})
    assert [w["name"] for w in find(alone, "MutatingWebhookConfiguration")["webhooks"]] == ["placed-pods.gpu.fgpu.dev"]
    assert webhook_args(alone).mutating_webhook_configuration == "fgpu-webhook" and not webhook_args(alone).gate_pods
    # Off by default: no rule, no flag, no Namespaces read.
    default = render()
    assert len(find(default, "MutatingWebhookConfiguration")["webhooks"]) == 1
    controller = find(default, "Deployment", "controller")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--place-pods" not in controller
    assert not [r for r in find(default, "ClusterRole", "controller")["rules"] if "namespaces" in r["resources"]]


def test_automatic_sizing_is_off_by_default_and_when_enabled_sends_only_new_claims_made_from_templates() -> None:
    default = render()
    assert not [w for w in find(default, "MutatingWebhookConfiguration")["webhooks"] if "rightsize" in w["name"]]
    assert not webhook_args(default).rightsize_history_namespace
    assert not [
        r for r in find(default, "ClusterRole", "webhook")["rules"] if {"pods", "resourceslices"} & set(r["resources"])
    ]

    objects = render({"webhook.rightsize.enabled": True, "webhook.gatePods.enabled": False}, namespace="gpus")
    by_namespace, by_template = find(objects, "MutatingWebhookConfiguration")["webhooks"]
    assert (by_namespace["name"], by_template["name"]) == ("rightsize-namespaces.gpu.fgpu.dev",
                                                           "rightsize-templates.gpu.fgpu.dev")  # fmt: skip
    for entry in (by_namespace, by_template):
        assert (entry["failurePolicy"], entry["reinvocationPolicy"], entry["sideEffects"]) == (
            "Ignore",
            "Never",
            "None",
        )
        assert entry["clientConfig"]["service"]["path"] == "/rightsize"
        assert entry["rules"] == [{"apiGroups": ["resource.k8s.io"], "apiVersions": ["v1"], "operations": ["CREATE"],
                                   "resources": ["resourceclaims"]}]  # fmt: skip
        assert "resource.kubernetes.io/pod-claim-name" in entry["matchConditions"][0]["expression"]
    assert by_namespace["namespaceSelector"] == {"matchLabels": {"gpu.fgpu.dev/rightsize": "initial"}}
    assert '["off", "initial"]' in by_namespace["matchConditions"][1]["expression"]  # pinned: never sent
    assert "namespaceSelector" not in by_template
    assert by_template["matchConditions"][1]["expression"].endswith('== "initial"')
    args = webhook_args(objects)
    assert args.rightsize_history_namespace == "gpus" and args.mutating_webhook_configuration == "fgpu-webhook"
    rules = {(r, v) for rule in find(objects, "ClusterRole", "webhook")["rules"] for r in rule["resources"]
             for v in rule["verbs"]}  # fmt: skip
    assert {("pods", "get"), ("namespaces", "get"), ("resourceslices", "list")} <= rules
    assert ("pods", "list") not in rules and ("resourceslices", "watch") not in rules
    history = find(objects, "Role", "webhook-usage-history")
    assert (history["metadata"]["namespace"], history["rules"]) == (
        "gpus", [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}]
    )  # fmt: skip
    spec = find(objects, "Deployment", "webhook")["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is True
