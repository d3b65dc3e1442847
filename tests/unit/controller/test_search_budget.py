"""No tenant's claim stalls a pass (issue 38, finding 6): a claim whose search would run for hours
fails at its budget with an Event and the pass goes on; a namespace's claims search at most its
share of a pass, then wait for the next, while other namespaces' claims are placed; and a loop that
stalls all the same fails its liveness probe and leaves its Lease to expire."""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

import pytest

from driver.controller.leader import LeaderElector, LeaseTimings
from driver.controller.progress import Progress, serve_health
from driver.controller.search_shares import SHARE_UNITS
from testbed.controller_api import InMemoryControllerApi
from tests.support.controller_cluster import claims_in, devices_of, fake_cluster, opt_in_claim

pytestmark = pytest.mark.timeout(60)
STEPS = 2_000  # each unit's budget here: the default's cut would take seconds a claim


def hostile_claim(name: str, namespace: str = "evil") -> dict[str, Any]:
    """Six time-slice requests and eight whole GPUs: no order fits, 8^6 orders to try."""
    obj = opt_in_claim(name, 8)
    requests = [{"name": f"ts{i}", "exactly": {"deviceClassName": "timeslice.gpu.fgpu.dev"}} for i in range(6)]
    obj["spec"]["devices"]["requests"][:0] = requests  # before the whole GPUs: each order of them is tried
    obj["metadata"]["namespace"] = namespace
    return obj


def events(api: InMemoryControllerApi, reason: str) -> dict[str, str]:
    return {e["involvedObject"]["name"]: e["message"] for e in api.events if e["reason"] == reason}


def test_a_claim_whose_search_explodes_fails_with_an_event_and_the_pass_goes_on(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    api.put("claims", hostile_claim("a-hostile"))
    api.put("claims", opt_in_claim("b-ordinary", 2))
    replicas(api, search_steps=STEPS).run_pass()
    claims = claims_in(api)
    assert len(devices_of(claims["b-ordinary"])) == 2 and not devices_of(claims["a-hostile"])
    assert "no answer within the search budget (2000 devices tried)" in events(api, "FailedAllocation")["a-hostile"]


def test_a_namespace_searches_at_most_its_share_of_a_pass_and_the_others_go_on(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    hostile = [f"a-hostile-{i}" for i in range(SHARE_UNITS + 2)]
    for name in hostile:
        api.put("claims", hostile_claim(name))
    api.put("claims", opt_in_claim("b-ordinary", 2))
    controller = replicas(api, search_steps=STEPS)
    controller.run_pass()
    assert len(devices_of(claims_in(api)["b-ordinary"])) == 2
    failed, waiting = events(api, "FailedAllocation"), events(api, "SearchShareSpent")
    assert sorted(failed) == hostile[:SHARE_UNITS] and sorted(waiting) == hostile[SHARE_UNITS:]
    assert "namespace evil" in waiting[hostile[-1]]
    controller.run_pass()  # the next pass gives the namespace a share again, from its first claim
    assert sorted(events(api, "FailedAllocation")) == hostile[:SHARE_UNITS]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_stalled_loop_fails_its_probe_and_leaves_the_lease_to_expire():
    clock = FakeClock()
    progress = Progress(stall_s=60, clock=clock)
    api = InMemoryControllerApi()
    timings = LeaseTimings(lease_s=15, renew_deadline_s=10, retry_s=2)
    leader = LeaderElector(api, "ns", "lease", "a", timings, clock=clock, stalled=progress.stalled)
    standby = LeaderElector(api, "ns", "lease", "b", timings, clock=clock)
    server = serve_health(0, progress)
    url = f"http://127.0.0.1:{server.server_address[1]}/healthz"
    try:
        assert leader.try_acquire_or_renew()
        assert urllib.request.urlopen(url, timeout=5).status == 200
        clock.now = 59.0  # a pass placing units one after another: renewed, healthy
        progress.beat()
        clock.now = 118.0
        assert leader.try_acquire_or_renew() and leader.leading()
        clock.now = 119.5  # nothing for 60.5 s
        with pytest.raises(urllib.error.HTTPError) as probe:
            urllib.request.urlopen(url, timeout=5)
        assert probe.value.code == 503 and b"stalled: no progress for 60 s" in probe.value.read()
        assert not leader.try_acquire_or_renew() and not leader.leading()  # stops acting at once
        assert not standby.try_acquire_or_renew()  # the Lease runs out on its own, unrenewed
        clock.now = 134.6  # 15 s after the standby first saw it
        assert standby.try_acquire_or_renew()
    finally:
        server.shutdown()
