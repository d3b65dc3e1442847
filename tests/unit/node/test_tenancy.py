"""Tenancy of shared GPUs (issue 38, findings 1, 3 and 4): the shares of one device (a GPU's MPS
daemon or time-slicing, or a MIG partition's) belong to one namespace at a time, or one claim, or
anyone, as the device class says; prepare refuses a claim of another tenant, whichever scheduler
allocated it, and prepares it once the other tenant's shares are gone."""

from __future__ import annotations

from typing import Any

import pytest

from driver.claims.refs import ClaimRef
from driver.node.state import PreparedClaim, PreparedDevice
from testbed.fakes import InMemoryKubeApi, allocated_claim, result
from testbed.node_env import NodeEnv

CONFIG = "gpu.fgpu.dev/v1alpha1"


def claim(api: InMemoryKubeApi, namespace: str, name: str, *results: dict[str, Any], config=None) -> ClaimRef:
    api.claims[(namespace, name)] = allocated_claim(namespace, name, f"uid-{name}", list(results), config)
    return ClaimRef(namespace, name, f"uid-{name}")


def share(device: str, name: str) -> dict[str, Any]:
    return {**result(device), "shareID": f"share-{name}", "consumedCapacity": {"memory": "4Gi"}}


def tenancy(value: str, source: str = "FromClass", strategy: str = "TimeSlicing") -> dict[str, Any]:
    parameters = {"apiVersion": CONFIG, "kind": "ShareConfig", "sharing": {"strategy": strategy, "tenancy": value}}
    return {"source": source, "requests": [], "opaque": {"driver": "gpu.fgpu.dev", "parameters": parameters}}


def test_a_gpus_time_sliced_shares_belong_to_one_namespace_at_a_time(node):
    api, env = node
    mine = claim(api, "team-a", "mine", share("gpu-3-ts", "mine"))
    also_mine = claim(api, "team-a", "also-mine", share("gpu-3-ts", "also-mine"))
    theirs = claim(api, "team-b", "theirs", share("gpu-3-ts", "theirs"))
    assert [r.error for r in env.preparer.prepare([mine, also_mine]).values()] == ["", ""]

    error = env.preparer.prepare([theirs])[theirs.uid].error
    assert "device gpu-3-ts is shared by another tenant's claims" in error and "one namespace at a time" in error
    assert "team-a" not in error and "uid-mine" not in error and "\n" not in error  # names no other tenant
    assert set(env.claims.all()) == {mine.uid, also_mine.uid} and not env.cdi.spec_path(theirs.uid).exists()

    assert env.preparer.unprepare([mine, also_mine]) == {mine.uid: "", also_mine.uid: ""}
    assert env.preparer.prepare([theirs])[theirs.uid].error == ""  # kubelet's retry, once the GPU is free


def test_another_namespaces_mps_share_is_refused_before_anything_is_made(node):
    """The daemon's control socket, its /dev/shm and its server's uid are the tenant's: another
    namespace's claim never reaches them (refused before its record, its daemon or its spec)."""
    api, env = node
    held = PreparedDevice(("gpu",), "node-a", "gpu-4-mps", ("x",), kind="mps", gpu_index=4,
                          gpu_uuid=env.gpus[4].uuid, mps_memory_bytes=2**32, mps_thread_percentage=10)  # fmt: skip
    env.claims.commit(prepared=[PreparedClaim("uid-held", "team-a", "held", (held,))])
    theirs = claim(api, "team-b", "theirs", share("gpu-4-mps", "theirs"))
    error = env.preparer.prepare([theirs])[theirs.uid].error
    assert "device gpu-4-mps is shared by another tenant's claims" in error
    assert set(env.claims.all()) == {"uid-held"} and not env.mps.running(env.gpus[4].uuid)
    assert not env.mps.pipe_dir(env.gpus[4].uuid).exists()


def test_a_class_that_opts_out_lets_namespaces_share_and_claim_tenancy_keeps_claims_apart(node):
    api, env = node
    shared = [tenancy("Shared")]
    a = claim(api, "team-a", "a", share("gpu-5-ts", "a"), config=shared)
    b = claim(api, "team-b", "b", share("gpu-5-ts", "b"), config=shared)
    assert [r.error for r in env.preparer.prepare([a, b]).values()] == ["", ""]

    alone = [tenancy("Claim")]
    first = claim(api, "team-a", "first", share("gpu-6-ts", "first"), config=alone)
    second = claim(api, "team-a", "second", share("gpu-6-ts", "second"), config=alone)
    assert env.preparer.prepare([first])[first.uid].error == ""
    assert "one claim at a time" in env.preparer.prepare([second])[second.uid].error
    # The stricter of two tenancies decides: a Shared claim does not join a Claim-tenancy one.
    loose = claim(api, "team-a", "loose", share("gpu-6-ts", "loose"), config=shared)
    assert "one claim at a time" in env.preparer.prepare([loose])[loose.uid].error


def test_a_claim_cannot_choose_its_own_tenancy(node):
    api, env = node
    ref = claim(api, "team-a", "sneaky", share("gpu-7-ts", "sneaky"), config=[tenancy("Shared", source="FromClaim")])
    error = env.preparer.prepare([ref])[ref.uid].error
    assert "sharing.tenancy is set by the device class only" in error
    bad = claim(api, "team-a", "bad", share("gpu-7-ts", "bad"), config=[tenancy("Everyone")])
    assert "sharing.tenancy must be one of" in env.preparer.prepare([bad])[bad.uid].error


@pytest.mark.parametrize(
    ("theirs", "allowed"),
    [
        ("gpu-2-mig-3g40gb-0-ts", True),  # another partition: apart by the hardware
        ("gpu-2-mig-3g40gb-4-ts", False),  # the same partition's shares
    ],
)
def test_partition_shares_belong_to_one_namespace_per_partition(node, theirs: str, allowed: bool):
    api, env = node
    mine = claim(api, "team-a", "mine", share("gpu-2-mig-3g40gb-4-ts", "mine"))
    assert env.preparer.prepare([mine])[mine.uid].error == ""
    other = claim(api, "team-b", "other", share(theirs, "other"))
    error = env.preparer.prepare([other])[other.uid].error
    assert (error == "") is allowed, error


def test_admin_access_from_another_namespace_is_not_a_tenant(node: tuple[InMemoryKubeApi, NodeEnv]):
    api, env = node
    user = claim(api, "team-a", "user", share("gpu-1-ts", "user"))
    assert env.preparer.prepare([user])[user.uid].error == ""
    monitor = claim(api, "ops", "monitor", {**result("gpu-1-ts", request="monitor"), "adminAccess": True})
    assert env.preparer.prepare([monitor])[monitor.uid].error == ""
