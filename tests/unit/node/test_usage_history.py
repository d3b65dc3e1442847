"""The plugin's usage history (issue 42): per prepared claim, at the metrics' sampling point, what its
processes use (driver/node/claim_usage.py), kept per claim with its workload and template, written to
the node's ConfigMap and read back after a restart (driver/node/usage_history.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from driver.claims.refs import ClaimRef
from driver.cli.main import build_parser
from driver.common.flags import SettingsError
from driver.inventory.discovery import GpuInfo
from driver.kube.errors import KubeUnavailableError
from driver.node.claim_usage import DeviceUse, device_size, measure
from driver.node.kubelet.dra_service import DraV1Service
from driver.node.metrics import ClaimHolders, NodeCollector, node_registry
from driver.node.settings import PluginSettings, plugin_settings
from driver.node.state import PreparedDevice
from driver.node.usage import GpuActivity
from driver.node.usage_history import HistorySettings, UsageRecorder
from driver.nvml.machine import MigProfileSpec
from driver.nvml.mock import MockProcess
from driver.nvml.session import DeviceUsage, NvmlProcess
from driver.sizing import store
from driver.sizing.history import Workload
from driver.sizing.sizes import Size
from testbed.fakes import InMemoryKubeApi, allocated_claim, result
from testbed.node_env import NodeEnv
from tests.support.dra_calls import prepare

GIB, MIB = 2**30, 2**20
POD = "0f0e0d0c-1111-2222-3333-444455556666"
H100 = GpuInfo(0, 0, "GPU-0", "NVIDIA H100 80GB HBM3", "hopper", "9.0.0", "580.95.5", "13.0.0", "0000:18:00.0",
               80 * GIB, 132, True, True, (MigProfileSpec(9, "3g.40gb", 60, 40192),))  # fmt: skip


def device(kind: str, **fields: object) -> PreparedDevice:
    return PreparedDevice(("gpu",), "node-a", f"gpu-0-{kind}", (), kind=kind, gpu_uuid="GPU-0", **fields)  # type: ignore[arg-type]


def test_each_kind_is_measured_on_the_whole_gpus_scale():
    own, other = NvmlProcess(11, None, 30, 2 * GIB), NvmlProcess(12, None, 40, 5 * GIB)
    shared = GpuActivity(70, (own, other), {11: POD, 12: "someone-else"}, DeviceUsage(7 * GIB, 80 * GIB, 70))
    mps = device("mps", mps_memory_bytes=10 * GIB, mps_thread_percentage=25)
    # A share: its own pods' processes only; it was given its allocation (MPS: and its compute limit;
    # time-sliced: no compute of its own).
    mps_use = DeviceUse(Size("mps", 10240, 25), 2048, 30.0, False, 10240, 25.0)
    assert measure(mps, (POD,), shared, H100, 10 * GIB) == mps_use
    ts = device("timeslice")
    ts_use = DeviceUse(Size("timeslice", 20480), 2048, 30.0, False, 20480, None)
    assert measure(ts, (POD,), shared, H100, 20 * GIB) == ts_use
    # A whole GPU: the GPU's memory and utilisation; it was given all of it.
    whole_use = DeviceUse(Size("whole"), 7168, 70.0, False, 81920, 100.0)
    assert measure(device("whole"), (), shared, H100, None) == whole_use
    # A MIG partition: its device's memory; with a process, its SMs' share of the GPU (NVML measures
    # no utilisation there); a MIG-MPS share, its limit of that.
    on_mig = NvmlProcess(13, "MIG-1", None, 30 * GIB)
    mig_activity = GpuActivity(None, (on_mig,), {13: POD}, None, {"MIG-1": DeviceUsage(31 * GIB, 40 * GIB, None)})
    mig = device("mig", mig_uuid="MIG-1", mig_profile="3g.40gb")
    mig_use = DeviceUse(Size("mig", profile="3g.40gb"), 31744, 45.5, False, 40960, 45.5)
    assert measure(mig, (), mig_activity, H100, None) == mig_use
    idle = GpuActivity(None, (), {}, None, {"MIG-1": DeviceUsage(0, 40 * GIB, None)})
    assert measure(mig, (), idle, H100, None).compute_percent == 0.0  # type: ignore[union-attr]
    mig_mps = device("mig-mps", mig_uuid="MIG-1", mig_profile="3g.40gb", mps_thread_percentage=50)
    use = measure(mig_mps, (POD,), mig_activity, H100, 30 * GIB)
    assert use == DeviceUse(Size("mig-mps", 30720, 50, "3g.40gb"), 30720, 22.7, True, 30720, 22.7)  # at its limit
    assert measure(mig, (), GpuActivity(None), H100, None) is None  # NVML did not list the MIG device


def test_a_share_at_its_memory_limit_counts_as_out_of_memory():
    full = GpuActivity(50, (NvmlProcess(11, None, 10, 10 * GIB - 100 * MIB),), {11: POD})
    mps = device("mps", mps_memory_bytes=10 * GIB, mps_thread_percentage=25)
    assert measure(mps, (POD,), full, H100, None).at_memory_limit  # type: ignore[union-attr]
    assert device_size(mps, None) == Size("mps", 10240, 25)  # as prepared, where the claim was not read


# --- the plugin's sampling point to the ConfigMap, over mock NVML and the in-memory API ------------------


def mps_claim(api: InMemoryKubeApi, name: str, pod: str, template: str | None = "mps-10gi") -> ClaimRef:
    share = {**result("gpu-3-mps"), "shareID": f"share-{name}", "consumedCapacity": {"memory": "10Gi", "compute": "25"}}
    claim = allocated_claim("team", name, f"uid-{name}", [share])
    claim["status"]["reservedFor"] = [{"resource": "pods", "name": pod, "uid": POD}]
    if template:
        claim["metadata"]["annotations"] = {"resource.kubernetes.io/pod-claim-name": "gpu"}
    api.claims[("team", name)] = claim
    api.pods[("team", pod)] = {
        "metadata": {"name": pod, "namespace": "team", "uid": POD, "labels": {"pod-template-hash": "7d4b9c"},
                     "ownerReferences": [{"kind": "ReplicaSet", "name": "web-7d4b9c", "controller": True}]},
        "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}]},
    }  # fmt: skip
    return ClaimRef("team", name, f"uid-{name}")


@pytest.fixture
def sampled(node: tuple[InMemoryKubeApi, NodeEnv], tmp_path: Path):
    api, env = node
    proc = tmp_path / "proc" / "4242"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(f"0::/kubepods/besteffort/pod{POD}/c0ffee\n")
    now = [100_000.0]
    recorder = UsageRecorder(api, HistorySettings("node-a", "fgpu-system", sample_s=10), clock=lambda: now[0])
    collector = NodeCollector("node-a", env.claims, env.session, env.gpus, ClaimHolders(api),
                              proc_root=tmp_path / "proc", on_claims=recorder.observe)  # fmt: skip
    return api, env, recorder, collector, now


def test_a_share_using_2gi_of_10gi_is_kept_with_its_workload_and_written(sampled):
    api, env, recorder, collector, now = sampled
    refs = [mps_claim(api, "web", "web-7d4b9c-x2x"), mps_claim(api, "adhoc", "adhoc", template=None)]
    assert not any(prepare(DraV1Service(env.preparer, lambda uids, answered: None), refs).values())
    env.session.nvml.set_process(3, MockProcess(4242, sm_percent=8, memory_mib=2048))
    for _ in range(3):
        collector.sample_usage()
        collector.sample_usage()  # 5 s later, as a scrape: not a sample of the history (10 s)
        now[0] += 10
    recorder.flush()

    stored = store.history_of(api.configmaps[("fgpu-system", "fgpu-usage-node-a")])
    assert stored is not None and list(stored.claims) == ["uid-web"]  # the claim without a template is not sized
    claim = stored.claims["uid-web"]
    assert (claim.record.workload, claim.record.template, claim.record.request) == (
        Workload("Deployment", "web"),
        "mps-10gi",
        "gpu",
    )
    assert claim.record.size == Size("mps", 10240, 25) and claim.record.gpu == "NVIDIA H100 80GB HBM3"
    (bucket,) = claim.buckets
    assert (bucket.samples, bucket.memory_peak_mib, bucket.compute_peak, bucket.ooms) == (3, 2048, 8.0, 0)

    # A restart reads the week back before it writes.
    again = UsageRecorder(api, HistorySettings("node-a", "fgpu-system"), clock=lambda: now[0])
    again.flush()
    assert store.history_of(api.configmaps[("fgpu-system", "fgpu-usage-node-a")]) == stored
    assert again.history == stored


def test_a_claim_sized_at_create_is_recorded_with_its_original_request(sampled):
    """The webhook's annotation (Initial mode) is the record's `original`: after an out-of-memory the
    recommendation goes back to it (driver/sizing/recommend.py)."""
    api, env, recorder, collector, _ = sampled
    ref = mps_claim(api, "web", "web-7d4b9c-x2x")
    original = '{"gpu":{"compute":"50","memory":"20Gi"}}'
    api.claims[("team", "web")]["metadata"]["annotations"]["gpu.fgpu.dev/rightsize-original"] = original
    assert not any(prepare(DraV1Service(env.preparer, lambda uids, answered: None), [ref]).values())
    env.session.nvml.set_process(3, MockProcess(4242, sm_percent=8, memory_mib=2048))
    collector.sample_usage()
    recorder.flush()
    stored = store.history_of(api.configmaps[("fgpu-system", "fgpu-usage-node-a")])
    assert stored is not None
    record = stored.claims["uid-web"].record
    assert (record.size, record.original) == (Size("mps", 10240, 25), Size("mps", 20480, 50))


def test_an_unreachable_api_server_writes_nothing_and_keeps_the_samples(sampled):
    api, env, recorder, collector, now = sampled
    ref = mps_claim(api, "web", "web-7d4b9c-x2x")
    assert not any(prepare(DraV1Service(env.preparer, lambda uids, answered: None), [ref]).values())
    collector.sample_usage()  # reads the claim while the API server is there
    api.unavailable = True
    now[0] += 10
    collector.sample_usage()
    recorder.flush()  # cannot read the stored week back: would replace it
    assert not api.configmaps
    api.unavailable = False
    recorder.flush()
    stored = store.history_of(api.configmaps[("fgpu-system", "fgpu-usage-node-a")])
    assert stored is not None and stored.claims["uid-web"].buckets[0].samples == 2


def test_a_write_that_fails_keeps_the_history_for_the_next(sampled, monkeypatch):
    api, _, recorder, _, _ = sampled
    recorder.load()

    def refused(*_: object) -> None:
        raise KubeUnavailableError("connection refused")

    monkeypatch.setattr(api, "create_configmap", refused)
    recorder.flush()  # logged, not raised
    assert not api.configmaps


CLAIM_LABELS = ("claim_namespace", "claim", "kind", "workload_kind", "workload")


def claim_usage_series(collector: NodeCollector) -> dict[tuple[str, ...], float]:
    registry = node_registry(collector)
    return {
        (s.name, *(s.labels[label] for label in CLAIM_LABELS)): s.value
        for family in registry.collect()
        for s in family.samples
        if s.name.startswith(("fgpu_claim_memory", "fgpu_claim_compute"))
    }


PER_CLAIM = (("fgpu_claim_memory_used_bytes", 2 * GIB), ("fgpu_claim_compute_ratio", 0.08),
             ("fgpu_claim_memory_at_limit", 0.0), ("fgpu_claim_memory_allocated_bytes", 10 * GIB),
             ("fgpu_claim_compute_allocated_ratio", 0.25))  # fmt: skip


@pytest.mark.parametrize("tenant_labels", [True, False])
def test_claims_use_is_per_claim_only_with_tenant_labels_else_by_kind(node, tmp_path: Path, tenant_labels: bool):
    api, env = node
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "cgroup").write_text(f"0::/kubepods/besteffort/pod{POD}/c0ffee\n")
    refs = [mps_claim(api, "web", "web-7d4b9c-x2x"), mps_claim(api, "api", "api-7d4b9c-y3y")]
    assert not any(prepare(DraV1Service(env.preparer, lambda uids, answered: None), refs).values())
    env.session.nvml.set_process(3, MockProcess(4242, sm_percent=8, memory_mib=2048))  # both claims' pod
    collector = NodeCollector("node-a", env.claims, env.session, env.gpus, ClaimHolders(api),
                              proc_root=tmp_path, tenant_labels=tenant_labels)  # fmt: skip
    series = claim_usage_series(collector)
    if tenant_labels:  # with the workload that owns the claim's pod
        expected = {(name, "team", claim, "mps", "Deployment", "web"): value
                    for claim in ("web", "api") for name, value in PER_CLAIM}  # fmt: skip
        assert series == expected
    else:
        assert series == {
            ("fgpu_claim_memory_used_bytes", "", "", "mps", "", ""): 4 * GIB,
            ("fgpu_claim_compute_ratio", "", "", "mps", "", ""): 0.16,
            ("fgpu_claim_memory_at_limit", "", "", "mps", "", ""): 0.0,
            ("fgpu_claim_memory_allocated_bytes", "", "", "mps", "", ""): 20 * GIB,
            ("fgpu_claim_compute_allocated_ratio", "", "", "mps", "", ""): 0.5,
        }


def plugin_flags(tmp_path: Path, *flags: str) -> PluginSettings:
    paths = [f"--{name}-dir={tmp_path / name}" for name in ("plugin", "cdi", "registrar")]
    argv = ["kubelet-plugin", "--node-name=node-a", "--nvml=mock:dgx-h100", *paths, *flags]
    return plugin_settings(build_parser().parse_args(argv))


def test_the_history_is_kept_only_where_the_plugin_is_given_a_namespace(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("USAGE_HISTORY_NAMESPACE", raising=False)
    default = plugin_flags(tmp_path)
    assert (default.usage_history_namespace, default.usage_history_interval_s) == ("", 300.0)
    assert (default.usage_sample_period_s, default.proc_root) == (10.0, Path("/proc"))
    kept = plugin_flags(tmp_path, "--usage-history-namespace=fgpu-system", "--usage-history-interval=60")
    assert (kept.usage_history_namespace, kept.usage_history_interval_s) == ("fgpu-system", 60.0)
    with pytest.raises(SettingsError, match="is not a namespace name"):
        plugin_flags(tmp_path, "--usage-history-namespace=Not_A_Namespace")
