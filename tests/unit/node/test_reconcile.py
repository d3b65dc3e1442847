from driver.claims.refs import ClaimRef
from driver.node.reconcile import ClaimReconciler
from testbed.fakes import allocated_claim, result


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_claims_gone_from_the_api_server_are_unprepared_after_the_grace_period(node):
    api, env = node
    for name, device in (("deleted", "gpu-0-mig-1g10gb-0"), ("recreated", "gpu-1"), ("alive", "gpu-2")):
        api.claims[("default", name)] = allocated_claim("default", name, f"uid-{name}", [result(device)])
        assert env.preparer.prepare([_ref(name)])[f"uid-{name}"].error == ""
    del api.claims[("default", "deleted")]
    api.claims[("default", "recreated")]["metadata"]["uid"] = "uid-new"
    clock = Clock()
    reconciler = ClaimReconciler(api, env.preparer, env.claims, grace_s=60, clock=clock)
    assert reconciler.reconcile_once() == []  # first seen missing
    clock.now += 30
    api.unavailable = True
    assert reconciler.reconcile_once() == []  # an outage proves nothing
    api.unavailable = False
    clock.now += 31
    assert sorted(reconciler.reconcile_once()) == ["uid-deleted", "uid-recreated"]
    assert set(env.claims.all()) == {"uid-alive"}
    assert env.session.gpu_instances(0) == []
    assert env.cdi.claim_uids_on_disk() == {"uid-alive"}


def test_a_claim_that_comes_back_is_kept(node):
    api, env = node
    api.claims[("default", "flaky")] = allocated_claim("default", "flaky", "uid-flaky", [result("gpu-3")])
    env.preparer.prepare([_ref("flaky")])
    saved = api.claims.pop(("default", "flaky"))
    clock = Clock()
    reconciler = ClaimReconciler(api, env.preparer, env.claims, grace_s=60, clock=clock)
    reconciler.reconcile_once()
    api.claims[("default", "flaky")] = saved
    clock.now += 30
    reconciler.reconcile_once()
    del api.claims[("default", "flaky")]
    clock.now += 40  # missing again, but only for 0s of a fresh grace period
    assert reconciler.reconcile_once() == []
    assert set(env.claims.all()) == {"uid-flaky"}


def _ref(name: str) -> ClaimRef:
    return ClaimRef("default", name, f"uid-{name}")
