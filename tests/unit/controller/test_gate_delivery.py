"""A gate is lifted once the claim watch delivered the allocation the controller wrote (kube-scheduler,
watching the same API server, then very likely has it too); after a bounded wait, all the same."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import REGISTRY

from driver.controller.controller import MAX_IN_FLIGHT, Controller
from driver.controller.gates import GatedPods, GateLifter
from testbed.controller_api import InMemoryControllerApi
from tests.support.controller_cluster import fake_cluster, gated_pod, gates, opt_in_claim

LONG_S = 10.0  # a wait that must end well before this, never by its timeout


class WatchedClaimsApi(InMemoryControllerApi):
    """The in-memory API with a watch of the claims that sends what the test delivers, when it
    does; and, at each gate lifted, whether the watch had sent the pod's claim as it is then."""

    def __init__(self, slices: str) -> None:
        super().__init__()
        cluster = fake_cluster(slices)
        self.store, self.version = cluster.store, cluster.version
        self._events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._sent: dict[str, str] = {}  # claim name -> the resourceVersion the watch sent last
        self.status_written = threading.Event()
        self.lifted = threading.Event()
        self.sent_when_lifted: list[bool] = []

    def watch(
        self, kind: str, resource_version: str, timeout_s: int, label_selector: str = "", namespace: str = ""
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        assert kind == "claims"  # the only informer these tests start
        while (obj := self._events.get()) is not None:
            self._sent[obj["metadata"]["name"]] = obj["metadata"]["resourceVersion"]
            yield "MODIFIED", obj

    def deliver(self, name: str) -> None:
        self._events.put(self.get("claims", f"ml/{name}"))

    def close(self) -> None:
        self._events.put(None)

    def replace_claim_status(self, claim: dict[str, Any]) -> dict[str, Any]:
        written = super().replace_claim_status(claim)
        self.status_written.set()
        return written

    def set_scheduling_gates(self, pod: dict[str, Any], gates: list[Any]) -> dict[str, Any]:
        claim = pod["spec"]["resourceClaims"][0]["resourceClaimName"]
        current = self.store["claims"][f"ml/{claim}"]["metadata"]["resourceVersion"]
        self.sent_when_lifted.append(self._sent.get(claim) == current)
        lifted = super().set_scheduling_gates(pod, gates)
        self.lifted.set()
        return lifted


@pytest.fixture
def watched(h100_slices: str, replicas: Any) -> Iterator[tuple[WatchedClaimsApi, Controller]]:
    """A controller whose claims informer runs on the test's watch (the other caches are relisted)."""
    api = WatchedClaimsApi(h100_slices)
    controller = replicas(api)
    yield api, controller
    controller.informers["claims"].stop()
    api.close()  # the watch returns, the stopped informer ends


def gated_pods_of_claims(api: WatchedClaimsApi, controller: Controller, names: list[str]) -> None:
    """Each name an opt-in claim with its gated pod, in the caches; the claims informer on the
    test's watch."""
    for name in names:
        api.put("claims", opt_in_claim(name, 1))
        api.put("pods", gated_pod(f"pod-{name}", name))
    controller.informers["pods"].relist()
    informer = controller.informers["claims"]
    informer.start()
    assert informer.synced.wait(LONG_S)


def allocated_by_us(api: WatchedClaimsApi, controller: Controller, name: str) -> None:
    """The claim allocated as the controller writes it: the API server's answer put in the cache."""
    claim = api.get("claims", f"ml/{name}")
    allocated = {**claim, "status": {"allocation": {"devices": {"results": []}}}}
    controller.informers["claims"].update(api.replace_claim_status(allocated))


def lifted_early() -> float:
    return REGISTRY.get_sample_value("fgpu_controller_gates_lifted_early_total") or 0.0


def test_the_gate_waits_for_the_watch_to_deliver_the_allocation(watched):
    api, controller = watched
    gated_pods_of_claims(api, controller, ["a"])
    early = lifted_early()
    passing = threading.Thread(target=controller.run_pass)
    passing.start()
    assert api.status_written.wait(LONG_S)  # the allocation is written, and in the controller's cache
    assert not api.lifted.wait(0.2)  # ... but the watch has not brought it: the gate stays
    assert gates(api, "pod-a") == ["gpu.fgpu.dev/allocation"]
    api.deliver("a")
    passing.join(LONG_S)
    assert gates(api, "pod-a") == []
    assert api.sent_when_lifted == [True]
    assert lifted_early() == early


def test_a_watch_that_does_not_deliver_delays_the_gate_only_so_long(watched):
    api, controller = watched
    gated_pods_of_claims(api, controller, ["a"])
    allocated_by_us(api, controller, "a")
    early = lifted_early()
    lifter = GateLifter(controller.replica, GatedPods(controller.informers["pods"]), delivery_wait_s=0.05)
    lifter.lift_pods(["ml/a"])
    assert gates(api, "pod-a") == []  # lifted all the same: never stranded
    assert api.sent_when_lifted == [False]
    assert lifted_early() == early + 1


def test_lifting_many_waits_until_one_deadline(watched, monkeypatch):
    """More pods than writers: each waits until the pass's deadline, not one wait after another."""
    api, controller = watched
    names = [f"c{i}" for i in range(MAX_IN_FLIGHT * 2 + 1)]
    gated_pods_of_claims(api, controller, names)
    for name in names:
        allocated_by_us(api, controller, name)
    claims = controller.informers["claims"]
    wait_delivered = claims.wait_delivered
    ends: list[float] = []

    def recorded(obj: dict[str, Any], timeout_s: float) -> bool:
        ends.append(time.monotonic() + timeout_s)
        return wait_delivered(obj, timeout_s)

    monkeypatch.setattr(claims, "wait_delivered", recorded)
    wait_s = 0.2
    lifter = GateLifter(controller.replica, GatedPods(controller.informers["pods"]), delivery_wait_s=wait_s)
    begun = time.monotonic()
    lifter.lift_all()
    assert len(ends) == len(names)
    assert max(ends) < begun + wait_s * 1.5  # one after another: the last round would end at 3 x wait_s
    assert all(gates(api, f"pod-{name}") == [] for name in names)
