"""GPU-seconds by namespace and kind, and idle claims: the counting rule (driver/node/usage.py), the
plugin's metrics after real prepares over mock NVML whose utilisation and processes the test sets,
and `fgpu status --idle` / `--by namespace` reading those metrics over HTTP."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pynvml
import pytest

from driver.claims.refs import ClaimRef
from driver.cli.main import main
from driver.cli.usage_report import idle_claims, usage_by_namespace
from driver.node.kubelet.api import dra_v1_pb2
from driver.node.kubelet.dra_service import DraV1Service
from driver.node.metrics import ClaimHolders, MetricsServer, NodeCollector, node_registry
from driver.node.state import PreparedDevice
from driver.node.usage import GpuActivity, HeldDevice, UsageLedger, gpu_fraction, is_busy, pod_uid_of_cgroup
from driver.nvml.machine import load_machine
from driver.nvml.mock import MockNvml, MockProcess
from driver.nvml.session import MOCK_STATE_ENV, NvmlProcess, NvmlSession
from testbed.fakes import CallContext, InMemoryKubeApi, allocated_claim, result
from testbed.node_env import NodeEnv

GIB = 2**30
POD_A = "0b5a4f1e-1c2d-4e5f-8a9b-0c1d2e3f4a5b"
POD_B = "9e8d7c6b-5a49-4838-a7b6-c5d4e3f2a1b0"


def device(kind: str, **fields) -> PreparedDevice:
    return PreparedDevice(("gpu",), "node-a", f"dev-{kind}", (), kind=kind, **fields)


def held(uid: str, namespace: str, kind: str, fraction: float, busy: bool) -> HeldDevice:
    return HeldDevice(uid, namespace, f"claim-{uid}", (), kind, f"dev-{uid}", fraction, busy)


# --- the rule ---------------------------------------------------------------------------------------


def test_a_device_counts_the_fraction_of_its_gpu_it_holds():
    assert gpu_fraction(device("whole"), 80 * GIB, None) == 1.0
    assert gpu_fraction(device("mig", mig_size=4, mig_profile_id=9), 80 * GIB, None) == 0.5  # 3g.40gb: 4 of 8
    assert gpu_fraction(device("mig", mig_size=1, mig_profile_id=19), 80 * GIB, None) == 0.125  # 1g.10gb
    assert gpu_fraction(device("mig", mig_profile_id=14), 80 * GIB, None) == 0.25  # an old record: its profile's
    assert gpu_fraction(device("mps", mps_memory_bytes=10 * GIB), 80 * GIB, None) == 0.125
    assert gpu_fraction(device("timeslice"), 80 * GIB, 20 * GIB) == 0.25  # the allocation's consumedCapacity
    assert gpu_fraction(device("mig-mps"), 80 * GIB, 5 * GIB) == 0.0625  # of the GPU's memory, not the partition's
    assert gpu_fraction(device("timeslice"), 80 * GIB, None) == 0.0  # not read yet: counts nothing


def test_gpu_seconds_count_what_each_sample_saw_until_the_next():
    ledger = UsageLedger()
    ledger.observe(1000.0, [held("a", "team-a", "whole", 1.0, False), held("b", "team-b", "mig", 0.5, False)])
    ledger.observe(1060.0, [held("a", "team-a", "whole", 1.0, False)])  # b released within the minute
    ledger.observe(1120.0, [held("a", "team-a", "whole", 1.0, False), held("c", "team-a", "mps", 0.25, False)])
    ledger.observe(1240.0, [])
    assert ledger.gpu_seconds == {("team-a", "whole"): 240.0, ("team-b", "mig"): 30.0, ("team-a", "mps"): 30.0}
    ledger.observe(1200.0, [])  # a clock stepped back counts nothing
    assert sum(ledger.gpu_seconds.values()) == 300.0


def test_idle_time_runs_from_the_last_used_sample_or_from_first_seen():
    ledger = UsageLedger()
    ledger.observe(100.0, [held("a", "t", "whole", 1.0, True), held("b", "t", "whole", 1.0, False)])
    ledger.observe(700.0, [held("a", "t", "whole", 1.0, False), held("b", "t", "whole", 1.0, False)])
    ledger.observe(1300.0, [held("a", "t", "whole", 1.0, False), held("b", "t", "whole", 1.0, True)])
    idle = {entry.held.claim_uid: (entry.last_used, entry.idle_s) for entry in ledger.idle(1900.0)}
    assert idle == {"a": (100.0, 1800.0), "b": (1300.0, 600.0)}
    ledger.observe(1900.0, [held("b", "t", "whole", 1.0, False)])
    ledger.observe(2000.0, [held("a", "t", "whole", 1.0, False)])  # prepared again: a new claim to the ledger
    assert [(e.held.claim_uid, e.idle_s) for e in ledger.idle(2000.0)] == [("a", 0.0)]


def test_use_is_measured_per_kind_by_what_nvml_gives():
    mig = device("mig", mig_uuid="MIG-1")
    share = device("mps")
    mig_share = device("mig-mps", mig_uuid="MIG-2")
    busy = GpuActivity(40, (NvmlProcess(11, None, 30),), {11: POD_A})
    assert is_busy(device("whole"), (), GpuActivity(5))
    assert not is_busy(device("whole"), (), GpuActivity(4, (NvmlProcess(11, None, 3),)))  # held, computing nothing
    assert is_busy(device("whole"), (), GpuActivity(None, (NvmlProcess(11, None, None),)))  # not measured: a process
    # MIG: no utilisation per partition; a process on its MIG device is use.
    assert is_busy(mig, (), GpuActivity(None, (NvmlProcess(11, "MIG-1", None),)))
    assert not is_busy(mig, (), GpuActivity(None, (NvmlProcess(11, "MIG-9", None),)))
    # Shares: their own pods' processes, by per-process SM utilisation where NVML samples it.
    assert is_busy(share, (POD_A,), busy)
    assert not is_busy(share, (POD_B,), busy)  # the GPU is busy, but with another share's work
    assert not is_busy(share, (POD_A,), GpuActivity(40, (NvmlProcess(11, None, 2),), {11: POD_A}))
    assert is_busy(mig_share, (POD_B,), GpuActivity(None, (NvmlProcess(12, "MIG-2", None),), {12: POD_B}))
    assert not is_busy(mig_share, (POD_A,), GpuActivity(None, (NvmlProcess(12, "MIG-2", None),), {12: POD_B}))


def test_a_process_pod_comes_from_its_cgroup():
    systemd = f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_A.replace('-', '_')}.slice/cri"
    assert pod_uid_of_cgroup(systemd + "-containerd-abc.scope\n") == POD_A
    assert pod_uid_of_cgroup(f"0::/kubepods/besteffort/pod{POD_B}/0123abcd\n") == POD_B
    assert pod_uid_of_cgroup("0::/system.slice/sshd.service\n") is None


# --- the plugin's metrics, over real prepares and mock NVML -----------------------------------------


def prepare(service: DraV1Service, refs: list[ClaimRef]) -> None:
    claims = [dra_v1_pb2.Claim(namespace=r.namespace, name=r.name, uid=r.uid) for r in refs]
    answer = service.NodePrepareResources(dra_v1_pb2.NodePrepareResourcesRequest(claims=claims), CallContext())
    assert {uid: r.error for uid, r in answer.claims.items()} == {r.uid: "" for r in refs}


def add_claim(api: InMemoryKubeApi, namespace: str, name: str, results: list[dict], pod: str, uid: str) -> ClaimRef:
    claim = allocated_claim(namespace, name, f"uid-{name}", results)
    claim["status"]["reservedFor"] = [{"resource": "pods", "name": pod, "uid": uid}]
    api.claims[(namespace, name)] = claim
    return ClaimRef(namespace, name, f"uid-{name}")


def timeslice(device_name: str, memory: str) -> dict:
    return {**result(device_name), "shareID": f"share-{device_name}", "consumedCapacity": {"memory": memory}}


@pytest.fixture
def team_node(node: tuple[InMemoryKubeApi, NodeEnv], tmp_path: Path):
    """Team a holds a whole GPU (0) and a time-sliced 20Gi share (GPU 1); team b a MIG 3g.40gb
    (GPU 2). A /proc stand-in maps the shares' process pids to their pods (a real node's
    container cgroups exist only on a real node: tests/e2e/test_kueue.py)."""
    api, env = node
    refs = [
        add_claim(api, "team-a", "trainer", [result("gpu-0")], "trainer-0", POD_A),
        add_claim(api, "team-a", "notebook", [timeslice("gpu-1-ts", "20Gi")], "notebook-0", POD_A),
        add_claim(api, "team-b", "eval", [result("gpu-2-mig-3g40gb-0")], "eval-0", POD_B),
    ]
    prepare(DraV1Service(env.preparer, lambda uids, answered: None), refs)
    proc = tmp_path / "proc"
    for pid, pod in ((101, POD_A), (202, POD_B)):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(f"0::/kubepods/besteffort/pod{pod}/c0ffee\n")
    now = [10_000.0]
    collector = NodeCollector(
        "node-a",
        env.claims,
        env.session,
        env.gpus,
        ClaimHolders(api),
        clock=lambda: now[0],
        proc_root=proc,
        tenant_labels=True,
    )
    return env, collector, now


def values(collector: NodeCollector, name: str) -> dict[tuple[str, ...], float]:
    registry = node_registry(collector)
    return {
        tuple(v for k, v in sorted(s.labels.items()) if k != "node"): s.value
        for family in registry.collect()
        for s in family.samples
        if s.name == name
    }


def test_metrics_count_team_gpu_seconds_and_idle_claims_from_nvml(team_node):
    env, collector, now = team_node
    mock = env.session.nvml
    (mig,) = env.session.gpu_instances(2)
    collector.sample_usage()  # t=0: nothing used yet
    now[0] += 600
    mock.set_utilization(0, 90)  # the trainer computes
    mock.set_process(1, MockProcess(101, sm_percent=50))  # the notebook's process, on its time slice
    collector.sample_usage()
    now[0] += 1200
    mock.set_utilization(0, 0)
    mock.set_process(1, MockProcess(101, sm_percent=0))  # the notebook holds its share, computing nothing
    # The evaluation computes on its MIG device (use with GPM measuring its instance or not).
    mock.set_process(
        2, MockProcess(202, sm_percent=30, memory_mib=100, gi_id=mig.gi_id, ci_id=mig.compute_instances[0][0])
    )
    collector.sample_usage()
    mock.end_process(2, 202)  # a scrape samples too: by then the MIG device's process has ended
    now[0] += 1800  # one hour after the first sample

    seconds = values(collector, "fgpu_gpu_seconds_total")
    assert seconds == {
        ("team-a", "whole"): 3600.0,
        ("team-a", "timeslice"): 3600.0 * 20 * GIB / env.gpus[1].memory_bytes,  # 20Gi of the H100 79.6Gi
        ("team-b", "mig"): 3600.0 * 4 / 8,  # 3g.40gb: 4 of 8 memory slices
    }
    idle = values(collector, "fgpu_claim_idle_seconds")
    # labels sorted: claim, claim_namespace, claim_pod, device, kind
    assert idle == {
        ("trainer", "team-a", "trainer-0", "gpu-0", "whole"): 3000.0,
        ("notebook", "team-a", "notebook-0", "gpu-1-ts", "timeslice"): 3000.0,
        ("eval", "team-b", "eval-0", "gpu-2-mig-3g40gb-0", "mig"): 1800.0,
    }
    last_used = values(collector, "fgpu_claim_last_used_timestamp_seconds")
    assert last_used[("eval", "team-b", "eval-0", "gpu-2-mig-3g40gb-0", "mig")] == 11_800.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_status_idle_and_by_namespace_read_the_plugins_metrics(team_node, capsys):
    env, collector, now = team_node
    collector.sample_usage()
    now[0] += 45 * 60
    env.session.nvml.set_utilization(0, 70)
    collector.sample_usage()
    now[0] += 15 * 60
    port = free_port()
    server = MetricsServer(port, node_registry(collector), sample=collector.sample_usage, sample_s=0.05)
    server.start()
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        deadline = time.monotonic() + 10
        while main(["status", "--idle", "30m", "--metrics", url, "-o", "json"]) != 0:
            assert time.monotonic() < deadline, capsys.readouterr().err
            time.sleep(0.05)
        report = json.loads(capsys.readouterr().out)
        # The trainer was used 15 minutes ago; the notebook and the MIG never, for an hour.
        assert [(c["claim"], c["idleS"], c["pods"]) for c in report["idleClaims"]] == [
            ("team-a/notebook", 3600.0, ["team-a/notebook-0"]),
            ("team-b/eval", 3600.0, ["team-b/eval-0"]),
        ]
        assert report["idleClaims"][0]["since"] == "1970-01-01T02:46:40Z"  # t=10000, first seen
        assert main(["status", "--idle", "30m", "--metrics", url]) == 0
        table = capsys.readouterr().out.splitlines()
        assert table[0].split() == ["CLAIM", "NODE", "HOLDS", "PODS", "IDLE", "SINCE"]
        assert table[1].split()[:5] == [
            "team-a/notebook",
            "node-a",
            "timeslice",
            "gpu-1-ts",
            "team-a/notebook-0",
        ]
        assert table[1].split()[5] == "1h00m"

        assert main(["status", "--by", "namespace", "--metrics", url]) == 0
        rows = [line.split() for line in capsys.readouterr().out.splitlines()]
        assert rows == [
            ["NAMESPACE", "KIND", "GPU-HOURS"],
            ["team-a", "timeslice", "0.251"],  # 20Gi of the H100 79.6Gi
            ["team-a", "whole", "1.000"],
            ["team-b", "mig", "0.500"],
            ["team-a", "all", "1.251"],
            ["team-b", "all", "0.500"],
        ]
    finally:
        server.stop()


def test_status_usage_needs_a_metrics_url_and_names_one_it_cannot_read(capsys):
    assert main(["status", "--idle", "30m"]) == 2
    assert "give --metrics" in capsys.readouterr().err
    url = f"http://127.0.0.1:{free_port()}/metrics"
    assert main(["status", "--by", "namespace", "--metrics", url]) == 2
    assert capsys.readouterr().err.startswith(f"fgpu status: --metrics {url}: cannot read it")
    with pytest.raises(SystemExit):
        main(["status", "--idle", "soon", "--metrics", url])


def test_the_report_sums_nodes_and_keeps_one_row_per_claim_device():
    node = 'fgpu_gpu_seconds_total{{node="{n}",claim_namespace="ml",kind="whole"}} {v}\n'
    idle = (
        'fgpu_claim_idle_seconds{{node="n1",claim_namespace="ml",claim_pod="{p}",claim="c",'
        'kind="mps",device="d"}} 7200\n'
        'fgpu_claim_last_used_timestamp_seconds{{node="n1",claim_namespace="ml",claim_pod="{p}",claim="c",'
        'kind="mps",device="d"}} 0\n'
    )
    texts = [node.format(n="n1", v=3600) + idle.format(p="w-1"), node.format(n="n2", v=7200) + idle.format(p="w-2")]
    assert [(u.namespace, u.gpu_hours) for u in usage_by_namespace(texts).namespaces] == [("ml", 3.0)]
    (claim,) = idle_claims(texts, 3600).idle_claims
    assert (claim.claim, claim.pods, claim.idle_s) == ("ml/c", ["ml/w-1", "ml/w-2"], 7200.0)
    assert idle_claims(texts, 7201).idle_claims == []


# --- the mock's usage, as `fgpu mock usage` sets it ---------------------------------------------------


def test_mock_usage_sets_what_nvml_reports_per_gpu_partition_and_process(tmp_path: Path):
    state = tmp_path / "gpus.json"
    env = {"PATH": "/usr/bin:/bin", MOCK_STATE_ENV: str(state)}

    def fgpu(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "driver.cli", "mock", "usage", "--nvml=mock:dgx-h100", *args]
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)

    session = NvmlSession(MockNvml(load_machine("dgx-h100"), state))
    assert session.set_mig_mode(3, True)
    mig = session.create_mig_instance(3, 9, 4, 4)  # a 3g.40gb at slice 4
    ci = mig.compute_instances[0][0]
    assert fgpu("--gpu=0", "--utilization=75").returncode == 0
    assert fgpu("--gpu=0", "--pid=41", "--sm=30", "--memory=512").returncode == 0
    assert fgpu("--gpu=0", "--pid=42").returncode == 0
    assert fgpu("--gpu=3", "--pid=43", f"--gi={mig.gi_id}", f"--ci={ci}").returncode == 0

    assert session.usage(0).gpu_percent == 75
    assert session.usage(0).memory_used_bytes == 512 * 2**20
    assert session.processes(0) == [NvmlProcess(41, None, 30, 512 * 2**20), NvmlProcess(42, None, 0, 0)]
    assert session.processes(3) == [NvmlProcess(43, mig.compute_instances[0][1], None, 0)]  # MIG: no samples
    handle = session.handle(3)
    with pytest.raises(pynvml.NVMLError) as refused:
        session.nvml.nvmlDeviceGetProcessUtilization(handle, 0)
    assert refused.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert session.processes(1) == []  # nothing runs: NVML's NOT_FOUND for no samples is no process

    assert fgpu("--gpu=0", "--pid=41", "--end").returncode == 0
    assert fgpu("--gpu=0", "--utilization=-1").returncode == 0  # the simulated load again: idle
    assert session.processes(0) == [NvmlProcess(42, None, 0, 0)] and session.usage(0).gpu_percent == 0

    run = fgpu("--gpu=3", "--pid=44", "--gi=13")
    assert (run.returncode, run.stderr.strip()) == (2, "fgpu: mock usage on GPU 3: Not Found")
    run = fgpu("--gpu=0", "--utilization=101")
    assert (run.returncode, run.stderr.strip()) == (2, "fgpu: mock usage on GPU 0: Invalid Argument")
    run = fgpu("--gpu=0")
    assert run.returncode == 2 and "give --utilization, or --pid" in run.stderr
