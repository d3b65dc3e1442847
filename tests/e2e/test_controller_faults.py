"""The fence on the real control plane: two `fgpu controller` replicas, the leader stopped with
SIGSTOP part way through a burst (before a ledger write, between its ledger and status writes,
mid-gang, at a moment the test picks) and resumed once the other has taken over and allocated;
replicas whose wall clocks are 20 s off. Every scenario ends with the reference verifier
(testbed/cluster/cmd/allocate) over every allocation: no device, counter or capacity overbooked;
then every claim allocated, no gang partial, every gate lifted, every pod bound.

The pause points come from the controller's test hook FGPU_TEST_STOP_BEFORE (the process stops
itself right after its leadership check, so the write that follows goes out after SIGCONT, on
what it decided before: the race a leadership check cannot close); the skew from
FGPU_TEST_CLOCK_OFFSET_S (driver/common/testhooks.py). Leases are short (4 s) to keep it quick."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from driver.inventory.discovery import discover_gpus
from driver.inventory.offers import node_inventory
from driver.inventory.sharing import SharingConfig
from driver.inventory.slices import build_slices
from driver.nvml.session import NvmlSession
from driver.scheduling.opt_in import GANG_LABEL, OPT_IN_LABEL, SCHEDULING_GATE
from testbed.cluster.harness import Cluster, build_binaries
from testbed.workloads import wait_for
from tests.support.controller import CONTROLLER, gang_claim, gated_pod
from tests.support.reference import ReferenceAllocator

pytestmark = pytest.mark.cluster
DRIVER = "gpu.fgpu.dev"
LEASE_ENV = {"LEASE_DURATION": "4", "RENEW_DEADLINE": "2.5", "RETRY_PERIOD": "0.5"}
NODES = 4  # x 8 mock H100


def claim(name: str, request: dict[str, Any]) -> dict[str, Any]:
    body = {"devices": {"requests": [{"name": "r", "exactly": request}]}}
    return {"metadata": {"name": name, "labels": {OPT_IN_LABEL: "fgpu"}}, "spec": body}


def whole(count: int) -> dict[str, Any]:
    return {"deviceClassName": "gpu.fgpu.dev", "count": count}


def mig(profile: str) -> dict[str, Any]:
    expression = f'device.attributes["{DRIVER}"].profile == "{profile}"'
    return {"deviceClassName": "mig.gpu.fgpu.dev", "selectors": [{"cel": {"expression": expression}}]}


def mps(gib: int) -> dict[str, Any]:
    return {"deviceClassName": "mps.gpu.fgpu.dev", "capacity": {"requests": {"memory": f"{gib}Gi"}}}


def lone_burst() -> list[dict[str, Any]]:
    """18 claims (12 whole GPUs, 6 MIG placements, 4 MPS shares) that fit with the gangs below."""
    kinds = [whole(1), whole(2), mig("1g.10gb"), mps(10), whole(1), mig("3g.40gb"), mps(20), mig("2g.20gb"), whole(2)]
    return [claim(f"c{i:02d}", kinds[i % len(kinds)]) for i in range(18)]


def gang_burst() -> list[dict[str, Any]]:
    """A gang of 3 x 3 GPUs (on two nodes at least) and one of 2 x 2 GPUs."""
    first = [gang_claim(f"g{i}", "big", 3, gpus=3) for i in range(3)]
    return first + [gang_claim(f"h{i}", "small", 2, gpus=2) for i in range(2)]


def h100_slices(node: str) -> list[dict[str, Any]]:
    inventory = node_inventory(discover_gpus(NvmlSession.open("mock:dgx-h100")), SharingConfig())
    return build_slices(DRIVER, node, inventory, generation=1, owner=None)


def raw(call: Any, *args: Any, **kwargs: Any) -> Any:
    """The API's JSON, camelCase as the verifier reads it."""
    return json.loads(call(*args, _preload_content=False, **kwargs).data)


@dataclass
class Scenario:
    """A namespace of its own (lease, ledgers, claims, pods) and nodes of its own with slices."""

    cluster: Cluster
    logs: Path
    namespace: str = field(default_factory=lambda: f"fence-{uuid.uuid4().hex[:6]}")
    replicas: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        client = self.cluster.api_client()
        self.core = kubernetes.client.CoreV1Api(client)
        self.resource = kubernetes.client.ResourceV1Api(client)
        self.leases = kubernetes.client.CoordinationV1Api(client)
        self.nodes = [f"{self.namespace}-n{i}" for i in range(NODES)]

    def set_up(self) -> None:
        self.core.create_namespace({"metadata": {"name": self.namespace}})
        wait_for(lambda: self.core.list_namespaced_service_account(self.namespace).items)  # pods need it
        for node in self.nodes:
            self.cluster.add_node(node)
            for body in h100_slices(node):
                self.resource.create_resource_slice(body)

    def tear_down(self) -> None:
        """Replicas stopped; pods, claims (their finalizer dropped: nothing else will deallocate
        them here), slices and nodes deleted, so the next scenario's replicas find nothing of this one."""
        for replica in self.replicas.values():
            with contextlib.suppress(ProcessLookupError):
                replica.send_signal(signal.SIGCONT)
                replica.terminate()
        for replica in self.replicas.values():
            replica.wait(timeout=20)
        self.core.delete_collection_namespaced_pod(self.namespace, grace_period_seconds=0)
        for obj in self.claims():
            patch = {"metadata": {"finalizers": None}}
            self.resource.patch_namespaced_resource_claim(obj["metadata"]["name"], self.namespace, patch)
        self.resource.delete_collection_namespaced_resource_claim(self.namespace)
        self.core.delete_namespace(self.namespace)
        for node in self.nodes:
            self.resource.delete_collection_resource_slice(field_selector=f"spec.nodeName={node}")
            self.core.delete_node(node)

    def start(self, identity: str, **env: str) -> subprocess.Popen[bytes]:
        argv = [*CONTROLLER, f"--kubeconfig={self.cluster.kubeconfig}", f"--lease-namespace={self.namespace}"]
        with open(self.logs / f"{identity}.log", "wb") as log:
            self.replicas[identity] = subprocess.Popen(
                [*argv, f"--identity={identity}"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **LEASE_ENV, **env},
            )
        return self.replicas[identity]

    def log(self, identity: str) -> str:
        return (self.logs / f"{identity}.log").read_text(errors="replace")

    def lease(self) -> Any:
        try:
            return self.leases.read_namespaced_lease("fgpu-controller", self.namespace).spec
        except kubernetes.client.ApiException:
            return None

    def holder(self) -> str | None:
        lease = self.lease()
        return lease.holder_identity if lease else None

    def create(self, claims: list[dict[str, Any]]) -> None:
        for body in claims:
            name = body["metadata"]["name"]
            self.resource.create_namespaced_resource_claim(self.namespace, body)
            self.core.create_namespaced_pod(self.namespace, gated_pod(name, name))

    def claims(self) -> list[dict[str, Any]]:
        return raw(self.resource.list_namespaced_resource_claim, self.namespace)["items"]

    def allocated(self, name: str) -> bool:
        return bool(self.resource.read_namespaced_resource_claim(name, self.namespace).status.allocation)

    def settled(self) -> bool:
        """Every claim allocated, every gate lifted, every pod bound."""
        if not all((c.get("status") or {}).get("allocation") for c in self.claims()):
            return False
        pods = self.core.list_namespaced_pod(self.namespace).items
        return all(
            p.spec.node_name and not any(g.name == SCHEDULING_GATE for g in p.spec.scheduling_gates or ()) for p in pods
        )


def stopped(process: subprocess.Popen[bytes]) -> bool:
    return Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


@pytest.fixture(scope="module")
def reference() -> Iterator[ReferenceAllocator]:
    allocator = ReferenceAllocator(build_binaries() / "allocate")
    yield allocator
    allocator.close()


@pytest.fixture
def scenario(cluster: Cluster, tmp_path: Path) -> Iterator[Scenario]:
    scene = Scenario(cluster, tmp_path)
    scene.set_up()
    yield scene
    scene.tear_down()


def check_every_allocation(scene: Scenario, reference: ReferenceAllocator) -> None:
    wait_for(scene.settled, timeout=90, interval=0.3)
    objects: list[dict[str, Any]] = []
    for kind, listing in (
        ("DeviceClass", raw(scene.resource.list_device_class)),
        ("ResourceSlice", raw(scene.resource.list_resource_slice)),
        ("ResourceClaim", {"items": scene.claims()}),
    ):
        objects += [{**item, "apiVersion": "resource.k8s.io/v1", "kind": kind} for item in listing["items"]]
    problems = reference.problems(objects)
    assert not problems, problems
    gangs: dict[str, list[bool]] = {}
    for obj in scene.claims():
        if gang := obj["metadata"]["labels"].get(GANG_LABEL):
            gangs.setdefault(gang, []).append(bool(obj["status"].get("allocation")))
    assert all(all(members) for members in gangs.values())


def lead_then_stop(scene: Scenario, burst: list[dict[str, Any]], step: str, name: str, **env: str) -> None:
    """Replica a leads and stops itself before the write (step) for claim `name`; b takes over and
    allocates that claim; then a resumes and makes the write it had decided on before."""
    leader = scene.start("a", FGPU_TEST_STOP_BEFORE=f"{step}:{scene.namespace}/{name}", **env)
    wait_for(lambda: scene.holder() == "a", timeout=30)
    scene.start("b")
    scene.create(burst)
    wait_for(lambda: stopped(leader), timeout=60)
    wait_for(lambda: scene.holder() == "b", timeout=15)  # expiry judged on b's clock, whatever a wrote
    wait_for(lambda: scene.allocated(name), timeout=30)
    leader.send_signal(signal.SIGCONT)


@pytest.mark.parametrize(
    "burst, step, name, refused",
    [
        (lone_burst, "ledger", "c00", "ledger fgpu-ledger-"),  # its first ledger write, on a stale version
        (lone_burst, "status", "c04", "claim {ns}/c04 changed since"),  # its entry written, the claim not
        (gang_burst, "status", "g1", "claim {ns}/g1 changed since"),  # mid-gang: g0 written, g1 recorded only
    ],
    ids=["before-ledger-write", "between-ledger-and-status", "mid-gang"],
)
def test_a_paused_leader_that_resumes_cannot_overbook(scenario, reference, burst, step, name, refused):
    lead_then_stop(scenario, burst(), step, name)
    message = refused.format(ns=scenario.namespace)
    wait_for(lambda: message in scenario.log("a"), timeout=30)  # its stale write went out, and was refused
    check_every_allocation(scenario, reference)
    assert scenario.holder() == "b"


@pytest.mark.parametrize(
    "offset, burst, step, name",
    [
        ("20", lone_burst, "status", "c07"),  # its renewTime lies 20 s in the future
        ("-20", lone_burst, "ledger", "c00"),  # 20 s in the past: a standby trusting it would not wait
        ("20", gang_burst, "status", "g1"),  # mid-gang
    ],
    ids=["ahead-between-ledger-and-status", "behind-before-ledger-write", "ahead-mid-gang"],
)
def test_a_leader_whose_clock_is_off_is_replaced_on_time_and_fenced(scenario, reference, offset, burst, step, name):
    # b must judge expiry by when it saw the Lease change, never by a's renewTime.
    lead_then_stop(scenario, burst(), step, name, FGPU_TEST_CLOCK_OFFSET_S=offset)
    refused = "ledger fgpu-ledger-" if step == "ledger" else f"claim {scenario.namespace}/{name} changed since"
    wait_for(lambda: refused in scenario.log("a"), timeout=30)
    check_every_allocation(scenario, reference)


@pytest.mark.parametrize("skewed, offset", [("b", "20"), ("a", "-20")], ids=["standby-ahead", "leader-behind"])
def test_a_clock_that_is_off_does_not_move_the_lease_from_a_healthy_leader(scenario, reference, skewed, offset):
    skew = {"FGPU_TEST_CLOCK_OFFSET_S": offset}
    scenario.start("a", **(skew if skewed == "a" else {}))
    wait_for(lambda: scenario.holder() == "a", timeout=30)
    started = time.monotonic()
    scenario.start("b", **(skew if skewed == "b" else {}))
    scenario.create(lone_burst() + gang_burst())
    check_every_allocation(scenario, reference)
    window = 2 * float(LEASE_ENV["LEASE_DURATION"])  # by renewTime, b would have taken over within 1 s
    time.sleep(max(0.0, started + window - time.monotonic()))
    lease = scenario.lease()
    assert lease.holder_identity == "a" and not lease.lease_transitions
    assert "became leader" not in scenario.log("b")


def test_a_leader_stopped_from_outside_mid_burst(scenario, reference):
    leader = scenario.start("a")
    wait_for(lambda: scenario.holder() == "a", timeout=30)
    scenario.start("b")
    scenario.create(gang_burst() + lone_burst())
    wait_for(
        lambda: sum(bool((c.get("status") or {}).get("allocation")) for c in scenario.claims()) >= 3, interval=0.02
    )
    leader.send_signal(signal.SIGSTOP)
    wait_for(lambda: scenario.holder() == "b", timeout=15)
    leader.send_signal(signal.SIGCONT)
    check_every_allocation(scenario, reference)
