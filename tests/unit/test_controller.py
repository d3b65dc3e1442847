"""Controller pieces without an API server: leader election, pod claims, gang labels, plan CLI."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from driver.allocator.model import claim_from_object
from driver.controller.controller import gang_of, pending, pod_claim_names
from driver.controller.leader import LeaderElector
from driver.kube import ConflictError, KubeUnavailableError, NotFoundError
from tests.conftest import ROOT


class LeaseApi:
    """Leases with resourceVersions, refusing stale writes as the API server does."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0

    def get_lease(self, namespace: str, name: str) -> dict[str, Any]:
        if self.lease is None:
            raise NotFoundError(name)
        return copy.deepcopy(self.lease)

    def create_lease(self, namespace: str, lease: dict[str, Any]) -> dict[str, Any]:
        if self.lease is not None:
            raise ConflictError("exists")
        return self._store(lease)

    def replace_lease(self, namespace: str, lease: dict[str, Any]) -> dict[str, Any]:
        if self.lease is None or lease["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            raise ConflictError("stale")
        return self._store(lease)

    def _store(self, lease: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        self.lease = copy.deepcopy(lease)
        self.lease["metadata"]["resourceVersion"] = str(self.version)
        return copy.deepcopy(self.lease)


def test_one_replica_leads_and_another_takes_over_when_it_stops_renewing():
    api = LeaseApi()
    first, second = (LeaderElector(api, "ns", "lease", name, lease_s=15, renew_s=5) for name in ("a", "b"))
    assert first.try_acquire_or_renew() and not second.try_acquire_or_renew()
    assert first.try_acquire_or_renew()  # renewing keeps it
    assert api.lease is not None and api.lease["spec"]["holderIdentity"] == "a"
    api.lease["spec"]["renewTime"] = "2000-01-01T00:00:00.000000Z"  # "a" stopped renewing long ago
    assert second.try_acquire_or_renew()
    assert api.lease["spec"]["holderIdentity"] == "b" and api.lease["spec"]["leaseTransitions"] == 1


def test_a_stale_write_loses_the_race():
    api = LeaseApi()
    first, second = (LeaderElector(api, "ns", "lease", name) for name in ("a", "b"))
    real_get = api.get_lease
    api.get_lease = lambda ns, name: (_ for _ in ()).throw(NotFoundError(name))  # both saw no lease
    assert first.try_acquire_or_renew()
    assert not second.try_acquire_or_renew()  # its create conflicts
    api.get_lease = real_get
    assert not second.is_leader.is_set()


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
    pod["status"]["resourceClaimStatuses"] = [{"name": "b", "resourceClaimName": "pod-b-x1"}]
    assert pod_claim_names(pod) == ["shared", "pod-b-x1"]


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
    bad.write_text("kind: ResourceSlice\nspec: {devices: [{name: d, capacity: {memory: {value: lots}}}]}\n")
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


class ControllerApiFake:
    """The calls the controller makes, on in-memory objects; status writes can be made to conflict."""

    def __init__(self) -> None:
        self.conflicts = 0
        self.failing_writes: set[int] = set()  # status writes (counted from 1) the API server misses
        self.writes = 0
        self.status_writes: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.gates: dict[str, list[Any]] = {}
        self.version = 100

    def _bump(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.version)
        return obj

    def replace_claim(self, claim: dict[str, Any]) -> dict[str, Any]:
        return self._bump(claim)

    def replace_claim_status(self, claim: dict[str, Any]) -> dict[str, Any]:
        if self.conflicts:
            self.conflicts -= 1
            raise ConflictError("the object has been modified")
        self.writes += 1
        if self.writes in self.failing_writes:
            raise KubeUnavailableError("API server unreachable")
        self.status_writes.append(claim)
        return self._bump(claim)

    def set_scheduling_gates(self, pod: dict[str, Any], gates: list[Any]) -> dict[str, Any]:
        self.gates[pod["metadata"]["name"]] = gates
        return self._bump({**pod, "spec": {**pod["spec"], "schedulingGates": gates}})

    def create_event(self, namespace: str, event: dict[str, Any]) -> dict[str, Any]:
        self.events.append(event)
        return event


def controller_with(objects: dict[str, list[dict[str, Any]]]) -> tuple[Any, ControllerApiFake]:
    from driver.controller.controller import Controller

    api = ControllerApiFake()
    controller = Controller(api, "test")
    for kind, informer in controller.informers.items():
        for obj in objects.get(kind, []):
            informer.update(obj)
    return controller, api


def opt_in_claim(name: str, count: int, **labels: str) -> dict[str, Any]:
    meta = {"name": name, "namespace": "ml", "uid": f"uid-{name}", "resourceVersion": "1"}
    meta["labels"] = {"gpu.fgpu.dev/allocator": "fgpu", **labels}
    request = {"name": "r", "exactly": {"deviceClassName": "gpu.fgpu.dev", "count": count}}
    return {"metadata": meta, "spec": {"devices": {"requests": [request]}}}


def gated_pod(name: str, claim: str) -> dict[str, Any]:
    meta = {"name": name, "namespace": "ml", "resourceVersion": "1"}
    spec = {"schedulingGates": [{"name": "gpu.fgpu.dev/allocation"}, {"name": "other"}]}
    spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
    return {"metadata": meta, "spec": spec}


def cluster_objects(tmp_path: Path) -> dict[str, list[dict[str, Any]]]:
    import yaml

    slices = json.loads(discover(tmp_path, "n1", "dgx-h100").read_text())["items"]
    for i, obj in enumerate(slices):
        obj["metadata"]["resourceVersion"] = str(i + 1)
    classes = [d for d in yaml.safe_load_all((ROOT / "daemonset" / "deviceclasses.yaml").read_text()) if d]
    for obj in classes:
        obj["metadata"]["resourceVersion"] = "1"
    return {"slices": slices, "classes": classes}


def test_controller_allocates_retries_a_conflict_and_lifts_only_its_gate(tmp_path: Path):
    objects = cluster_objects(tmp_path)
    objects["claims"] = [opt_in_claim("train", 2)]
    objects["pods"] = [gated_pod("trainer", "train")]
    controller, api = controller_with(objects)
    api.conflicts = 1
    controller.run_pass()  # the write conflicts: nothing is written, the claim stays pending
    assert not api.status_writes and "trainer" not in api.gates
    controller.run_pass()  # the next pass allocates on fresh state
    (written,) = api.status_writes
    assert len(written["status"]["allocation"]["devices"]["results"]) == 2
    assert "resource.kubernetes.io/delete-protection" in written["metadata"]["finalizers"]
    assert api.gates["trainer"] == [{"name": "other"}]


def test_controller_waits_for_the_whole_gang_and_reports_once(tmp_path: Path):
    objects = cluster_objects(tmp_path)
    gang = {"gpu.fgpu.dev/gang": "g", "gpu.fgpu.dev/gang-size": "3"}
    objects["claims"] = [opt_in_claim(f"w{i}", 2, **gang) for i in range(2)] + [opt_in_claim("huge", 9)]
    controller, api = controller_with(objects)
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
    controller.informers["claims"].update(opt_in_claim("w2", 2, **gang))
    controller.run_pass()
    assert sorted(w["metadata"]["name"] for w in api.status_writes) == ["w0", "w1", "w2"]


def test_a_gang_interrupted_by_an_outage_is_taken_back(tmp_path: Path):
    objects = cluster_objects(tmp_path)
    gang = {"gpu.fgpu.dev/gang": "g", "gpu.fgpu.dev/gang-size": "3"}
    objects["claims"] = [opt_in_claim(f"w{i}", 2, **gang) for i in range(3)]
    objects["pods"] = [gated_pod(f"p{i}", f"w{i}") for i in range(3)]
    controller, api = controller_with(objects)
    api.failing_writes = {3}  # two members written, the third write fails
    controller.run_pass()
    claims = {c["metadata"]["name"]: c for c in controller.informers["claims"].items()}
    assert all("allocation" not in (c.get("status") or {}) for c in claims.values())  # the two were undone
    assert not api.gates  # no pod of the gang went ahead
    controller.run_pass()
    claims = {c["metadata"]["name"]: c for c in controller.informers["claims"].items()}
    assert all(c["status"]["allocation"] for c in claims.values())
    assert sorted(api.gates) == ["p0", "p1", "p2"]


def test_gang_pods_wait_for_the_whole_gang(tmp_path: Path):
    objects = cluster_objects(tmp_path)
    gang = {"gpu.fgpu.dev/gang": "g", "gpu.fgpu.dev/gang-size": "2"}
    first = opt_in_claim("w0", 2, **gang)
    first["status"] = {"allocation": {"devices": {"results": []}}}  # allocated earlier, its partner is not
    objects["claims"] = [first, opt_in_claim("w1", 99, **gang)]  # w1 cannot fit
    objects["pods"] = [gated_pod("p0", "w0")]
    controller, api = controller_with(objects)
    controller.run_pass()
    assert not api.gates  # p0's claim is allocated, but its gang is not whole
    assert [w["metadata"]["name"] for w in api.status_writes] == ["w0"]  # and w0 was taken back
    assert "allocation" not in controller.informers["claims"].get("ml/w0").get("status", {})
