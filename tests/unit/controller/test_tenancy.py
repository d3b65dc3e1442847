"""The controller places by the tenancy of shared GPUs (issue 38; driver/claims/tenancy.py): a claim
is never placed on a device whose shares another namespace's claims hold, whether this replica
placed them or finds them in the claims (a new leader, a standby)."""

from __future__ import annotations

from typing import Any

from tests.support.controller_cluster import claims_in, devices_of, fake_cluster, sync


def gpu0_share(name: str, namespace: str) -> dict[str, Any]:
    """An opt-in claim for a share of GPU 0's MPS device."""
    selector = 'device.attributes["gpu.fgpu.dev"].index == 0'
    request = {
        "deviceClassName": "mps.gpu.fgpu.dev",
        "selectors": [{"cel": {"expression": selector}}],
        "capacity": {"requests": {"compute": "10"}},
    }
    meta = {"name": name, "namespace": namespace, "labels": {"gpu.fgpu.dev/allocator": "fgpu"}}
    return {"metadata": meta, "spec": {"devices": {"requests": [{"name": "r", "exactly": request}]}}}


def test_a_claim_of_another_namespace_is_not_placed_on_shares_one_namespace_holds(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    api.put("claims", gpu0_share("first", "a"))
    api.put("claims", gpu0_share("other", "b"))
    replicas(api).run_pass()
    claims = claims_in(api)
    assert devices_of(claims["first"]) == [("n1", "gpu-0-mps")]
    assert devices_of(claims["other"]) == []
    failed = [e["message"] for e in api.events if e["reason"] == "FailedAllocation"]
    assert any("another tenant's shares: they belong to one namespace at a time" in m for m in failed), failed
    assert not any(" a/first" in m or "uid-first" in m for m in failed)  # the other tenant is not named


def test_a_new_leader_counts_the_tenants_it_finds_in_the_claims(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    api.put("claims", gpu0_share("first", "a"))
    replicas(api).run_pass()
    api.put("claims", gpu0_share("other", "b"))
    api.put("claims", gpu0_share("second", "a"))
    replicas(api, identity="b").run_pass()  # its allocator built from the claims' status
    claims = claims_in(api)
    assert devices_of(claims["second"]) == [("n1", "gpu-0-mps")]
    assert devices_of(claims["other"]) == []


def test_a_share_a_standby_first_sees_in_a_ledger_gets_its_tenant_once_the_claim_has_it(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    standby = replicas(api, identity="b")
    standby.leader.leading = lambda: False  # type: ignore[method-assign]
    api.put("claims", gpu0_share("first", "a"))
    replicas(api).run_pass()
    sync(standby, "ledgers")  # the leader's ledger entry before the claim's status: no request, no tenant
    allocator = standby.keep_ready()
    sync(standby, "claims")
    assert standby.keep_ready() is allocator  # the claim's status names it now: counted again, not rebuilt
    api.put("claims", gpu0_share("other", "b"))
    sync(standby, "claims")
    standby.leader.leading = lambda: True  # type: ignore[method-assign]  # it wins the lease
    standby.run_pass()
    assert devices_of(claims_in(api)["other"]) == []
