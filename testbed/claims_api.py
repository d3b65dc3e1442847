"""Creating ResourceClaims in the real API server for tests and benchmarks, allocated as kube-scheduler would."""

from __future__ import annotations

import uuid
from typing import Any

import kubernetes

DRIVER = "gpu.fgpu.dev"


def gpu_request(name: str = "gpu", selector: str | None = None, count: int = 1) -> dict[str, Any]:
    """A device request for `count` devices of class gpu.fgpu.dev, narrowed by a CEL selector."""
    exactly: dict[str, Any] = {"deviceClassName": "gpu.fgpu.dev", "count": count}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    return {"name": name, "exactly": exactly}


def create_allocated_claim(
    api: kubernetes.client.ResourceV1Api,
    results: list[dict[str, Any]],
    namespace: str = "default",
    config: list[dict[str, Any]] | None = None,
) -> dict[str, str]:
    """A claim allocated with the given results (request, device, optional consumedCapacity) and
    allocation config; results on shared devices get a fresh shareID as the scheduler gives them."""
    name = f"claim-{uuid.uuid4().hex[:8]}"
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [gpu_request(r) for r in sorted({r["request"] for r in results})]}},
    }
    created = api.create_namespaced_resource_claim(namespace, body)
    full = [
        {"driver": DRIVER, "pool": "node-a", **({"shareID": str(uuid.uuid4())} if "consumedCapacity" in r else {}), **r}
        for r in results
    ]
    devices: dict[str, Any] = {"results": full, **({"config": config} if config else {})}
    api.patch_namespaced_resource_claim_status(name, namespace, {"status": {"allocation": {"devices": devices}}})
    return {"namespace": namespace, "name": name, "uid": created.metadata.uid}


def create_claim(
    api: kubernetes.client.ResourceV1Api,
    name: str | None = None,
    devices: list[tuple[str, str]] | None = None,
    pool: str = "node-a",
    driver: str = DRIVER,
    namespace: str = "default",
) -> dict[str, str]:
    """A claim with one request per (request, device) pair, allocated to those devices when given."""
    name = name or f"claim-{uuid.uuid4().hex[:8]}"
    requests = sorted({request for request, _ in devices or [("gpu", "")]})
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "devices": {"requests": [{"name": r, "exactly": {"deviceClassName": "gpu.fgpu.dev"}} for r in requests]}
        },
    }
    created = api.create_namespaced_resource_claim(namespace, body)
    if devices:
        allocation: dict[str, Any] = {
            "devices": {
                "results": [{"request": r, "driver": driver, "pool": pool, "device": d} for r, d in devices],
            },
        }
        api.patch_namespaced_resource_claim_status(name, namespace, {"status": {"allocation": allocation}})
    return {"namespace": namespace, "name": name, "uid": created.metadata.uid}


def pod_with_claim(name: str, template: str, node: str) -> dict[str, Any]:
    """A pod on `node` whose one container uses a claim made from the ResourceClaimTemplate."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
            "containers": [
                {"name": "main", "image": "registry.invalid/cuda:12", "resources": {"claims": [{"name": "gpu"}]}}
            ],
            "terminationGracePeriodSeconds": 1,
        },
    }
