"""Controller pieces without an API server: leader election on a fake clock, the ledger fence
with two replicas that both believe they lead, conflicts, gangs (labelled, and PodGroups), gates,
pod claims, plan CLI, making room (evictions, reservations, preemption)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from driver.allocator.model import claim_from_object
from driver.controller.controller import Controller
from driver.controller.informer import Informer, object_key
from driver.controller.leader import LeaderElector, LeaseTimings
from driver.controller.ledger import FENCE_ANNOTATION, entries_of, ledger_name
from driver.controller.victims import EvictionBudget
from driver.kube.client import ConflictError, KubeUnavailableError, NotFoundError, RefusedError
from driver.scheduling.opt_in import gang_of, known_claim_names, pending, pod_claim_names

ROOT = Path(__file__).resolve().parents[3]


class FakeApi:
    """The API server as far as the controller sees it: objects with resourceVersions, writes
    conditioned on them (a stale one conflicts), status and main resource written apart."""

    def __init__(self) -> None:
        self.version = 100
        self.store: dict[str, dict[str, dict[str, Any]]] = {
            kind: {} for kind in ("slices", "classes", "claims", "pods", "nodes", "ledgers", "leases", "podgroups")
        }
        self.events: list[dict[str, Any]] = []
        self.status_writes: list[str] = []  # claim names, in order
        self.failing_status_writes: set[int] = set()  # status writes (counted from 1) that meet an outage
        self.lost_replies: set[int] = set()  # status writes applied whose answer never comes (a timeout)
        self.lease_outage = False
        self.write_delay_s = 0.0
        self.ledger_writes = 0
        self.evicted: list[str] = []  # pod names, in order
        self.deleted: list[str] = []
        self.budgeted: set[str] = set()  # pods a PodDisruptionBudget protects: their eviction is refused
        self._lock = threading.Lock()
        self.in_flight = self.most_in_flight = 0

    # --- storage ---

    def put(self, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or overwrite, unconditionally (the test acting as another client)."""
        with self._lock:
            self.version += 1
            obj = copy.deepcopy(obj)
            obj["metadata"]["resourceVersion"] = str(self.version)
            obj["metadata"].setdefault("uid", f"uid-{obj['metadata']['name']}")
            self.store[kind][object_key(obj)] = obj
            return copy.deepcopy(obj)

    def get(self, kind: str, key: str) -> dict[str, Any]:
        if key not in self.store[kind]:
            raise NotFoundError(key)
        return copy.deepcopy(self.store[kind][key])

    def _replace(self, kind: str, obj: dict[str, Any], keep: str | None = None) -> dict[str, Any]:
        with self._lock:
            current = self.store[kind].get(object_key(obj))
            if current is None:
                raise NotFoundError(object_key(obj))
            if obj["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                raise ConflictError("the object has been modified")
        if keep == "status":  # an update of the main resource leaves the status alone, and vice versa
            obj = {**obj, "status": current.get("status")}
        elif keep == "metadata":
            obj = {**obj, "metadata": {**current["metadata"]}}
        return self.put(kind, obj)

    def list_pages(
        self, kind: str, label_selector: str = "", namespace: str = "", limit: int = 500
    ) -> Iterator[tuple[list[dict[str, Any]], str]]:
        """In pages of at most 2 objects, whatever the limit: every list in these tests is paged."""
        with self._lock:
            items, version = copy.deepcopy(list(self.store[kind].values())), str(self.version)
        for start in range(0, max(len(items), 1), 2):
            yield items[start : start + 2], version

    # --- the controller's calls ---

    def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        return self.get("claims", f"{namespace}/{name}")

    def replace_claim(self, claim: dict[str, Any]) -> dict[str, Any]:
        return self._replace("claims", claim, keep="status")

    def replace_claim_status(self, claim: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.status_writes.append(claim["metadata"]["name"])
            outage = len(self.status_writes) in self.failing_status_writes
            lost = len(self.status_writes) in self.lost_replies
        try:
            time.sleep(self.write_delay_s)  # lets concurrent writes overlap
            if outage:
                raise KubeUnavailableError("API server unreachable")
            written = self._replace("claims", claim, keep="metadata")
            if lost:
                raise KubeUnavailableError("timed out waiting for the answer")
            return written
        finally:
            with self._lock:
                self.in_flight -= 1

    def create_ledger(self, namespace: str, ledger: dict[str, Any]) -> dict[str, Any]:
        if object_key(ledger) in self.store["ledgers"]:
            raise ConflictError("already exists")
        return self.put("ledgers", ledger)

    def replace_ledger(self, namespace: str, ledger: dict[str, Any]) -> dict[str, Any]:
        self.ledger_writes += 1
        time.sleep(self.write_delay_s)
        return self._replace("ledgers", ledger)

    def set_scheduling_gates(self, pod: dict[str, Any], gates: list[Any]) -> dict[str, Any]:
        return self._replace("pods", {**pod, "spec": {**pod["spec"], "schedulingGates": gates}})

    def create_event(self, namespace: str, event: dict[str, Any]) -> dict[str, Any]:
        self.events.append(event)
        return event

    def evict_pod(self, namespace: str, name: str) -> str | None:
        if name in self.budgeted:
            return "Cannot evict pod as it would violate the pod's disruption budget."
        self.store["pods"].pop(f"{namespace}/{name}")
        self.evicted.append(name)
        return None

    def delete_pod(self, namespace: str, name: str) -> None:
        self.store["pods"].pop(f"{namespace}/{name}")
        self.deleted.append(name)

    def get_lease(self, namespace: str, name: str) -> dict[str, Any]:
        if self.lease_outage:
            raise KubeUnavailableError("API server unreachable")
        return self.get("leases", f"{namespace}/{name}")

    def create_lease(self, namespace: str, lease: dict[str, Any]) -> dict[str, Any]:
        if self.lease_outage:
            raise KubeUnavailableError("API server unreachable")
        if object_key(lease) in self.store["leases"]:
            raise ConflictError("already exists")
        return self.put("leases", lease)

    def replace_lease(self, namespace: str, lease: dict[str, Any]) -> dict[str, Any]:
        if self.lease_outage:
            raise KubeUnavailableError("API server unreachable")
        return self._replace("leases", lease)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


TIMINGS = LeaseTimings(lease_s=15, renew_deadline_s=10, retry_s=2)


def electors(api: FakeApi, clock: FakeClock, changes: list[tuple[str, bool]] | None = None) -> list[LeaderElector]:
    sink = changes if changes is not None else []
    return [
        LeaderElector(api, "ns", "lease", name, TIMINGS, lambda up, n=name: sink.append((n, up)), clock)
        for name in ("a", "b")
    ]


def set_lease(api: FakeApi, **spec: Any) -> None:
    lease = api.get("leases", "ns/lease")
    api.put("leases", {**lease, "spec": {**lease["spec"], **spec}})


def test_a_standby_judges_expiry_by_its_own_clock_never_by_renew_time():
    api, clock = FakeApi(), FakeClock()
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
    api, clock = FakeApi(), FakeClock()
    first, second = electors(api, clock)
    assert first.try_acquire_or_renew() and not second.try_acquire_or_renew()
    set_lease(api, renewTime="2999-01-01T00:00:00.000000Z")  # a holder whose clock runs far ahead, then dies
    assert not second.try_acquire_or_renew()
    clock.now = 15.1
    assert second.try_acquire_or_renew()


def test_the_leader_stops_at_its_renew_deadline_before_a_standby_may_take_over():
    api, clock = FakeApi(), FakeClock()
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
    api, clock = FakeApi(), FakeClock()
    changes: list[tuple[str, bool]] = []
    first, _ = electors(api, clock, changes)
    assert first.try_acquire_or_renew()
    set_lease(api, holderIdentity="b")
    clock.now = 2.0
    assert not first.try_acquire_or_renew() and not first.leading()
    assert changes == [("a", True), ("a", False)]


def test_a_released_lease_is_taken_at_once_and_a_stale_write_loses():
    api, clock = FakeApi(), FakeClock()
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
    api, clock = FakeApi(), FakeClock()
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
    api, clock = FakeApi(), FakeClock()
    first, second = electors(api, clock)
    assert first.try_acquire_or_renew() and not second.try_acquire_or_renew()
    assert first._next_try() == TIMINGS.retry_s
    clock.now = 14.5
    assert second._next_try() == pytest.approx(0.51)  # not a whole retry period later


def test_lease_timings_leave_room_for_a_late_renewal():
    for lease_s, deadline_s, retry_s in ((10, 10, 2), (15, 10, 9), (15, 16, 2)):
        with pytest.raises(ValueError):
            LeaseTimings(lease_s, deadline_s, retry_s)


def test_pod_claims_from_names_and_templates():
    pod = {
        "spec": {
            "resourceClaims": [
                {"name": "a", "resourceClaimName": "shared"},
                {"name": "b", "resourceClaimTemplateName": "t"},
            ]
        },
        "status": {},
    }
    assert pod_claim_names(pod) is None  # the template's claim is not made yet
    assert known_claim_names(pod) == ["shared"]
    pod["status"]["resourceClaimStatuses"] = [{"name": "b", "resourceClaimName": "pod-b-x1"}]
    assert pod_claim_names(pod) == known_claim_names(pod) == ["shared", "pod-b-x1"]


def test_gang_labels_and_opt_in():
    labels = {"gpu.fgpu.dev/allocator": "fgpu", "gpu.fgpu.dev/gang": "train", "gpu.fgpu.dev/gang-size": "4"}
    obj = {"metadata": {"name": "c", "namespace": "ns", "labels": labels}, "spec": {"devices": {"requests": []}}}
    assert pending(obj) and gang_of(claim_from_object(obj)) == ("ns/train", 4)
    obj["metadata"]["labels"] = {**labels, "gpu.fgpu.dev/gang-size": "four"}
    assert gang_of(claim_from_object(obj)) == ("ns/train", 0)
    assert not pending({**obj, "status": {"allocation": {"devices": {}}}})
    assert not pending({"metadata": {"labels": {}}})


def discover(tmp_path: Path, node: str, machine: str) -> Path:
    command = [
        sys.executable,
        "-m",
        "driver.cli",
        "discover",
        "--nvml",
        f"mock:{machine}",
        "--node-name",
        node,
        "-o",
        "json",
    ]
    path = tmp_path / f"{node}.json"
    path.write_text(subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT).stdout)
    return path


def test_plan_prints_allocations_reasons_and_free_capacity(tmp_path: Path):
    claims = tmp_path / "claims.yaml"
    claims.write_text(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: four, namespace: ml}\n"
        "spec: {devices: {requests: [{name: r, exactly: {deviceClassName: gpu.fgpu.dev, count: 4}}]}}\n---\n"
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: huge-share, namespace: ml}\n"
        "spec: {devices: {requests: [{name: r, exactly: {deviceClassName: mps.gpu.fgpu.dev,"
        " capacity: {requests: {memory: 100Gi}}}}]}}\n"
    )
    slices = [discover(tmp_path, "n1", "dgx-h100"), discover(tmp_path, "n2", "l4x4")]
    command = [sys.executable, "-m", "driver.cli", "plan", "--slices", *map(str, slices), "--claims", str(claims)]
    command += ["--classes", str(ROOT / "daemonset" / "deviceclasses.yaml")]
    run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 1, run.stderr
    assert "ml/four: n1: gpu-0, gpu-1, gpu-2, gpu-3" in run.stdout
    assert (
        "ml/huge-share: cannot allocate: request r: no device of class mps.gpu.fgpu.dev with memory >= 100Gi"
        in run.stdout
    )
    assert "1 allocated, 1 failed" in run.stdout
    assert "  gpu-0-counters: full" in run.stdout and "  gpu-4-counters: free" in run.stdout
    as_json = json.loads(subprocess.run([*command, "-o", "json"], capture_output=True, text=True, cwd=ROOT).stdout)
    assert as_json["claims"][0]["node"] == "n1" and "error" in as_json["claims"][1]


def test_plan_reports_bad_files(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "kind: ResourceSlice\nmetadata: {name: s}\nspec: {devices: [{name: d, capacity: {memory: {value: lots}}}]}\n"
    )
    command = [
        sys.executable,
        "-m",
        "driver.cli",
        "plan",
        "--slices",
        str(bad),
        "--classes",
        str(bad),
        "--claims",
        str(bad),
    ]
    run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2 and "invalid quantity 'lots'" in run.stderr


@pytest.fixture(scope="module")
def h100_slices(tmp_path_factory: pytest.TempPathFactory) -> str:
    return discover(tmp_path_factory.mktemp("slices"), "n1", "dgx-h100").read_text()


def fake_cluster(template: str, nodes: int = 1) -> FakeApi:
    """One dgx-h100 node's slices per node (n1, n2, ...), the device classes, the nodes."""
    api = FakeApi()
    for i in range(1, nodes + 1):
        for obj in json.loads(template.replace('"n1', f'"n{i}'))["items"]:
            api.put("slices", obj)
        api.put("nodes", {"metadata": {"name": f"n{i}", "labels": {}}})
    for obj in yaml.safe_load_all((ROOT / "daemonset" / "deviceclasses.yaml").read_text()):
        if obj:
            api.put("classes", obj)
    return api


@pytest.fixture
def replicas() -> Any:
    """Controllers that believe they lead (the lease is tested above), synced with the fake."""
    started: list[Controller] = []

    def start(api: FakeApi, identity: str = "a", evictions_per_minute: int = 0, compact: bool = False) -> Controller:
        controller = Controller(
            api, identity, lease_namespace="fgpu", evictions_per_minute=evictions_per_minute, compact=compact
        )
        controller.leader.leading = lambda: True  # type: ignore[method-assign]
        sync(controller)
        started.append(controller)
        return controller

    yield start
    for controller in started:
        controller.stop()
        controller._writers.shutdown(wait=True)


def sync(controller: Controller, *kinds: str) -> None:
    for kind in kinds or controller.informers:
        controller.informers[kind].relist()


def opt_in_claim(name: str, count: int, **labels: str) -> dict[str, Any]:
    meta = {"name": name, "namespace": "ml", "labels": {"gpu.fgpu.dev/allocator": "fgpu", **labels}}
    request = {"name": "r", "exactly": {"deviceClassName": "gpu.fgpu.dev", "count": count}}
    return {"metadata": meta, "spec": {"devices": {"requests": [request]}}}


def gated_pod(name: str, claim: str) -> dict[str, Any]:
    spec = {"schedulingGates": [{"name": "gpu.fgpu.dev/allocation"}, {"name": "other"}]}
    spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
    return {"metadata": {"name": name, "namespace": "ml"}, "spec": spec}


def devices_of(claim: dict[str, Any]) -> list[tuple[str, str]]:
    allocation = (claim.get("status") or {}).get("allocation") or {}
    return [(r["pool"], r["device"]) for r in allocation.get("devices", {}).get("results", [])]


def claims_in(api: FakeApi) -> dict[str, dict[str, Any]]:
    return {c["metadata"]["name"]: c for c in api.store["claims"].values()}


def assert_no_device_given_twice(api: FakeApi) -> None:
    held = [d for c in api.store["claims"].values() for d in devices_of(c)]
    assert len(held) == len(set(held)), held


def gates(api: FakeApi, pod: str) -> list[str]:
    return [g["name"] for g in api.store["pods"][f"ml/{pod}"]["spec"]["schedulingGates"]]


def ledger_entries(api: FakeApi, pool: str = "n1") -> dict[str, Any]:
    ledger = api.store["ledgers"].get(f"fgpu/{ledger_name(('gpu.fgpu.dev', pool))}")
    return entries_of(ledger) if ledger else {}


def test_the_ledger_records_the_claim_before_its_status_and_only_our_gate_is_lifted(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    api.put("claims", opt_in_claim("train", 2))
    api.put("pods", gated_pod("trainer", "train"))
    replicas(api).run_pass()
    claim = claims_in(api)["train"]
    assert len(devices_of(claim)) == 2
    assert "resource.kubernetes.io/delete-protection" in claim["metadata"]["finalizers"]
    (entry,) = ledger_entries(api).values()
    assert entry.claim == "ml/train" and {("n1", d) for d, _ in entry.results} == set(devices_of(claim))
    assert int(entry.version) < int(claim["metadata"]["resourceVersion"])  # the status write's precondition
    assert gates(api, "trainer") == ["other"]


def test_a_conflict_ends_the_pass_and_the_claims_are_read_afresh(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    claim = api.put("claims", opt_in_claim("train", 2))
    controller = replicas(api)
    api.put("claims", {**claim, "metadata": {**claim["metadata"], "labels": {**claim["metadata"]["labels"], "x": "y"}}})
    controller.run_pass()  # its copy of the claim is stale: the write conflicts, nothing is allocated
    assert not api.status_writes and not ledger_entries(api)
    assert controller.informers["claims"].get("ml/train")["metadata"]["labels"]["x"] == "y"  # read afresh
    controller.run_pass()
    assert len(devices_of(claims_in(api)["train"])) == 2


def test_two_replicas_that_both_lead_never_give_a_device_twice(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    first, second = replicas(api, "a"), replicas(api, "b")  # both synced while nothing was allocated
    api.put("claims", opt_in_claim("x", 6))
    sync(first, "claims")
    first.run_pass()
    assert len(devices_of(claims_in(api)["x"])) == 6
    # The second replica's cache never saw x nor the ledger (as after a pause): it places y on GPUs
    # x holds, and its ledger write conflicts; it reads afresh and finds y cannot fit.
    second.informers["claims"].update(api.put("claims", opt_in_claim("y", 6)))
    second.run_pass()
    assert devices_of(claims_in(api)["y"]) == []
    assert second.informers["claims"].get("ml/x")["status"]["allocation"]  # read afresh
    second.run_pass()
    assert devices_of(claims_in(api)["y"]) == []
    assert [e["reason"] for e in api.events] == ["FailedAllocation"]
    assert_no_device_given_twice(api)


def test_a_decision_left_by_a_stopped_replica_is_voided_before_its_claim_is_placed_again(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    api.put("claims", opt_in_claim("x", 8))
    stopped = replicas(api, "a")
    real_change = stopped.ledgers.change

    def change_then_stop(*args: Any, **kwargs: Any) -> bool:
        ok = real_change(*args, **kwargs)
        stopped.leader.leading = lambda: False  # type: ignore[method-assign]  # SIGSTOP right after the ledger write
        return ok

    stopped.ledgers.change = change_then_stop  # type: ignore[method-assign]
    stopped.run_pass()
    (decided,) = ledger_entries(api).values()
    assert devices_of(claims_in(api)["x"]) == []
    held = stopped.informers["claims"].get("ml/x")  # what it will write when it resumes
    assert held["metadata"]["resourceVersion"] == decided.version

    successor = replicas(api, "b")
    successor.run_pass()
    claim = claims_in(api)["x"]
    assert claim["metadata"]["annotations"][FENCE_ANNOTATION] == decided.version
    assert len(devices_of(claim)) == 8
    (entry,) = ledger_entries(api).values()
    assert entry.version != decided.version
    allocation = {"devices": {"results": [{"driver": "gpu.fgpu.dev", "pool": "n1", "device": "gpu-0"}]}}
    with pytest.raises(ConflictError):  # the resumed replica's write of its old decision fails
        api.replace_claim_status({**held, "status": {"allocation": allocation}})


def test_an_entry_holds_the_devices_until_its_claim_is_gone(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    api.put("claims", opt_in_claim("x", 8))
    controller = replicas(api)
    controller.run_pass()
    x = claims_in(api)["x"]
    controller.informers["claims"].update({**x, "status": {}})  # a cache that lost x's allocation
    controller.informers["claims"].update(api.put("claims", opt_in_claim("y", 8)))
    controller.run_pass()  # the ledger still holds x's GPUs: y waits
    assert devices_of(claims_in(api)["y"]) == [] and len(devices_of(claims_in(api)["x"])) == 8
    del api.store["claims"]["ml/x"]
    sync(controller, "claims")  # the watch's DELETED
    controller.run_pass()  # x's entry is checked against the API server: x is gone, so is its entry
    assert [e.claim for e in ledger_entries(api).values()] == ["ml/y"]
    assert len(devices_of(claims_in(api)["y"])) == 8


def test_writes_overlap_with_a_bound_on_how_many(h100_slices, replicas):
    api = fake_cluster(h100_slices, nodes=5)
    for i in range(40):
        api.put("claims", opt_in_claim(f"c{i:02d}", 1))
    api.write_delay_s = 0.02
    replicas(api).run_pass()
    assert 1 < api.most_in_flight <= 16
    assert api.ledger_writes < 40  # units that reach a ledger together share one write
    assert all(len(devices_of(c)) == 1 for c in claims_in(api).values())
    assert_no_device_given_twice(api)


def test_controller_waits_for_the_whole_gang_and_reports_once(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    gang = {"gpu.fgpu.dev/gang": "g", "gpu.fgpu.dev/gang-size": "3"}
    for obj in [opt_in_claim(f"w{i}", 2, **gang) for i in range(2)] + [opt_in_claim("huge", 9)]:
        api.put("claims", obj)
    controller = replicas(api)
    controller.run_pass()
    controller.run_pass()
    assert not api.status_writes
    reasons = sorted((e["involvedObject"]["name"], e["reason"], e["message"]) for e in api.events)
    assert [r[:2] for r in reasons] == [
        ("huge", "FailedAllocation"),
        ("w0", "WaitingForGang"),
        ("w1", "WaitingForGang"),
    ]
    assert "waits for 1 more claim(s) of 3" in reasons[1][2]
    controller.informers["claims"].update(api.put("claims", opt_in_claim("w2", 2, **gang)))
    controller.run_pass()
    assert sorted(api.status_writes) == ["w0", "w1", "w2"]


def gang_with_pods(slices: str, size: int) -> FakeApi:
    """A gang of `size` claims of 2 GPUs (w0, w1, ...), a gated pod for each (p0, p1, ...)."""
    api = fake_cluster(slices)
    gang = {"gpu.fgpu.dev/gang": "g", "gpu.fgpu.dev/gang-size": str(size)}
    for i in range(size):
        api.put("claims", opt_in_claim(f"w{i}", 2, **gang))
        api.put("pods", gated_pod(f"p{i}", f"w{i}"))
    return api


def test_a_gang_interrupted_by_an_outage_is_completed_after_a_fresh_read_its_pods_released_then(h100_slices, replicas):
    api = gang_with_pods(h100_slices, 3)
    api.failing_status_writes = {3}  # two members written, the third write fails
    controller = replicas(api)
    controller.run_pass()
    # Nothing is taken back on the view that just proved stale. The third entry stays too: with no
    # answer, w2's write may have landed, until a pass reads w2 afresh (then voids the decision).
    assert [len(devices_of(claims_in(api)[f"w{i}"])) for i in range(3)] == [2, 2, 0]
    assert sorted(e.claim for e in ledger_entries(api).values()) == ["ml/w0", "ml/w1", "ml/w2"]
    assert all(gates(api, f"p{i}") == ["gpu.fgpu.dev/allocation", "other"] for i in range(3))
    controller._lift_gates = lambda: None  # type: ignore[method-assign]  # no sweep: the unit lifts them
    controller.run_pass()
    assert all(len(devices_of(c)) == 2 for c in claims_in(api).values())
    assert api.status_writes == ["w0", "w1", "w2", "w2"]  # only the missing member was placed again
    assert FENCE_ANNOTATION in claims_in(api)["w2"]["metadata"]["annotations"]
    assert sorted(e.claim for e in ledger_entries(api).values()) == ["ml/w0", "ml/w1", "ml/w2"]
    assert all(gates(api, f"p{i}") == ["other"] for i in range(3))
    assert_no_device_given_twice(api)


def test_a_take_back_decided_before_another_replica_completed_the_gang_fails(h100_slices, replicas):
    api = gang_with_pods(h100_slices, 2)
    api.failing_status_writes = {2}
    stale = replicas(api, "a")
    stale.run_pass()  # w0 written, w1 not
    decided_on = stale.informers["claims"].get("ml/w0")  # it decides to take w0 back, then stops
    successor = replicas(api, "b")
    successor.run_pass()  # completes the gang, w0 kept
    assert all(len(devices_of(c)) == 2 for c in claims_in(api).values())
    assert all(gates(api, f"p{i}") == ["other"] for i in range(2))
    stale._take_back([decided_on])  # it resumes: the write its decision leads to
    assert all(len(devices_of(c)) == 2 for c in claims_in(api).values())  # refused: w0 was fenced
    assert_no_device_given_twice(api)


def test_a_status_write_that_may_have_landed_keeps_its_entry(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    api.put("claims", opt_in_claim("x", 8))
    api.lost_replies = {1}  # x's allocation is written, the answer is lost
    first = replicas(api, "a")
    first.run_pass()
    assert len(devices_of(claims_in(api)["x"])) == 8
    (entry,) = ledger_entries(api).values()  # not dropped on a failure that may be a success
    assert entry.claim == "ml/x"
    # A replica whose cache never saw x allocated (its watch lags) counts the entry: y must wait.
    second = replicas(api, "b")
    x = claims_in(api)["x"]
    second.informers["claims"].update(
        {**x, "metadata": {**x["metadata"], "resourceVersion": entry.version}, "status": {}}
    )
    second.informers["claims"].update(api.put("claims", opt_in_claim("y", 1)))
    second.run_pass()
    assert devices_of(claims_in(api)["y"]) == []
    assert api.status_writes == ["x"]  # nor is x placed again: its entry was checked against the claim
    assert_no_device_given_twice(api)


def test_gang_pods_wait_for_the_whole_gang(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    gang = {"gpu.fgpu.dev/gang": "g", "gpu.fgpu.dev/gang-size": "2"}
    first = opt_in_claim("w0", 2, **gang)
    first["status"] = {"allocation": {"devices": {"results": []}}}  # allocated earlier, its partner is not
    api.put("claims", first)
    api.put("claims", opt_in_claim("w1", 99, **gang))  # w1 cannot fit
    api.put("pods", gated_pod("p0", "w0"))
    replicas(api).run_pass()
    assert gates(api, "p0") == ["gpu.fgpu.dev/allocation", "other"]  # w0 is allocated, its gang is not whole
    assert api.status_writes == ["w0"]  # and w0 was taken back
    assert "allocation" not in claims_in(api)["w0"]["status"]


def test_pods_go_as_soon_as_their_unit_is_written(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    for name in ("a", "b"):
        api.put("claims", opt_in_claim(name, 1))
        api.put("pods", gated_pod(f"pod-{name}", name))
    api.failing_status_writes = {2}  # b's write fails: the pass ends early, a's pod went already
    replicas(api).run_pass()
    assert gates(api, "pod-a") == ["other"]
    assert gates(api, "pod-b") == ["gpu.fgpu.dev/allocation", "other"]


def test_a_standby_keeps_its_allocator_ready_and_writes_nothing(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    api.put("claims", opt_in_claim("x", 2))
    standby = replicas(api)
    standby.leader.leading = lambda: False  # type: ignore[method-assign]
    standby._keep_ready()
    ready = standby._counted
    assert ready is not None and not api.status_writes and not api.store["ledgers"]
    standby.leader.leading = lambda: True  # type: ignore[method-assign]  # it wins the lease
    standby.run_pass()
    assert standby._counted is ready  # the first pass placed on it, nothing rebuilt
    assert len(devices_of(claims_in(api)["x"])) == 2


def test_new_slices_reach_the_allocator_without_gathering_other_nodes_again(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    api.put("claims", opt_in_claim("a", 8))
    controller = replicas(api)
    controller.run_pass()
    snapshot = controller.snapshot()
    n1_pools = snapshot.pools["n1"]
    for obj in json.loads(h100_slices.replace('"n1', '"n2'))["items"]:
        api.put("slices", obj)
    unreadable = json.loads(h100_slices.replace('"n1', '"n3'))["items"][0]
    unreadable["spec"]["sharedCounters"][0]["counters"]["memory-slice-0"]["value"] = "lots"
    api.put("slices", unreadable)
    api.put("claims", opt_in_claim("b", 8))
    sync(controller)
    controller.run_pass()
    assert controller.snapshot() is snapshot and snapshot.pools["n1"] is n1_pools  # n1 untouched
    assert {pool for pool, _ in devices_of(claims_in(api)["b"])} == {"n2"}
    assert {s.pool for s in controller.informers["slices"].items()} == {"n1", "n2"}  # n3's left out


# --- PodGroups (scheduling.k8s.io/v1beta1) with a gang policy ---------------------------------


def podgroup(name: str, min_count: int | None) -> dict[str, Any]:
    policy = {"basic": {}} if min_count is None else {"gang": {"minCount": min_count}}
    return {"metadata": {"name": name, "namespace": "ml"}, "spec": {"schedulingPolicy": policy}}


def group_member(api: FakeApi, name: str, group: str, gpus: int, claim_made: bool = True) -> None:
    """A gated pod of the group whose claim comes from a template: the claim (owned by the pod) and,
    once made, named in the pod's status, as kube-controller-manager does."""
    pod = gated_pod(name, "")
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "two-gpus"}]
    pod["spec"]["schedulingGroup"] = {"podGroupName": group}
    pod = api.put("pods", pod)
    if not claim_made:
        return
    claim = opt_in_claim(f"{name}-gpu-x1", gpus)
    claim["metadata"]["ownerReferences"] = [{"kind": "Pod", "name": name, "uid": pod["metadata"]["uid"]}]
    api.put("claims", claim)
    pod["status"] = {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": f"{name}-gpu-x1"}]}
    api.put("pods", pod)


def group_cluster(slices: str, size: int, pods: int, gpus: int = 2) -> FakeApi:
    api = fake_cluster(slices)
    api.put("podgroups", podgroup("train", size))
    for i in range(pods):
        group_member(api, f"p{i}", "train", gpus)
    return api


def member_claims(api: FakeApi) -> dict[str, dict[str, Any]]:
    return {n: c for n, c in claims_in(api).items() if n.startswith("p")}


def test_a_podgroup_gang_is_placed_whole_or_not_at_all(h100_slices, replicas):
    api = group_cluster(h100_slices, 4, 4)
    api.put("claims", opt_in_claim("blocker", 2))  # 8 GPUs: 6 left, room for 3 members of 4
    controller = replicas(api)
    controller.run_pass()
    assert len(devices_of(claims_in(api)["blocker"])) == 2
    assert all(devices_of(c) == [] for c in member_claims(api).values())
    assert all(gates(api, f"p{i}") == ["gpu.fgpu.dev/allocation", "other"] for i in range(4))
    failed = [e for e in api.events if e["reason"] == "FailedAllocation"]
    assert {e["involvedObject"]["kind"] for e in failed} == {"ResourceClaim", "Pod", "PodGroup"}
    assert len([e for e in failed if e["involvedObject"]["kind"] == "ResourceClaim"]) == 4
    (on_group,) = [e for e in failed if e["involvedObject"]["kind"] == "PodGroup"]
    assert on_group["message"].startswith("pod group ml/train (gang of 4 pods): gang cannot be placed whole")
    assert on_group["involvedObject"]["apiVersion"] == "scheduling.k8s.io/v1beta1"

    del api.store["claims"]["ml/blocker"]  # capacity frees
    sync(controller, "claims")
    controller.run_pass()
    assert all(len(devices_of(c)) == 2 for c in member_claims(api).values())
    assert all(gates(api, f"p{i}") == ["other"] for i in range(4))
    assert_no_device_given_twice(api)


def test_a_podgroup_gang_waits_for_min_count_pods_with_their_claims_made(h100_slices, replicas):
    api = group_cluster(h100_slices, 4, 3)
    group_member(api, "p3", "train", 2, claim_made=False)  # its template's claim is not made yet
    controller = replicas(api)
    controller.run_pass()
    assert not api.status_writes  # nor is any member's claim placed alone
    waiting = [e for e in api.events if e["reason"] == "WaitingForGang"]
    assert waiting and all(e["message"].endswith("pod group ml/train waits for 1 more pod(s) of 4") for e in waiting)
    assert "PodGroup" in {e["involvedObject"]["kind"] for e in waiting}

    # The claim is made (owned by its pod) before the pod's status names it: still waiting.
    pod = api.get("pods", "ml/p3")
    claim = opt_in_claim("p3-gpu-x1", 2)
    claim["metadata"]["ownerReferences"] = [{"kind": "Pod", "name": "p3", "uid": pod["metadata"]["uid"]}]
    api.put("claims", claim)
    sync(controller)
    controller.run_pass()
    assert not api.status_writes

    pod["status"] = {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "p3-gpu-x1"}]}
    api.put("pods", pod)
    sync(controller)
    controller.run_pass()
    assert sorted(api.status_writes) == [f"p{i}-gpu-x1" for i in range(4)]
    assert all(gates(api, f"p{i}") == ["other"] for i in range(4))


def test_pods_of_a_podgroup_not_yet_there_wait_and_a_basic_group_is_no_gang(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    group_member(api, "p0", "train", 2)  # no PodGroup train: kube-scheduler keeps its pods waiting too
    api.put("podgroups", podgroup("serve", None))
    group_member(api, "q0", "serve", 2)
    group_member(api, "q1", "serve", 99)  # cannot fit; its partner goes all the same
    controller = replicas(api)
    controller.run_pass()
    assert api.status_writes == ["q0-gpu-x1"]
    assert gates(api, "q0") == ["other"] and gates(api, "p0") == ["gpu.fgpu.dev/allocation", "other"]
    (waiting,) = [e for e in api.events if e["involvedObject"]["name"] == "p0-gpu-x1"]
    assert "no PodGroup ml/train" in waiting["message"]
    api.put("podgroups", podgroup("train", 1))
    sync(controller)
    controller.run_pass()
    assert sorted(api.status_writes) == ["p0-gpu-x1", "q0-gpu-x1"]
    assert gates(api, "p0") == ["other"]


def test_a_podgroup_gang_interrupted_is_completed_with_the_same_fencing(h100_slices, replicas):
    api = group_cluster(h100_slices, 3, 3)
    api.failing_status_writes = {3}  # two members written, the third write fails
    controller = replicas(api)
    controller.run_pass()
    assert sorted(len(devices_of(c)) for c in member_claims(api).values()) == [0, 2, 2]
    assert all(gates(api, f"p{i}") == ["gpu.fgpu.dev/allocation", "other"] for i in range(3))
    (missing,) = [n for n, c in member_claims(api).items() if not devices_of(c)]
    controller.run_pass()
    assert all(len(devices_of(c)) == 2 for c in member_claims(api).values())
    assert api.status_writes[3:] == [missing]  # only the missing member was placed again
    kept = [c for n, c in member_claims(api).items() if n != missing]
    assert all(FENCE_ANNOTATION in c["metadata"]["annotations"] for c in kept)  # fenced before it
    assert all(gates(api, f"p{i}") == ["other"] for i in range(3))
    assert_no_device_given_twice(api)


def test_a_podgroup_left_in_part_is_taken_back_unless_a_pod_was_let_go(h100_slices, replicas):
    for let_go in (False, True):
        api = group_cluster(h100_slices, 2, 2)
        written = api.get("claims", "ml/p0-gpu-x1")
        written["status"] = {"allocation": {"devices": {"results": []}}}
        api.put("claims", written)  # allocated earlier; its partner cannot fit
        partner = api.get("claims", "ml/p1-gpu-x1")
        partner["spec"]["devices"]["requests"][0]["exactly"]["count"] = 99
        api.put("claims", partner)
        if let_go:
            pod = api.get("pods", "ml/p0")
            api.put("pods", {**pod, "spec": {**pod["spec"], "schedulingGates": []}})
        replicas(api).run_pass()
        assert ("allocation" in claims_in(api)["p0-gpu-x1"]["status"]) is let_go


def test_a_claim_with_gang_labels_follows_them_and_its_pod_still_waits_for_its_group(h100_slices, replicas):
    api = group_cluster(h100_slices, 2, 1)
    api.put("claims", opt_in_claim("w0", 1, **{"gpu.fgpu.dev/gang": "g", "gpu.fgpu.dev/gang-size": "1"}))
    pod = gated_pod("w", "w0")
    pod["spec"]["schedulingGroup"] = {"podGroupName": "train"}
    api.put("pods", pod)  # the group's second pod; its claim is a labelled gang of 1
    controller = replicas(api)
    controller.run_pass()
    # w0 is written as a gang of its own by a writer thread while the pass goes on to the group:
    # the group is placed in this pass if the write was done by then, else in the next; either
    # way no pod of the group goes before the whole group is allocated.
    if api.status_writes == ["w0"]:
        assert gates(api, "w") == ["gpu.fgpu.dev/allocation", "other"]
        controller.run_pass()
    assert api.status_writes == ["w0", "p0-gpu-x1"]
    assert gates(api, "w") == gates(api, "p0") == ["other"]  # released together: the group is whole


class Absent(FakeApi):
    """An API server that does not serve (or let us read) what is listed."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def list_pages(self, kind: str, *args: Any, **kwargs: Any) -> Iterator[tuple[list[Any], str]]:
        raise self.error


def test_an_api_the_cluster_does_not_serve_is_synced_as_empty():
    for error in (NotFoundError("the server could not find the requested resource"), RefusedError("forbidden", 403)):
        informer = Informer(Absent(error), "podgroups", threading.Event(), optional=True)
        informer.start()
        try:
            assert informer.synced.wait(5) and informer.items() == [] and informer.absent == str(error)
        finally:
            informer.stop()


# --- making room: evicting movable and lower-priority pods, reservations ---------------------

N1 = {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]}
SHARE = {"clients": "1", "compute": "10", "memory": "10Gi"}


def held(name: str, device: str, created: str = "2026-01-01T00:00:00Z") -> dict[str, Any]:
    """A claim allocated earlier on n1: a whole GPU, or (device gpu-N-mps) a 10Gi MPS share."""
    share = device.endswith("-mps")
    exactly: dict[str, Any] = {"deviceClassName": "mps.gpu.fgpu.dev" if share else "gpu.fgpu.dev", "count": 1}
    result: dict[str, Any] = {"request": "r", "driver": "gpu.fgpu.dev", "pool": "n1", "device": device}
    if share:
        exactly["capacity"] = {"requests": {"memory": "10Gi"}}
        result |= {"shareID": f"share-{name}", "consumedCapacity": SHARE}
    meta = {"name": name, "namespace": "ml", "creationTimestamp": created}
    spec = {"devices": {"requests": [{"name": "r", "exactly": exactly}]}}
    return {
        "metadata": meta,
        "spec": spec,
        "status": {"allocation": {"devices": {"results": [result]}, "nodeSelector": N1}},
    }


def running(name: str, claim: str, movable: bool = False, owned: bool = True, priority: int = 0,
            created: str = "2026-01-01T00:00:00Z") -> dict[str, Any]:  # fmt: skip
    meta: dict[str, Any] = {"name": name, "namespace": "ml", "creationTimestamp": created}
    if movable:
        meta["annotations"] = {"gpu.fgpu.dev/movable": "true"}
    if owned:
        meta["ownerReferences"] = [{"kind": "ReplicaSet", "name": "rs", "uid": "rs-1", "controller": True}]
    spec = {"nodeName": "n1", "priority": priority, "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}]}
    return {"metadata": meta, "spec": spec, "status": {"phase": "Running"}}


def fragmented(api: FakeApi, movable: bool = True, owned: bool = True, shares: int = 2) -> None:
    """n1: the last `shares` GPUs each hold one 10Gi MPS share (the later GPU's the younger), the
    others are whole, held by pods that are not movable: no GPU is free, though the shares fit on one."""
    for i in range(8 - shares):
        api.put("claims", held(f"whole-{i}", f"gpu-{i}"))
        api.put("pods", running(f"job-{i}", f"whole-{i}"))
    for i in range(8 - shares, 8):
        created = f"2026-01-0{i - 4}T00:00:00Z"
        api.put("claims", held(f"share-{i}", f"gpu-{i}-mps", created))
        api.put("pods", running(f"infer-{i}", f"share-{i}", movable, owned, created=created))


def pending_gpu(api: FakeApi, name: str = "train", priority: int = 0, **spec: Any) -> None:
    api.put("claims", opt_in_claim(name, 1))
    pod = gated_pod(f"{name}-pod", name)
    pod["spec"] |= {"priority": priority, **spec}
    api.put("pods", pod)


def events_of(api: FakeApi, name: str, reason: str | None = None) -> list[str]:
    return [
        e["message"]
        for e in api.events
        if e["involvedObject"]["name"] == name and (reason is None or e["reason"] == reason)
    ]


def gone(api: FakeApi, claim: str) -> None:
    """kube-controller-manager's part once a pod is evicted: its (template's) claim is deleted."""
    api.store["claims"].pop(f"ml/{claim}")


def test_the_fewest_youngest_movable_pods_are_evicted_and_their_devices_held_for_the_claim(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    fragmented(api)
    pending_gpu(api)
    controller = replicas(api, evictions_per_minute=10)
    controller.run_pass()
    assert api.evicted == ["infer-7"]  # one pod is enough; GPU 7's is the younger
    (reservation,) = ledger_entries(api).values()
    assert reservation.claim == "ml/train" and reservation.results == (("gpu-7", ""),) and reservation.reservation
    assert "evicted by fgpu to make room for claim(s) ml/train on n1 (the pod is movable)" in events_of(
        api, "infer-7", "EvictedToMakeRoom"
    )
    assert any("making room on n1: evicted pod(s) ml/infer-7" in m for m in events_of(api, "train"))

    # The evicted pod's claim is gone; a claim older than train, pending now, may not take GPU 7.
    gone(api, "share-7")
    early = opt_in_claim("early", 1)
    early["metadata"]["creationTimestamp"] = "2025-01-01T00:00:00Z"
    api.put("claims", early)
    sync(controller)
    controller.run_pass()
    claims = claims_in(api)
    assert devices_of(claims["train"]) == [("n1", "gpu-7")] and not devices_of(claims["early"])
    assert not any(e.reservation for e in ledger_entries(api).values())  # train's own entry replaced it
    assert api.evicted == ["infer-7"]  # nothing is evicted for early: no movable pod would fit elsewhere
    assert gates(api, "train-pod") == ["other"]
    assert_no_device_given_twice(api)


def test_room_is_made_for_a_whole_gang_with_a_reservation_for_each_member(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    fragmented(api, shares=3)
    gang = {"gpu.fgpu.dev/gang": "g", "gpu.fgpu.dev/gang-size": "2"}
    for name in ("w0", "w1"):
        api.put("claims", opt_in_claim(name, 1, **gang))
        api.put("pods", gated_pod(f"{name}-pod", name))
    controller = replicas(api, evictions_per_minute=10)
    controller.run_pass()
    assert sorted(api.evicted) == ["infer-6", "infer-7"]  # the two youngest; both move onto GPU 5
    reserved = {e.claim: e.results for e in ledger_entries(api).values() if e.reservation}
    assert reserved == {"ml/w0": (("gpu-6", ""),), "ml/w1": (("gpu-7", ""),)} or reserved == {
        "ml/w0": (("gpu-7", ""),),
        "ml/w1": (("gpu-6", ""),),
    }
    for claim in ("share-6", "share-7"):
        gone(api, claim)
    sync(controller)
    controller.run_pass()
    placed = {n: devices_of(c) for n, c in claims_in(api).items() if n in ("w0", "w1")}
    assert sorted(d for devices in placed.values() for d in devices) == [("n1", "gpu-6"), ("n1", "gpu-7")]
    assert gates(api, "w0-pod") == gates(api, "w1-pod") == ["other"]


def test_a_budget_that_refuses_an_eviction_fails_the_plan_and_the_next_is_tried(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    fragmented(api)
    pending_gpu(api)
    api.budgeted = {"infer-7"}
    controller = replicas(api, evictions_per_minute=10)
    controller.run_pass()
    assert api.evicted == ["infer-6"]
    assert any("eviction of pod ml/infer-7 refused: Cannot evict pod" in m for m in events_of(api, "train"))
    (reservation,) = ledger_entries(api).values()
    assert reservation.results == (("gpu-6", ""),)  # the refused plan's reservation is gone


def test_nothing_is_evicted_when_every_plan_is_refused(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    fragmented(api)
    pending_gpu(api)
    api.budgeted = {"infer-6", "infer-7"}
    replicas(api, evictions_per_minute=10).run_pass()
    assert api.evicted == [] and api.deleted == []
    assert not ledger_entries(api)


@pytest.mark.parametrize(
    "movable, owned, evictions",
    [(False, True, 10), (True, False, 10), (True, True, 0)],
    ids=["not annotated", "no controller recreates it", "making room off"],
)
def test_pods_not_movable_are_never_evicted(h100_slices, replicas, movable, owned, evictions):
    api = fake_cluster(h100_slices)
    fragmented(api, movable=movable, owned=owned)
    pending_gpu(api)
    replicas(api, evictions_per_minute=evictions).run_pass()
    assert api.evicted == [] and not ledger_entries(api)


def test_a_plan_over_the_eviction_budget_waits(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    fragmented(api)
    pending_gpu(api)
    controller = replicas(api, evictions_per_minute=1)
    assert controller.budget is not None
    controller.budget.spend(time.monotonic())  # the minute's one eviction is spent
    controller.run_pass()
    assert api.evicted == [] and not ledger_entries(api)
    assert any("waiting for the eviction budget" in m for m in events_of(api, "train"))


def test_a_reservation_is_dropped_once_its_claim_is_gone(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    fragmented(api)
    pending_gpu(api)
    controller = replicas(api, evictions_per_minute=10)
    controller.run_pass()
    assert ledger_entries(api)
    gone(api, "train")
    sync(controller)
    controller.run_pass()
    assert not ledger_entries(api)


def test_a_higher_priority_pod_preempts_a_lower_one_that_is_not_movable(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    for i in range(8):
        api.put("claims", held(f"whole-{i}", f"gpu-{i}"))
        api.put("pods", running(f"job-{i}", f"whole-{i}", owned=False, priority=100 if i != 3 else 10))
    pending_gpu(api, priority=50)
    controller = replicas(api, evictions_per_minute=10)
    controller.run_pass()
    assert api.evicted == ["job-3"]
    assert "the pod has a lower priority" in events_of(api, "job-3", "Preempted")[0]
    gone(api, "whole-3")
    sync(controller)
    controller.run_pass()
    assert devices_of(claims_in(api)["train"]) == [("n1", "gpu-3")]


@pytest.mark.parametrize("priority, spec", [(10, {}), (50, {"preemptionPolicy": "Never"})], ids=["equal", "never"])
def test_no_preemption_at_equal_priority_or_when_the_pod_says_never(h100_slices, replicas, priority, spec):
    api = fake_cluster(h100_slices)
    for i in range(8):
        api.put("claims", held(f"whole-{i}", f"gpu-{i}"))
        api.put("pods", running(f"job-{i}", f"whole-{i}", owned=False, priority=10))
    pending_gpu(api, priority=priority, **spec)
    replicas(api, evictions_per_minute=10).run_pass()
    assert api.evicted == [] and api.deleted == []


def test_preemption_past_every_budget_deletes_the_cheapest_victims(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    for i in range(8):
        api.put("claims", held(f"whole-{i}", f"gpu-{i}"))
        api.put("pods", running(f"job-{i}", f"whole-{i}", owned=False, priority=10))
    api.budgeted = {f"job-{i}" for i in range(8)}
    pending_gpu(api, priority=50)
    replicas(api, evictions_per_minute=10).run_pass()
    assert api.evicted == [] and len(api.deleted) == 1
    assert "refused by a PodDisruptionBudget" in events_of(api, api.deleted[0], "Preempted")[0]
    (reservation,) = ledger_entries(api).values()
    assert reservation.claim == "ml/train"


def test_the_eviction_budget_is_a_sliding_minute():
    budget = EvictionBudget(2)
    budget.spend(0.0)
    budget.spend(30.0)
    assert budget.left(59.9) == 0
    assert budget.left(60.0) == 1  # the first eviction is a minute old
    assert budget.left(90.0) == 2


def test_while_nothing_waits_compaction_empties_the_lightest_gpu_into_a_hole(h100_slices, replicas):
    api = fake_cluster(h100_slices)
    fragmented(api)  # GPUs 6 and 7 each hold one movable 10Gi share
    controller = replicas(api, evictions_per_minute=10, compact=True)
    controller.run_pass()
    assert len(api.evicted) == 1 and api.evicted[0] in ("infer-6", "infer-7")
    assert "its GPU empties" in events_of(api, api.evicted[0], "Compacted")[0]
    assert not ledger_entries(api)  # no reservation: the moved pod's new claim is placed as any other


@pytest.mark.parametrize("busy", ["a claim waits", "a gated pod waits", "a share that may not move"])
def test_compaction_waits_while_anything_waits_and_leaves_a_gpu_something_holds(h100_slices, replicas, busy):
    api = fake_cluster(h100_slices)
    fragmented(api)
    if busy == "a claim waits":
        api.put("claims", opt_in_claim("later", 99))
    elif busy == "a gated pod waits":
        pod = gated_pod("replacement", "")
        pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "t"}]  # claim not made yet
        api.put("pods", pod)
    else:
        for i in (6, 7):  # beside each movable share, one that stays
            api.put("claims", held(f"stays-{i}", f"gpu-{i}-mps"))
            api.put("pods", running(f"stays-{i}", f"stays-{i}"))
    replicas(api, evictions_per_minute=10, compact=True).run_pass()
    assert api.evicted == []
