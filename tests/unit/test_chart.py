"""The Helm chart: lint, what it renders for the values users set, and the rendered manifests under
daemonset/ match it (daemonset/render.sh). The apiserver's verdict on them: tests/e2e/test_install_manifests.py."""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from driver.cli import build_parser
from driver.node.health.taints import HealthPolicy
from driver.node.settings import health_policy, sharing_config
from tests.support.chart import CHART, RENDER, ROOT, container_env, find, helm, helm_binary, render

pytestmark = pytest.mark.go  # helm, or go for the pause image: see tests/conftest.py

MOCK = {"nvml": "mock:dgx-h100"}


def test_lint_default_and_mock_values() -> None:
    helm("lint", "--strict", str(CHART))
    helm("lint", "--strict", str(CHART), "--set", "nvml=mock:dgx-h100", "--set", "controller.enabled=false")


def test_rendered_manifests_match_the_chart(tmp_path: Path) -> None:
    subprocess.run([str(RENDER), str(tmp_path)], check=True, env={**os.environ, "HELM": str(helm_binary())})
    for name in ("plugin.yaml", "controller.yaml", "deviceclasses.yaml"):
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
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    # kubelet dials the socket path the plugin registers: mounted where the host has it.
    for name in ("plugins-registry", "plugins", "cdi", "state"):
        assert mounts[name]["mountPath"] == volumes[name]
    assert mounts["state"]["mountPropagation"] == "Bidirectional"
    assert env["PLUGIN_DIR"] == "/var/lib/kubelet/plugins/gpu.fgpu.dev"
    assert (env["DRIVER_ROOT"], env["HOST_DRIVER_ROOT"]) == ("/driver-root", "/")
    assert volumes["driver-root"] == "/"


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


def test_plugin_rbac_is_least_privilege() -> None:
    role = find(render({"driverName": "gpu.example.com"}), "ClusterRole", "kubelet-plugin")
    rules = {
        (rule["apiGroups"][0], resource, *rule.get("resourceNames", [])): set(rule["verbs"])
        for rule in role["rules"]
        for resource in rule["resources"]
    }
    assert rules == {
        ("resource.k8s.io", "resourceclaims"): {"get"},
        # status.devices by a PUT of the status, of this driver's entries, on claims of its own node only
        ("resource.k8s.io", "resourceclaims/status"): {"update"},
        ("resource.k8s.io", "resourceclaims/driver", "gpu.example.com"): {"associated-node:update"},
        ("resource.k8s.io", "resourceslices"): {"get", "list", "watch", "create", "update", "delete"},
        ("", "nodes"): {"get"},
        ("", "events"): {"create"},  # a refused status write, on its claim
    }
    policy = find(render(namespace="gpus"), "ValidatingAdmissionPolicy")
    condition = policy["spec"]["matchConditions"][0]["expression"]
    assert '"system:serviceaccount:gpus:fgpu-kubelet-plugin"' in condition


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


def test_webhook_serves_its_certificate_and_the_apiserver_trusts_it(tmp_path: Path) -> None:
    objects = render({"webhook.failurePolicy": "Fail", "driverName": "gpu.example.com"}, namespace="gpus")
    secret = find(objects, "Secret", "webhook-tls")
    deployment = find(objects, "Deployment", "webhook")
    spec = deployment["spec"]["template"]["spec"]
    args = build_parser().parse_args(spec["containers"][0]["args"])
    assert (args.driver_name, args.port) == ("gpu.example.com", 8443)
    mounted = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert args.tls_cert_file.parent.as_posix() in mounted and args.tls_private_key_file.name in secret["data"]
    assert spec["automountServiceAccountToken"] is False and spec["securityContext"]["runAsNonRoot"] is True
    # The serving certificate names the Service, and the webhooks trust its CA.
    service = find(objects, "Service", "webhook")
    (tmp_path / "ca.crt").write_bytes(base64.b64decode(secret["data"]["ca.crt"]))
    (tmp_path / "tls.crt").write_bytes(base64.b64decode(secret["data"]["tls.crt"]))
    verified = subprocess.run(
        ["openssl", "verify", "-CAfile", tmp_path / "ca.crt", "-verify_hostname",
         f"{service['metadata']['name']}.gpus.svc", tmp_path / "tls.crt"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert verified.returncode == 0, verified.stderr
    configuration = find(objects, "ValidatingWebhookConfiguration")
    assert [w["name"] for w in configuration["webhooks"]] == [
        "resourceclaims.gpu.example.com",
        "resourceclaimtemplates.gpu.example.com",
        "deviceclasses.gpu.example.com",
    ]
    for webhook in configuration["webhooks"]:
        assert webhook["failurePolicy"] == "Fail" and webhook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
        assert webhook["clientConfig"]["service"] == {
            "name": service["metadata"]["name"], "namespace": "gpus", "path": "/validate", "port": 443
        }  # fmt: skip
        assert '== "gpu.example.com"' in webhook["matchConditions"][0]["expression"]
    assert not [o for o in render({"webhook.enabled": False}) if "webhook" in o["metadata"]["name"]]


def test_the_rendered_manifests_leave_the_webhook_to_helm() -> None:
    # Its certificate is made per install; a rendered one would be the same secret key for everyone.
    for path in sorted((ROOT / "daemonset").glob("*.yaml")):
        assert "ValidatingWebhookConfiguration" not in path.read_text() and "PRIVATE KEY" not in path.read_text()
