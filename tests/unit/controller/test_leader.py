"""Leader election on a fake clock: expiry judged by the standby's own clock, renew deadlines,
a released lease, a stale write."""

from __future__ import annotations

from typing import Any

import pytest

from driver.controller.leader import LeaderElector, LeaseTimings
from testbed.controller_api import InMemoryControllerApi


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


TIMINGS = LeaseTimings(lease_s=15, renew_deadline_s=10, retry_s=2)


def electors(
    api: InMemoryControllerApi, clock: FakeClock, changes: list[tuple[str, bool]] | None = None
) -> list[LeaderElector]:
    sink = changes if changes is not None else []
    return [
        LeaderElector(api, "ns", "lease", name, TIMINGS, lambda up, n=name: sink.append((n, up)), clock)
        for name in ("a", "b")
    ]


def set_lease(api: InMemoryControllerApi, **spec: Any) -> None:
    lease = api.get("leases", "ns/lease")
    api.put("leases", {**lease, "spec": {**lease["spec"], **spec}})


def test_a_standby_judges_expiry_by_its_own_clock_never_by_renew_time():
    api, clock = InMemoryControllerApi(), FakeClock()
    first, second = electors(api, clock)
    assert first.try_acquire_or_renew() and not second.try_acquire_or_renew()
    clock.now = 1.0
    set_lease(api, renewTime="2000-01-01T00:00:00.000000Z")  # the holder's clock is far behind: a change all the same
    assert not second.try_acquire_or_renew()
    clock.now = 15.9  # 14.9 s after the change this replica saw
    assert not second.try_acquire_or_renew()
    clock.now = 16.1
    assert second.try_acquire_or_renew()
    lease = api.get("leases", "ns/lease")["spec"]
    assert lease["holderIdentity"] == "b" and lease["leaseTransitions"] == 1
    assert not first.leading()  # its renew deadline (0 + 10 s) passed long before


def test_a_renew_time_in_the_future_does_not_keep_a_dead_holder():
    api, clock = InMemoryControllerApi(), FakeClock()
    first, second = electors(api, clock)
    assert first.try_acquire_or_renew() and not second.try_acquire_or_renew()
    set_lease(api, renewTime="2999-01-01T00:00:00.000000Z")  # a holder whose clock runs far ahead, then dies
    assert not second.try_acquire_or_renew()
    clock.now = 15.1
    assert second.try_acquire_or_renew()


def test_the_leader_stops_at_its_renew_deadline_before_a_standby_may_take_over():
    api, clock = InMemoryControllerApi(), FakeClock()
    changes: list[tuple[str, bool]] = []
    first, second = electors(api, clock, changes)
    assert first.try_acquire_or_renew() and not second.try_acquire_or_renew()
    clock.now = 2.0
    assert first.try_acquire_or_renew() and not second.try_acquire_or_renew()  # renewed at 2: leads until 12
    api.lease_outage = True
    clock.now = 11.9
    assert not first.try_acquire_or_renew() and first.leading()
    clock.now = 12.0
    assert not first.leading()  # at the deadline, without waiting for another attempt
    api.lease_outage = False
    clock.now = 16.9  # the standby saw the last change at 2.0: it waits until 17
    assert not second.try_acquire_or_renew()
    clock.now = 17.1
    assert second.try_acquire_or_renew()
    assert changes == [("a", True), ("b", True)]


def test_a_leader_that_sees_another_holder_stops_at_once():
    api, clock = InMemoryControllerApi(), FakeClock()
    changes: list[tuple[str, bool]] = []
    first, _ = electors(api, clock, changes)
    assert first.try_acquire_or_renew()
    set_lease(api, holderIdentity="b")
    clock.now = 2.0
    assert not first.try_acquire_or_renew() and not first.leading()
    assert changes == [("a", True), ("a", False)]


def test_a_released_lease_is_taken_at_once_and_a_stale_write_loses():
    api, clock = InMemoryControllerApi(), FakeClock()
    first, second = electors(api, clock)
    assert first.try_acquire_or_renew()
    first.release()
    assert not first.leading()
    assert second.try_acquire_or_renew()  # no wait for expiry
    lease = api.get("leases", "ns/lease")
    api.put("leases", lease)  # someone writes between this replica's read and its write
    real_get = api.get_lease
    api.get_lease = lambda ns, name: lease  # type: ignore[method-assign]
    clock.now = 2.0
    assert not second.try_acquire_or_renew() and not second.leading()
    api.get_lease = real_get  # type: ignore[method-assign]


def test_a_renewal_answered_after_the_renew_deadline_is_not_acted_on():
    api, clock = InMemoryControllerApi(), FakeClock()
    changes: list[tuple[str, bool]] = []
    first, second = electors(api, clock, changes)
    real_replace = api.replace_lease

    def slow_replace(namespace: str, lease: dict[str, Any]) -> dict[str, Any]:
        written = real_replace(namespace, lease)
        clock.now += 10.5  # the answer arrives after the renew deadline (10 s from the attempt's start)
        return written

    api.replace_lease = slow_replace  # type: ignore[method-assign]
    assert first.try_acquire_or_renew()  # created: no replace yet
    clock.now = 2.0
    assert not first.try_acquire_or_renew() and not first.leading()  # written at 2, known only at 12.5
    api.replace_lease = real_replace  # type: ignore[method-assign]
    assert not second.try_acquire_or_renew()  # the standby saw the change at 12.5: it waits until 27.5
    clock.now = 27.6
    assert second.try_acquire_or_renew() and not first.leading()
    assert changes == [("a", True), ("b", True)]


def test_a_standby_wakes_when_the_lease_it_watches_runs_out():
    api, clock = InMemoryControllerApi(), FakeClock()
    first, second = electors(api, clock)
    assert first.try_acquire_or_renew() and not second.try_acquire_or_renew()
    assert first._next_try() == TIMINGS.retry_s
    clock.now = 14.5
    assert second._next_try() == pytest.approx(0.51)  # not a whole retry period later


def test_lease_timings_leave_room_for_a_late_renewal():
    for lease_s, deadline_s, retry_s in ((10, 10, 2), (15, 10, 9), (15, 16, 2)):
        with pytest.raises(ValueError):
            LeaseTimings(lease_s, deadline_s, retry_s)
