"""The allocator places by the tenancy of shared GPUs (issue 38; the rule: driver/claims/tenancy.py):
a claim is not placed on a device whose shares another tenant holds, where prepare would refuse it
and its pod wait until the other tenant leaves."""

from __future__ import annotations

from typing import Any

from driver.allocator.cluster import ClusterAllocator, Failure, Placement, Snapshot
from driver.allocator.model import Claim, claim_from_object, class_from_object, slice_from_object
from driver.allocator.state import AllocatedState
from tests.support.allocation import CLASSES, DRIVER, devices, exactly, first_gpus, place

MPS = "mps.gpu.fgpu.dev"


def with_tenancy(name: str, tenancy: str) -> dict[str, Any]:
    """The chart's class `name`, its shares' tenancy set by its opaque config."""
    parameters = {
        "apiVersion": "gpu.fgpu.dev/v1alpha1",
        "kind": "ShareConfig",
        "sharing": {"strategy": "MPS", "tenancy": tenancy},
    }
    found = next(c for c in CLASSES if c["metadata"]["name"] == name)
    return {**found, "spec": {**found["spec"], "config": [{"opaque": {"driver": DRIVER, "parameters": parameters}}]}}


def cluster(slices: list[dict[str, Any]], *classes: dict[str, Any], policy: str = "binpack") -> ClusterAllocator:
    by_name = {c["metadata"]["name"]: c for c in CLASSES} | {c["metadata"]["name"]: c for c in classes}
    snapshot = Snapshot.from_slices([slice_from_object(s) for s in slices])
    parsed = {name: class_from_object(c) for name, c in by_name.items()}
    return ClusterAllocator(snapshot, parsed, AllocatedState(), policy)  # type: ignore[arg-type]


def of_class(cls: str, namespace: str, name: str, admin: bool = False) -> Claim:
    """A claim for one share (10% of a GPU's compute) of the class."""
    request = exactly(cls, capacity={"requests": {"compute": "10"}}, **({"adminAccess": True} if admin else {}))
    metadata = {"name": name, "namespace": namespace, "uid": f"uid-{namespace}-{name}"}
    return claim_from_object({"metadata": metadata, "spec": {"devices": {"requests": [request]}}})


def mps(namespace: str, name: str, admin: bool = False) -> Claim:
    return of_class(MPS, namespace, name, admin)


def test_a_second_namespace_is_not_placed_on_a_gpu_whose_shares_another_namespace_holds():
    one = cluster(first_gpus(1))
    assert devices(place(one, mps("a", "first"))) == ["gpu-0-mps"]
    place(one, mps("a", "second"))  # the same namespace joins it
    outcome = one.allocate(mps("b", "other"))
    assert isinstance(outcome, Failure)
    assert "gpu-0-mps (another tenant's shares: they belong to one namespace at a time" in outcome.reason
    assert "uid-a" not in outcome.reason and " a/" not in outcome.reason  # the other tenant is not named


def test_a_second_namespace_goes_to_another_gpu():
    two = cluster(first_gpus(2))
    first = devices(place(two, mps("a", "first")))
    assert devices(place(two, mps("b", "other"))) != first
    assert devices(place(two, mps("a", "again"))) == first  # binpack: with its own namespace


def test_a_shared_class_lets_any_claims_meet():
    one = cluster(first_gpus(1), with_tenancy(MPS, "Shared"))
    place(one, mps("a", "first"))
    assert devices(place(one, mps("b", "other"))) == ["gpu-0-mps"]
    # A claim of a class of the default tenancy does not join them: the stricter of two wins.
    default = {**next(c for c in CLASSES if c["metadata"]["name"] == MPS), "metadata": {"name": "default-mps"}}
    strict = cluster(first_gpus(1), with_tenancy(MPS, "Shared"), default)
    place(strict, mps("a", "first"))
    assert isinstance(strict.allocate(of_class("default-mps", "c", "strict")), Failure)


def test_a_claim_class_keeps_even_one_namespace_apart():
    two = cluster(first_gpus(2), with_tenancy(MPS, "Claim"))
    first = devices(place(two, mps("a", "first")))
    assert devices(place(two, mps("a", "second"))) != first
    outcome = two.allocate(mps("a", "third"))
    assert isinstance(outcome, Failure) and "belong to one claim at a time" in outcome.reason


def test_the_stricter_class_wins():
    """Claims of one namespace, one of a Claim class: it does not join the other's shares."""
    claim_class = {**with_tenancy(MPS, "Claim"), "metadata": {"name": "own-mps"}}
    one = cluster(first_gpus(1), claim_class)
    place(one, mps("a", "first"))
    assert isinstance(one.allocate(of_class("own-mps", "a", "own")), Failure)


def test_admin_access_is_no_tenant_and_joins_any():
    one = cluster(first_gpus(1))
    place(one, mps("monitoring", "watch", admin=True))
    place(one, mps("a", "first"))  # the admin-access claim holds nothing
    assert isinstance(one.allocate(mps("b", "other")), Failure)  # a does
    assert devices(place(one, mps("monitoring", "watch-again", admin=True))) == ["gpu-0-mps"]


def test_a_released_tenant_frees_the_gpu_for_another():
    one = cluster(first_gpus(1))
    first = place(one, mps("a", "first"))
    second = place(one, mps("a", "second"))
    assert isinstance(one.allocate(mps("b", "other")), Failure)  # remembered as not fitting for b
    one.release(first.node, first.allocation, first.claim)
    assert isinstance(one.allocate(mps("b", "other")), Failure)  # a's second claim still holds a share
    one.release(second.node, second.allocation, second.claim)
    assert one.state.tenants == {}
    assert devices(place(one, mps("b", "other"))) == ["gpu-0-mps"]


def test_what_does_not_fit_one_namespace_is_not_remembered_for_another():
    two = cluster(first_gpus(2))
    place(two, mps("a", "first"))
    place(two, mps("b", "other"))
    assert isinstance(two.allocate(mps("c", "third")), Failure)
    assert isinstance(two.allocate(mps("a", "fourth")), Placement)


def test_allocations_of_claims_given_count_their_tenants():
    """As `fgpu plan` builds its state: from claims allocated already, their namespaces known."""
    held = place(cluster(first_gpus(1)), mps("a", "first"))
    allocated = claim_from_object(
        {
            "metadata": {"name": "first", "namespace": "a", "uid": held.claim.uid},
            "spec": {"devices": {"requests": [exactly(MPS)]}},
            "status": {"allocation": held.allocation},
        }
    )
    fresh = cluster(first_gpus(1))
    one = ClusterAllocator(fresh.snapshot, fresh.classes, AllocatedState.from_claims([allocated]))
    assert isinstance(one.allocate(mps("b", "other")), Failure)
    assert AllocatedState.from_allocations([held.allocation]).tenants == {}  # claims unknown: no tenants
