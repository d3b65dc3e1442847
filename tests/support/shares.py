"""Claims of the node's driver on the in-memory API: allocated shares and their opaque configs, and
the CDI spec prepare wrote for one."""

from __future__ import annotations

import json

from driver.claims.refs import ClaimRef
from testbed.fakes import InMemoryKubeApi, allocated_claim, result

CONFIG = "gpu.fgpu.dev/v1alpha1"


def claim(api: InMemoryKubeApi, name: str, results, config=None) -> ClaimRef:
    api.claims[("default", name)] = allocated_claim("default", name, f"uid-{name}", results, config)
    return ClaimRef("default", name, f"uid-{name}")


def share(device: str, memory: str | None = None, compute: str | None = None, request: str = "gpu") -> dict:
    entry = result(device, request=request)
    entry["shareID"] = f"share-{device}-{memory}-{compute}"
    entry["consumedCapacity"] = {k: v for k, v in (("memory", memory), ("compute", compute)) if v}
    return entry


def opaque(parameters: dict, requests=None, source: str = "FromClaim") -> dict:
    return {
        "source": source,
        "requests": requests or [],
        "opaque": {"driver": "gpu.fgpu.dev", "parameters": parameters},
    }


def spec(env, uid: str) -> dict:
    return json.loads(env.cdi.spec_path(uid).read_text())
