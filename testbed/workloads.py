"""Pods, claim templates and Deployments for the real node, and reading back what their containers
saw: each test container prints a report (its env, GPU device nodes, mounts, /dev/shm) and then
waits, so a test asserts on what the container itself sees, read through `kubectl logs`."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import kubernetes

from testbed.cluster.images import BUSYBOX_IMAGE

REPORT = (
    "echo '== env'; env | sort; "
    "echo '== dev'; ls -l /dev/nvidia* /dev/nvidia-caps/* 2>/dev/null; "
    "echo '== mounts'; cut -d' ' -f5 /proc/self/mountinfo; "
    "echo '== shm'; ls /dev/shm; "
    "echo '== end'"
)
WAIT_S = 90
NS = "default"  # where workloads go unless told


def claim_template(name: str, device_class: str, *, count: int = 1, selector: str | None = None,
                   capacity: dict[str, str] | None = None, constraints: list[dict[str, Any]] | None = None,
                   config: list[dict[str, Any]] | None = None,
                   tolerations: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    exactly: dict[str, Any] = {"deviceClassName": device_class, "count": count}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    if tolerations:
        exactly["tolerations"] = tolerations
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    devices: dict[str, Any] = {"requests": [{"name": "gpu", "exactly": exactly}]}
    if constraints:
        devices["constraints"] = constraints
    if config:
        devices["config"] = config
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": devices}},
    }


def pod_spec(node: str, template: str, command: str = REPORT) -> dict[str, Any]:
    """A pod spec on the real node whose container reports what it sees, then waits."""
    return {
        "nodeSelector": {"kubernetes.io/hostname": node},
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
        "containers": [
            {
                "name": "main",
                "image": BUSYBOX_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", f"{command}; exec sleep 3600"],
                "resources": {"claims": [{"name": "gpu"}]},
            }
        ],
        "terminationGracePeriodSeconds": 1,
    }


def pod(name: str, node: str, template: str, command: str = REPORT) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": pod_spec(node, template, command)}


def deployment(name: str, node: str, template: str, replicas: int) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec(node, template)},
        },
    }


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class ContainerReport:
    """What one container printed about itself, by section."""

    env: dict[str, str]
    devices: dict[str, str]  # path -> "c 1:3" (type, major:minor)
    mounts: set[str]
    shm: set[str]

    @classmethod
    def parse(cls, text: str) -> ContainerReport:
        sections: dict[str, list[str]] = {}
        current = None
        for line in text.splitlines():
            if line.startswith("== "):
                current = line[3:]
                sections[current] = []
            elif current:
                sections[current].append(line)
        if "end" not in sections:
            raise AssertionError(f"incomplete container report:\n{text}")
        env = dict(line.split("=", 1) for line in sections["env"] if "=" in line)
        devices = {}
        for line in sections["dev"]:
            fields = line.split()
            if len(fields) >= 10 and line.startswith("c"):
                devices[fields[-1]] = f"c {fields[4].rstrip(',')}:{fields[5]}"
        return cls(env, devices, set(sections["mounts"]), set(sections["shm"]))


def wait_until(what: str, probe: Callable[[], Any], timeout_s: float = WAIT_S, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def delete_namespace(core: kubernetes.client.CoreV1Api, name: str) -> None:
    """Delete a namespace and wait until it is gone: a later test that creates objects in a namespace of
    the same name is refused while this one is still terminating."""
    delete_namespaces(core, [name])


def delete_namespaces(core: kubernetes.client.CoreV1Api, names: list[str]) -> None:
    """Delete namespaces together and wait until all are gone. Their pods are deleted at once too: the
    namespace controller starts on a deleted namespace only after 5 s (its grace for API servers that
    have not seen the deletion yet), and then the pods' stopping was most of the wait (pods gone 8.5 s
    after the deletion, the namespace 10.7 s). A terminating namespace takes no new pods, so no
    workload controller puts them back."""

    def gone(name: str) -> bool:
        try:
            core.read_namespace(name)
        except kubernetes.client.ApiException as err:
            if err.status == 404:
                return True
            raise
        return False

    for name in names:
        try:
            core.delete_namespace(name)
            core.delete_collection_namespaced_pod(name)
        except kubernetes.client.ApiException as err:
            if err.status != 404:
                raise
    wait_until(f"namespaces {', '.join(names)} gone", lambda: all(gone(name) for name in names), timeout_s=120)


def pod_events(core: kubernetes.client.CoreV1Api, name: str, namespace: str = NS) -> list[str]:
    events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
    return [f"{e.reason}: {e.message}" for e in events]


def wait_running(core: kubernetes.client.CoreV1Api, name: str, namespace: str = NS) -> Any:
    def running() -> Any:
        found = core.read_namespaced_pod(name, namespace)
        return found if found.status.phase == "Running" else None

    try:
        return wait_until(f"pod {name} running", running)
    except AssertionError as err:
        raise AssertionError(f"{err}; events: {pod_events(core, name, namespace)}") from None


def report(core: kubernetes.client.CoreV1Api, name: str, namespace: str = NS) -> ContainerReport:
    """The container's report, through the apiserver's logs endpoint (kubelet -> containerd)."""

    def complete() -> str | None:
        text = core.read_namespaced_pod_log(name, namespace)
        return text if "== end" in text else None

    return ContainerReport.parse(wait_until(f"report of pod {name}", complete))


def wait_for(probe: Callable[[], Any], timeout: float = 30.0, interval: float = 0.1) -> Any:
    """wait_until for a condition that needs no name, polled more often."""
    return wait_until("condition", probe, timeout_s=timeout, interval=interval)
