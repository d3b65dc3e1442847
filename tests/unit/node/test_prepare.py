import json
import queue
import threading
from pathlib import Path
from typing import Any

import pytest

from driver.claims.refs import ClaimRef
from driver.kube.errors import KubeError
from driver.node.cdi import CdiDevice, CdiWriter, DriverFiles
from driver.node.claim_locks import KeyedLocks
from testbed.fakes import InMemoryKubeApi, allocated_claim, result


@pytest.fixture
def env(node):
    api, env = node
    return api, env.preparer, env.cdi, env.claims


def add_claim(api: InMemoryKubeApi, name: str, uid: str, results, ns: str = "default") -> ClaimRef:
    api.claims[(ns, name)] = allocated_claim(ns, name, uid, results)
    return ClaimRef(ns, name, uid)


def test_prepare_writes_cdi_and_is_idempotent(env):
    api, preparer, cdi, _ = env
    ref = add_claim(api, "c1", "uid-1", [result("gpu-3", request="gpus"), result("gpu-5", request="gpus/h100")])
    first = preparer.prepare([ref])["uid-1"]
    assert first.error == ""
    assert [(d.device, d.request_names) for d in first.devices] == [("gpu-3", ("gpus",)), ("gpu-5", ("gpus",))]
    assert first.devices[0].cdi_ids == ("k8s.gpu.fgpu.dev/claim=uid-1-gpu-3",)
    spec = json.loads(cdi.spec_path("uid-1").read_text())
    assert spec["kind"] == "k8s.gpu.fgpu.dev/claim"
    nodes = {d["name"]: [n["path"] for n in d["containerEdits"]["deviceNodes"]] for d in spec["devices"]}
    assert nodes == {"uid-1-gpu-3": ["/dev/nvidia3"], "uid-1-gpu-5": ["/dev/nvidia5"]}
    assert {"path": "/dev/nvidiactl", "hostPath": "/dev/null"} in spec["containerEdits"]["deviceNodes"]
    gets = api.claim_gets
    assert preparer.prepare([ref])["uid-1"] == first
    assert api.claim_gets == gets  # answered from the checkpoint
    cdi.spec_path("uid-1").unlink()
    assert preparer.prepare([ref])["uid-1"] == first
    assert cdi.spec_path("uid-1").exists()  # a lost spec is rewritten


def test_bad_claims_fail_alone_and_change_nothing(env):
    api, preparer, cdi, claims = env
    good = add_claim(api, "good", "uid-good", [result("gpu-0")])
    mismatch = add_claim(api, "recreated", "uid-new", [result("gpu-1")])
    other_node = add_claim(api, "elsewhere", "uid-far", [result("gpu-2", pool="node-b")])
    other_driver = add_claim(api, "theirs", "uid-theirs", [result("gpu-2", driver="gpu.nvidia.com")])
    unknown = add_claim(api, "unknown", "uid-unknown", [result("gpu-99")])
    api.claims[("default", "pending")] = {"metadata": {"name": "pending", "uid": "uid-pending"}, "status": {}}
    pending = ClaimRef("default", "pending", "uid-pending")
    missing = ClaimRef("default", "missing", "uid-missing")
    batch = [good, ClaimRef("default", "recreated", "uid-old"), other_node, other_driver, unknown, pending, missing]
    results = preparer.prepare(batch)
    assert results["uid-good"].error == ""
    expectations = {
        "uid-old": "UID mismatch",
        "uid-far": "not this node's pool node-a",
        "uid-theirs": "no device of driver gpu.fgpu.dev",
        "uid-unknown": "'gpu-99' is not a device",
        "uid-pending": "not allocated",
        "uid-missing": "does not exist",
    }
    for uid, reason in expectations.items():
        assert reason in results[uid].error
        assert uid in results[uid].error  # names the claim
    assert set(claims.all()) == {"uid-good"}
    assert cdi.claim_uids_on_disk() == {"uid-good"}
    assert mismatch.uid not in results


def test_api_server_unreachable_is_a_per_claim_error(env):
    api, preparer, _, claims = env
    ref = add_claim(api, "c1", "uid-1", [result("gpu-0")])
    api.unavailable = True
    outcome = preparer.prepare([ref])["uid-1"]
    assert "cannot read the claim from the API server" in outcome.error
    assert claims.all() == {}
    api.unavailable = False
    assert preparer.prepare([ref])["uid-1"].error == ""


def test_unprepare_removes_only_that_claim_and_unknown_succeeds(env):
    api, preparer, cdi, claims = env
    a = add_claim(api, "a", "uid-a", [result("gpu-0")])
    b = add_claim(api, "b", "uid-b", [result("gpu-1")])
    preparer.prepare([a, b])
    errors = preparer.unprepare([a, ClaimRef("default", "ghost", "uid-ghost")])
    assert errors == {"uid-a": "", "uid-ghost": ""}
    assert set(claims.all()) == {"uid-b"}
    assert cdi.claim_uids_on_disk() == {"uid-b"}
    assert preparer.unprepare([a]) == {"uid-a": ""}


def test_driver_libraries_are_mounted_from_the_driver_root(tmp_path: Path):
    root = tmp_path / "driver-root"
    (root / "usr/lib/x86_64-linux-gnu").mkdir(parents=True)
    (root / "usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05").write_text("")
    (root / "usr/lib/x86_64-linux-gnu/libunrelated.so.1").write_text("")
    (root / "usr/bin").mkdir()
    (root / "usr/bin/nvidia-smi").write_text("")
    files = DriverFiles.discover(root)
    assert files.libraries == ("usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05", "usr/bin/nvidia-smi")
    as_host_sees_it = DriverFiles.discover(root, host_root=Path("/run/nvidia/driver"))
    assert as_host_sees_it.root == Path("/run/nvidia/driver") and as_host_sees_it.libraries == files.libraries
    spec = CdiWriter(tmp_path / "cdi", "gpu.fgpu.dev", files).spec("u", [])
    mounts = spec["containerEdits"]["mounts"]
    assert mounts[0]["hostPath"] == str(root / "usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05")
    assert mounts[0]["containerPath"] == "/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05"


def test_device_nodes_stand_on_dev_null_only_for_mock_gpus(tmp_path: Path):
    device = CdiDevice(name="gpu-0-mig-1g10gb-0", device_nodes=("/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap30"))
    files = DriverFiles(root=Path("/"))
    real = CdiWriter(tmp_path, "gpu.fgpu.dev", files).spec("u", [device])
    mock = CdiWriter(tmp_path, "gpu.fgpu.dev", files, mock_device_nodes=True).spec("u", [device])
    for spec in (real, mock):
        paths = [
            n["path"]
            for n in spec["containerEdits"]["deviceNodes"] + spec["devices"][0]["containerEdits"]["deviceNodes"]
        ]
        assert paths == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", *device.device_nodes]
    every_node = [*mock["containerEdits"]["deviceNodes"], *mock["devices"][0]["containerEdits"]["deviceNodes"]]
    assert {n["hostPath"] for n in every_node} == {"/dev/null"}  # a host path that exists; the container sees path
    every_node = [*real["containerEdits"]["deviceNodes"], *real["devices"][0]["containerEdits"]["deviceNodes"]]
    assert all("hostPath" not in n for n in every_node)  # real GPUs: the runtime uses the host's node at path


def test_malformed_references_and_refused_reads_are_per_claim_errors(env):
    api, preparer, _, claims = env
    good = add_claim(api, "good", "uid-good", [result("gpu-0")])

    def forbidden(namespace: str, name: str):
        if name == "secret":
            raise KubeError("API server refused the request: 403 Forbidden")
        return InMemoryKubeApi.get_claim(api, namespace, name)

    api.get_claim = forbidden
    results = preparer.prepare([ClaimRef("default", "", "uid-noname"), ClaimRef("default", "secret", "uid-s"), good])
    assert "malformed request: the claim has no name" in results["uid-noname"].error
    assert "403 Forbidden" in results["uid-s"].error
    assert results["uid-good"].error == ""
    assert set(claims.all()) == {"uid-good"}


class ReportingLock:
    """A lock that reports each thread that finds it taken and has to wait."""

    def __init__(self, events: queue.Queue[tuple[str, str]]) -> None:
        self._lock = threading.Lock()
        self._events = events

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self._events.put(("waits", threading.current_thread().name))
            self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_after_an_unprepare_its_waiter_and_a_newcomer_take_turns_on_the_claim(env, monkeypatch: pytest.MonkeyPatch):
    """Three unprepares of one claim (kubelet's retries, the reconciler): the first holds the claim's
    lock, the second waits for it; the first succeeds; a third arrives while the second works. The
    third must wait too: a claim's lock is not dropped while a thread waits for it (it once was
    dropped after a successful unprepare, and the third got a new lock and ran beside the second)."""
    api, preparer, cdi, _ = env
    ref = add_claim(api, "c", "uid-c", [result("gpu-0")])
    assert preparer.prepare([ref])[ref.uid].error == ""
    events: queue.Queue[tuple[str, str]] = queue.Queue()
    preparer.locks = KeyedLocks(new_lock=lambda: ReportingLock(events))
    go = {name: threading.Event() for name in ("first", "waiter", "newcomer")}
    remove = cdi.remove

    def held_in_remove(uid: str) -> None:  # every unprepare removes the spec, under the claim's lock
        name = threading.current_thread().name
        events.put(("in", name))
        assert go[name].wait(10)
        remove(uid)

    monkeypatch.setattr(cdi, "remove", held_in_remove)
    errors: dict[str, Any] = {}

    def start(name: str) -> threading.Thread:
        thread = threading.Thread(name=name, target=lambda: errors.update({name: preparer.unprepare([ref])}))
        thread.start()
        return thread

    def next_event() -> tuple[str, str]:
        return events.get(timeout=10)

    threads = [start("first")]
    assert next_event() == ("in", "first")
    threads.append(start("waiter"))
    assert next_event() == ("waits", "waiter")
    go["first"].set()
    threads[0].join(10)
    assert errors["first"] == {ref.uid: ""}  # the first unprepare succeeded
    assert next_event() == ("in", "waiter")
    threads.append(start("newcomer"))
    assert next_event() == ("waits", "newcomer")  # not ("in", "newcomer"): one operation at a time
    go["waiter"].set()
    assert next_event() == ("in", "newcomer")
    go["newcomer"].set()
    for thread in threads:
        thread.join(10)
    assert errors == {name: {ref.uid: ""} for name in go}
    assert preparer.locks.in_use() == set()  # and the table keeps no lock nobody uses
