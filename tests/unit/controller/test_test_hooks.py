"""The controller's test hooks arrive in its constructor: its writes stop where they say, and its
wall clock (allocation timestamps, Events) runs as far off as they say; production's do nothing."""

from __future__ import annotations

import datetime
from collections.abc import Iterable

from driver.common.testhooks import TestHooks
from tests.support.controller_cluster import claims_in, fake_cluster, opt_in_claim


class Recording(TestHooks):
    """Hooks that note each stop and run the clock an hour behind."""

    clock_offset_s = -3600.0

    def __init__(self) -> None:
        self.stops: list[tuple[str, list[str]]] = []

    def stop_before(self, write: str, claims: Iterable[str]) -> None:
        self.stops.append((write, list(claims)))


def _allocated_at(claim: dict) -> datetime.datetime:
    stamp = claim["status"]["allocation"]["allocationTimestamp"]
    return datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)


def test_writes_stop_before_the_ledger_then_the_status_and_the_clock_is_shifted(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    api.put("claims", opt_in_claim("a", 1))
    hooks = Recording()
    replicas(api, hooks=hooks).run_pass()
    assert hooks.stops == [("ledger", ["ml/a"]), ("status", ["ml/a"])]
    behind = datetime.datetime.now(datetime.UTC) - _allocated_at(claims_in(api)["a"])
    assert datetime.timedelta(minutes=59) < behind < datetime.timedelta(minutes=61)


def test_without_hooks_the_clock_is_the_machines(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    api.put("claims", opt_in_claim("a", 1))
    replicas(api).run_pass()
    behind = datetime.datetime.now(datetime.UTC) - _allocated_at(claims_in(api)["a"])
    assert abs(behind) < datetime.timedelta(minutes=1)
