"""`fgpu controller` as a process, and the opt-in claims and gated pods it places."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from driver.scheduling.opt_in import GANG_LABEL, GANG_SIZE_LABEL, OPT_IN_LABEL, SCHEDULING_GATE
from testbed.cluster.kubelet_standin import KubeletStandIn

CONTROLLER = (sys.executable, "-m", "driver.cli", "controller")


@dataclass(frozen=True)
class ControlledNodes:
    """Fake nodes with kubelet stand-ins, and the controller placing claims on them."""

    kubelets: dict[str, KubeletStandIn]
    metrics_port: int  # the controller's Prometheus endpoint on 127.0.0.1


@contextlib.contextmanager
def running_controller(kubeconfig: object, *flags: str) -> Iterator[subprocess.Popen[bytes]]:
    """`fgpu controller` as a process, stopped (SIGTERM) when the block ends."""
    process = subprocess.Popen([*CONTROLLER, f"--kubeconfig={kubeconfig}", *flags])
    try:
        yield process
    finally:
        process.terminate()
        process.wait(timeout=15)


def gang_claim(name: str, gang: str, size: int, gpus: int) -> dict[str, Any]:
    labels = {OPT_IN_LABEL: "fgpu", GANG_LABEL: gang, GANG_SIZE_LABEL: str(size)}
    request = {"name": "gpus", "exactly": {"deviceClassName": "gpu.fgpu.dev", "count": gpus}}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "labels": labels},
        "spec": {"devices": {"requests": [request]}},
    }


def gated_pod(name: str, claim: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "schedulingGates": [{"name": SCHEDULING_GATE}],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
            "containers": [
                {"name": "main", "image": "registry.invalid/cuda:12", "resources": {"claims": [{"name": "gpu"}]}}
            ],
            "terminationGracePeriodSeconds": 1,
        },
    }


def by_kube_scheduler(resource_api, name: str, namespace: str = "default") -> bool:
    """Whether kube-scheduler owns the claim's allocation (it re-allocated it): it owns the
    reservation in any case."""
    found = resource_api.read_namespaced_resource_claim(name, namespace)
    return any(
        f.manager == "kube-scheduler" and "f:allocation" in ((f.fields_v1 or {}).get("f:status") or {})
        for f in found.metadata.managed_fields or ()
    )


def events_on(core_api, kind: str, name: str, reason: str) -> list[Any]:
    """The Events with that reason on the object of that kind and name (namespace default)."""
    events = core_api.list_namespaced_event("default", field_selector=f"involvedObject.name={name}").items
    return [e for e in events if e.involved_object.kind == kind and e.reason == reason]
