"""Claims whose status other drivers share: an allocated claim that also holds another driver's NIC
with its status entry, and the status.devices entries read back by device."""

from __future__ import annotations

from driver.claims.refs import ClaimRef
from testbed.fakes import InMemoryKubeApi, allocated_claim

NIC = {"driver": "net.example.com", "pool": "node-a", "device": "eth1"}
NIC_ENTRY = {
    **NIC,
    "conditions": [{"type": "Ready", "status": "True", "reason": "Up", "lastTransitionTime": "2026-01-01T00:00:00Z"}],
    "data": {"mac": "02:00:00:00:00:01"},
}


def add_claim(api: InMemoryKubeApi, name: str, results: list[dict]) -> ClaimRef:
    """An allocated claim (generation 1) that also holds a NIC of another driver with its status."""
    claim = allocated_claim("default", name, f"uid-{name}", [*results, {"request": "nic", **NIC}])
    claim["metadata"]["generation"] = 1
    api.claims[("default", name)] = claim
    api.apply_claim_status("default", name, {"metadata": {}, "status": {"devices": [NIC_ENTRY]}}, "net-driver")
    return ClaimRef("default", name, f"uid-{name}")


def status_devices(api: InMemoryKubeApi, ref: ClaimRef) -> dict[str, dict]:
    devices = api.claims[(ref.namespace, ref.name)]["status"].get("devices") or []
    return {d["device"]: d for d in devices}
