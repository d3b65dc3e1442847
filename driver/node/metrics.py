"""What the node plugin does and what its GPUs hold, for Prometheus (`--metrics-port`).

Two kinds of metric. Events (kubelet's requests, claim errors, publish failures, health events)
are counters and histograms in REGISTRY, counted where they happen. What the node holds (prepared
devices, MIG instances, MPS clients, GPU and MIG memory and utilisation by the pod that holds the
device) is read at scrape time by NodeCollector: from the checkpoint, which both plugin instances
of a rolling update share, so either one reports the node's truth, and from NVML. What teams
used over time (GPU-seconds by namespace and kind, each claim's time since last used;
driver/node/usage.py) and what each claim's processes use and was given (memory, compute;
claim_usage.py, also the usage history's samples) are sampled every SAMPLE_S and at each scrape;
GPU-seconds count since this instance started.

Tenants' names stay out unless asked for (`--metrics-tenant-labels`): /metrics is on the pod
network, and any pod could otherwise list every namespace, pod and claim using this node's GPUs.
Without them a holder is its claim's UID (`claim`), and GPU-seconds and claims' use are by kind
only (docs/metrics.md).
The server takes a bounded number of connections, each closed when idle (driver/common/http_server.py).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import pynvml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import MetricsHandler
from prometheus_client.registry import Collector

from driver.claims.refs import ErrorReason
from driver.common.http_server import BoundedHTTPServer, ConnectionLimits
from driver.common.quantity import ceil_int, parse_quantity
from driver.inventory.discovery import GpuInfo
from driver.inventory.sharing import MIG_KINDS, DeviceKind
from driver.kube.client import JsonObject, KubeApi
from driver.kube.errors import KubeError, NotFoundError
from driver.node.background import BackgroundWorker
from driver.node.claim_usage import MIB, ClaimObservation, DeviceUse, measure
from driver.node.state import PreparedClaim, PreparedClaims, PreparedDevice
from driver.node.usage import GpuActivity, HeldDevice, UsageLedger, gpu_fraction, is_busy, pod_uid_of_cgroup
from driver.nvml.session import GpuInstanceRecord, NvmlSession
from driver.sizing.history import Workload
from driver.sizing.owner import workload_of

log = logging.getLogger(__name__)

Method = Literal["NodePrepareResources", "NodeUnprepareResources"]
Operation = Literal["prepare", "unprepare"]
PublishFailure = Literal["unavailable", "conflict", "error"]
HealthKind = Literal["xid", "ecc_double_bit", "gpu_lost"]
StatusRefusal = Literal["invalid", "forbidden", "unauthorized", "bad_request", "too_large", "other"]
REFUSAL_BY_HTTP_STATUS: dict[int, StatusRefusal] = {
    422: "invalid",
    403: "forbidden",
    401: "unauthorized",
    400: "bad_request",
    413: "too_large",
}
TAINT_EFFECTS = ("NoSchedule", "NoExecute")
# Prepares take 1-50 ms on mock GPUs and a first MPS share ~200 ms; a MIG mode change or a slow
# API server reach seconds.
# How often held devices are sampled for GPU-seconds and idle time, besides at each scrape.
SAMPLE_S = 5.0
# A scrape is one request per connection (HTTP/1.0): a few Prometheus replicas and a person with
# curl at once; a connection that sends no request within Prometheus's default scrape timeout is closed.
METRICS_LIMITS = ConnectionLimits(max_connections=8, idle_timeout_s=10.0)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

REGISTRY = CollectorRegistry()
REQUESTS = Counter(
    "fgpu_requests_total",
    "kubelet's NodePrepareResources/NodeUnprepareResources calls with claims; result error: a claim failed",
    ["method", "result"],
    registry=REGISTRY,
)
REQUEST_SECONDS = Histogram(
    "fgpu_request_duration_seconds",
    "Time to answer kubelet's call, all its claims",
    ["method"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
IN_FLIGHT = Gauge("fgpu_requests_in_flight", "kubelet's calls being answered", ["method"], registry=REGISTRY)
CLAIM_ERRORS = Counter(
    "fgpu_claim_errors_total",
    "Claims that failed, by where the error came from",
    ["operation", "reason"],
    registry=REGISTRY,
)
PUBLISH_FAILURES = Counter(
    "fgpu_slice_publish_failures_total",
    "Failed attempts to publish the node's ResourceSlices (unavailable: API server; conflict: a race)",
    ["reason"],
    registry=REGISTRY,
)
PUBLISH_RETRIES = Counter(
    "fgpu_slice_publish_retries_total", "Attempts to publish ResourceSlices after a failed one", registry=REGISTRY
)
STATUS_REFUSALS = Counter(
    "fgpu_claim_status_refusals_total",
    "Writes of claims' status.devices the API server refused (not retried until the claim changes)",
    ["reason"],
    registry=REGISTRY,
)
HEALTH_EVENTS = Counter(
    "fgpu_health_events_total", "GPU health events (xid: its number)", ["gpu", "kind", "xid"], registry=REGISTRY
)
TAINTS = Gauge("fgpu_device_taints", "Device taints this node's plugin has in force", ["effect"], registry=REGISTRY)

# Every series a dashboard or alert expects exists from the start, at zero.
for _method in get_args(Method):
    IN_FLIGHT.labels(_method)
    REQUEST_SECONDS.labels(_method)
    for _result in ("ok", "error"):
        REQUESTS.labels(_method, _result)
for _operation in get_args(Operation):
    for _reason in get_args(ErrorReason):
        CLAIM_ERRORS.labels(_operation, _reason)
for _failure in get_args(PublishFailure):
    PUBLISH_FAILURES.labels(_failure)
for _refusal in get_args(StatusRefusal):
    STATUS_REFUSALS.labels(_refusal)
_taint_effects = set(TAINT_EFFECTS)
_taints_guard = threading.Lock()


# --- hooks ----------------------------------------------------------------------------------------


@dataclass
class RequestOutcome:
    failed: bool = False


@contextlib.contextmanager
def observed_request(method: Method, claims: int) -> Iterator[RequestOutcome]:
    """Count and time one kubelet call; the caller sets `failed` when a claim of it failed."""
    outcome = RequestOutcome()
    if claims == 0:  # the liveness self-probe, every second: no work, and not kubelet's
        yield outcome
        return
    IN_FLIGHT.labels(method).inc()
    started = time.perf_counter()
    try:
        yield outcome
    except BaseException:
        outcome.failed = True
        raise
    finally:
        IN_FLIGHT.labels(method).dec()
        REQUEST_SECONDS.labels(method).observe(time.perf_counter() - started)
        REQUESTS.labels(method, "error" if outcome.failed else "ok").inc()


def record_claim_error(operation: Operation, reason: ErrorReason) -> None:
    CLAIM_ERRORS.labels(operation, reason).inc()


def record_publish_failure(reason: PublishFailure) -> None:
    PUBLISH_FAILURES.labels(reason).inc()


def record_publish_retry() -> None:
    PUBLISH_RETRIES.inc()


def record_status_refusal(http_status: int) -> None:
    """A refused status.devices write, by the HTTP status of the refusal (422: invalid, ...)."""
    STATUS_REFUSALS.labels(REFUSAL_BY_HTTP_STATUS.get(http_status, "other")).inc()


def record_health_event(gpu_uuid: str, kind: HealthKind, xid: int | None = None) -> None:
    """One health event of a GPU (driver/node/health*); xid only for kind xid."""
    HEALTH_EVENTS.labels(gpu_uuid, kind, "" if xid is None else str(xid)).inc()


def set_taints_in_force(counts: Mapping[str, int]) -> None:
    """The device taints in force now, by effect: an effect not named has none (0)."""
    with _taints_guard:
        _taint_effects.update(counts)
        for effect in _taint_effects:
            TAINTS.labels(effect).set(counts.get(effect, 0))


# --- what the node holds, read at scrape time -----------------------------------------------------


@dataclass(frozen=True)
class ClaimReading:
    """What the API server says of a prepared claim: the pods holding it (names and UIDs) and the
    memory each share of it was allocated, by (pool, device, shareID)."""

    pods: tuple[str, ...] = ()
    pod_uids: tuple[str, ...] = ()
    share_memory: Mapping[tuple[str, str, str], int] = field(default_factory=dict)
    claim: Mapping[str, Any] = field(default_factory=dict)  # as read: right-sizing's record of it


@dataclass(frozen=True)
class _Reading:
    reading: ClaimReading
    read_at: float


class ClaimHolders:
    """The pods that hold each prepared claim: its status.reservedFor, looked up at scrape time
    and kept for `refresh_s`, with the memory its shares were allocated (for GPU-seconds) and the
    workload that owns its first pod (for the claims' use with tenant labels). Not
    recorded at prepare: kubelet prepares a claim once per node, so a second pod sharing it never
    reaches the plugin, and the checkpoint stays as it is (an older instance of a rolling update
    reads it too). An unreachable API server keeps what is
    known and is not asked again for `refresh_s`, so a scrape never waits on it twice."""

    def __init__(self, api: KubeApi, refresh_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._api = api
        self._refresh_s = refresh_s
        self._clock = clock
        self._known: dict[str, _Reading] = {}
        self._owners: dict[str, Workload | None] = {}  # pod UID -> its workload; None: gone or re-created
        self._quiet_until = 0.0
        self._lock = threading.Lock()

    def pods(self, claims: Iterable[PreparedClaim]) -> dict[str, tuple[str, ...]]:
        """Claim UID -> names of the pods holding it (empty where unknown)."""
        return {uid: reading.pods for uid, reading in self.readings(claims).items()}

    def readings(self, claims: Iterable[PreparedClaim]) -> dict[str, ClaimReading]:
        """Claim UID -> what is known of it (nothing where unknown)."""
        with self._lock:
            claims = list(claims)
            for claim in claims:
                known = self._known.get(claim.uid)
                now = self._clock()
                if (known is None or now - known.read_at >= self._refresh_s) and now >= self._quiet_until:
                    self._look_up(claim, now)
            self._known = {c.uid: self._known[c.uid] for c in claims if c.uid in self._known}
            return {c.uid: self._known[c.uid].reading if c.uid in self._known else ClaimReading() for c in claims}

    def workloads(self, observed: Iterable[ClaimObservation]) -> dict[str, Workload]:
        """Claim UID -> the workload that owns the first pod holding it (driver/sizing/owner.py);
        claims without a known pod are left out. One GET per pod, kept while a sampled claim names
        it: a pod's owner does not change."""
        with self._lock:
            first_pods = {o.claim_uid: (o.namespace, *o.pods[0]) for o in observed if o.pods}
            for namespace, name, pod_uid in set(first_pods.values()):
                if pod_uid not in self._owners and self._clock() >= self._quiet_until:
                    self._look_up_owner(namespace, name, pod_uid)
            self._owners = {uid: self._owners[uid] for _, _, uid in first_pods.values() if uid in self._owners}
            owners = {claim: self._owners.get(pod_uid) for claim, (_, _, pod_uid) in first_pods.items()}
            return {claim: owner for claim, owner in owners.items() if owner is not None}

    def _look_up_owner(self, namespace: str, name: str, uid: str) -> None:
        try:
            pod: JsonObject = self._api.get_pod(namespace, name)
        except NotFoundError:
            pod = {}
        except KubeError as err:
            log.info("cannot read pod %s/%s for the metrics' workload labels: %s", namespace, name, err)
            self._quiet_until = self._clock() + self._refresh_s
            return
        # Gone, or re-created: not the pod that holds the claim; its UID does not come back.
        self._owners[uid] = workload_of(pod) if (pod.get("metadata") or {}).get("uid") == uid else None

    def _look_up(self, claim: PreparedClaim, now: float) -> None:
        try:
            current: JsonObject = self._api.get_claim(claim.namespace, claim.name)
        except NotFoundError:
            current = {}
        except KubeError as err:
            log.info("cannot read claim %s/%s for the metrics' pod labels: %s", claim.namespace, claim.name, err)
            self._quiet_until = now + self._refresh_s
            return
        self._known[claim.uid] = _Reading(_claim_reading(current, claim.uid), now)


def _claim_reading(claim: JsonObject, uid: str) -> ClaimReading:
    if (claim.get("metadata") or {}).get("uid") != uid:  # gone, or re-created: not the claim we hold
        return ClaimReading()
    status = claim.get("status") or {}
    pods = sorted(
        (str(r.get("name")), str(r.get("uid", "")))
        for r in status.get("reservedFor") or ()
        if r.get("resource") == "pods"
    )
    results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or ()
    share_memory = {
        (str(r.get("pool")), str(r.get("device")), str(r.get("shareID"))): _bytes(r["consumedCapacity"]["memory"])
        for r in results
        if r.get("shareID") and "memory" in (r.get("consumedCapacity") or {})
    }
    return ClaimReading(tuple(n for n, _ in pods), tuple(u for _, u in pods), share_memory, claim)


def _bytes(quantity: str) -> int:
    return ceil_int(parse_quantity(quantity))


@dataclass(frozen=True)
class _Holder:
    namespace: str
    pod: str
    claim: str


_NOBODY = (_Holder("", "", ""),)
# Not "namespace" and "pod": Prometheus's Kubernetes targets carry those (this plugin's own pod).
HOLDER_LABELS = ["claim_namespace", "claim_pod", "claim"]
# The claims' use metrics (NodeCollector._claim_usage): name, help, value (None: no series).
CLAIM_GAUGES: tuple[tuple[str, str, Callable[[DeviceUse], float | None]], ...] = (
    (
        "fgpu_claim_memory_used_bytes",
        "GPU memory the claim's processes hold (a whole GPU or MIG partition: the device's), at the last sample",
        lambda use: use.memory_mib * MIB,
    ),
    (
        "fgpu_claim_compute_ratio",
        "The claim's compute activity as a fraction of its whole GPU's SMs, at the last sample",
        lambda use: use.compute_percent / 100,
    ),
    (
        "fgpu_claim_memory_at_limit",
        "Claims whose processes hold 98% or more of their memory limit (out-of-memory likely), at the last sample",
        lambda use: float(use.at_memory_limit),
    ),
    (
        "fgpu_claim_memory_allocated_bytes",
        "GPU memory the claim was given (a whole GPU or MIG partition: the device's; an MPS share: its limit; "
        "a time-sliced share: its allocation), at the last sample",
        lambda use: use.memory_allocated_mib * MIB,
    ),
    (
        "fgpu_claim_compute_allocated_ratio",
        "The SMs the claim was given as a fraction of its whole GPU's (a MIG partition: its own; an MPS share: "
        "its limit; none for a time-sliced share), at the last sample",
        lambda use: None if use.compute_allocated_percent is None else use.compute_allocated_percent / 100,
    ),
)
GPU_LABELS = ["gpu", "gpu_index"]
MIG_LABELS = [*GPU_LABELS, "mig", "mig_profile"]


class NodeCollector(Collector):
    def __init__(
        self,
        node: str,
        claims: PreparedClaims,
        nvml: NvmlSession,
        gpus: list[GpuInfo],
        holders: ClaimHolders,
        clock: Callable[[], float] = time.time,
        proc_root: Path = Path("/proc"),
        tenant_labels: bool = False,
        on_claims: Callable[[float, list[ClaimObservation]], None] | None = None,
    ) -> None:
        self._node = node
        self._on_claims = on_claims  # each sample's claims, for the usage history (usage_history.py)
        self._tenant_labels = tenant_labels  # claims' namespaces, names and pods as labels
        self._claims = claims
        self._nvml = nvml
        self._gpus = gpus
        self._holders = holders
        self._profile_names = {p.profile_id: p.name for gpu in gpus for p in gpu.mig_profiles}
        self._clock = clock
        self._proc_root = proc_root  # the host's /proc: the plugin runs with hostPID
        self._ledger = UsageLedger()
        self._ledger_lock = threading.Lock()
        self._observed: list[ClaimObservation] = []  # the last sample's claims (fgpu_claim_memory_used_bytes)

    def collect(self) -> Iterator[Metric]:
        prepared = self._prepared_claims()
        yield from self._prepared(prepared)
        holders = self._holders_by_device(prepared)
        yield from self._usage(holders)
        yield from self._team_usage(self.sample_usage())
        yield from self._claim_usage()

    def _prepared_claims(self) -> list[PreparedClaim]:
        return [c for c in self._claims.all().values() if c.state == "PrepareCompleted"]

    # --- GPU-seconds and idle claims (driver/node/usage.py) ---

    def sample_usage(self) -> float:
        """One sample of what is held and used (MetricsServer takes one every few seconds, and
        every scrape one more); returns the sample's wall clock time."""
        prepared = self._prepared_claims()
        readings = self._holders.readings(prepared)
        activity = {gpu.uuid: self._activity(gpu) for gpu in self._gpus}
        gpus = {gpu.uuid: gpu for gpu in self._gpus}
        held, observed = [], []
        for claim in prepared:
            reading = readings[claim.uid]
            holding = [d for d in claim.devices if d.holds]  # admin access holds nothing
            for device in holding:
                seen = activity.get(device.gpu_uuid)
                if seen is None:  # a GPU NVML lost
                    continue
                share = reading.share_memory.get((device.pool, device.device, str(device.share_id)))
                if len(holding) == 1:  # one size per claim is sized
                    observation = self._observe(claim, device, reading, seen, gpus[device.gpu_uuid], share)
                    if observation is not None:
                        observed.append(observation)
                held.append(
                    HeldDevice(
                        claim_uid=claim.uid,
                        namespace=claim.namespace,
                        claim=claim.name,
                        pods=reading.pods,
                        kind=device.kind,
                        device=device.device,
                        gpu_fraction=gpu_fraction(device, gpus[device.gpu_uuid].memory_bytes, share),
                        busy=is_busy(device, reading.pod_uids, seen),
                    )
                )
        with self._ledger_lock:
            now = self._clock()
            self._ledger.observe(now, held)
            self._observed = observed
        if self._on_claims is not None:
            self._on_claims(now, observed)
        return now

    @staticmethod
    def _observe(
        claim: PreparedClaim,
        device: PreparedDevice,
        reading: ClaimReading,
        activity: GpuActivity,
        gpu: GpuInfo,
        share_memory: int | None,
    ) -> ClaimObservation | None:
        use = measure(device, reading.pod_uids, activity, gpu, share_memory)
        if use is None or not device.request_names:
            return None
        pods = tuple(zip(reading.pods, reading.pod_uids, strict=True))
        return ClaimObservation(claim.uid, claim.namespace, claim.name, device.request_names[0],
                                gpu.product_name, use, pods, reading.claim)  # fmt: skip

    def _activity(self, gpu: GpuInfo) -> GpuActivity | None:
        try:
            usage = self._nvml.usage(gpu.index)
            processes = tuple(self._nvml.processes(gpu.index))
            migs = self._nvml.mig_usage(gpu.index) if gpu.mig_capable else {}
        except pynvml.NVMLError as err:
            log.debug("no activity of GPU %s at this sample: %s", gpu.uuid, err)
            return None
        pods = {p.pid: pod for p in processes if (pod := self._pod_of(p.pid))}
        return GpuActivity(usage.gpu_percent, processes, pods, usage, migs)

    def _pod_of(self, pid: int) -> str | None:
        try:
            return pod_uid_of_cgroup((self._proc_root / str(pid) / "cgroup").read_text())
        except OSError:  # ended since NVML listed it
            return None

    def _team_usage(self, now: float) -> Iterator[Metric]:
        with self._ledger_lock:
            seconds = dict(self._ledger.gpu_seconds)
            idle = self._ledger.idle(now)
        gpu_seconds = CounterMetricFamily(
            "fgpu_gpu_seconds",
            "GPU-seconds held by prepared claims since the plugin started (a whole GPU 1, a MIG partition "
            "its memory slices / 8, a share its memory / the GPU's)",
            labels=["node", "claim_namespace", "kind"],
        )
        by_label: dict[tuple[str, DeviceKind], float] = collections.defaultdict(float)
        for (namespace, kind), value in seconds.items():  # without tenant labels: by kind alone
            by_label[namespace if self._tenant_labels else "", kind] += value
        for (namespace, kind), value in sorted(by_label.items()):
            gpu_seconds.add_metric([self._node, namespace, kind], value)
        labels = ["node", *HOLDER_LABELS, "kind", "device"]
        idle_s = GaugeMetricFamily(
            "fgpu_claim_idle_seconds", "Time since the claim's device was last used (docs/kueue.md)", labels=labels
        )
        last_used = GaugeMetricFamily(
            "fgpu_claim_last_used_timestamp_seconds",
            "When the claim's device was last used, or first seen held if not since",
            labels=labels,
        )
        for entry in idle:
            held = entry.held
            for holder in self._claim_holders(held.namespace, held.claim, held.claim_uid, held.pods):
                values = [self._node, holder.namespace, holder.pod, holder.claim, held.kind, held.device]
                idle_s.add_metric(values, entry.idle_s)
                last_used.add_metric(values, entry.last_used)
        yield from (gpu_seconds, idle_s, last_used)

    def _claim_usage(self) -> Iterator[Metric]:
        """What each claim's processes use and what it was given (right-sizing's measure,
        claim_usage.py): per claim, with the workload that owns its pods, where tenant labels are
        allowed, else summed by kind: a claim's UID would make a series per claim that says nothing
        without the names. A claim's workload does not change, so it adds no series."""
        with self._ledger_lock:
            observed = list(self._observed)
        workloads = self._holders.workloads(observed) if self._tenant_labels else {}
        labels = ["node", "claim_namespace", "claim", "kind", "workload_kind", "workload"]
        families = {name: GaugeMetricFamily(name, doc, labels=labels) for name, doc, _ in CLAIM_GAUGES}
        sums: dict[tuple[str, ...], dict[str, float]] = collections.defaultdict(dict)
        for o in observed:
            values = sums[self._claim_labels(o, workloads.get(o.claim_uid))]
            for name, _, value_of in CLAIM_GAUGES:
                value = value_of(o.use)
                if value is not None:
                    values[name] = values.get(name, 0.0) + value
        for key, values in sorted(sums.items()):
            for name, value in values.items():
                families[name].add_metric([self._node, *key], value)
        yield from families.values()

    def _claim_labels(self, o: ClaimObservation, workload: Workload | None) -> tuple[str, ...]:
        """A claim's use's labels after the node's: its names and workload, or its kind alone."""
        if not self._tenant_labels:
            return "", "", o.use.size.kind, "", ""
        owner = workload or Workload("", "")  # its pod not known (yet)
        return o.namespace, o.name, o.use.size.kind, owner.kind, owner.name

    def _prepared(self, prepared: list[PreparedClaim]) -> Iterator[Metric]:
        devices = [d for c in prepared for d in c.devices if d.holds]  # admin access holds nothing
        # The node label tells two instances of a rolling update (same node, same answer) apart from two nodes.
        kinds = GaugeMetricFamily(
            "fgpu_prepared_devices", "Devices of prepared claims on the node", labels=["node", "kind"]
        )
        for kind in get_args(DeviceKind):
            kinds.add_metric([self._node, kind], sum(1 for d in devices if d.kind == kind))
        yield kinds
        mps = GaugeMetricFamily("fgpu_mps_clients", "MPS shares prepared on the GPU, each a client", labels=GPU_LABELS)
        for gpu in self._gpus:
            mps.add_metric(_gpu_labels(gpu), sum(1 for d in devices if d.kind == "mps" and d.gpu_uuid == gpu.uuid))
        yield mps

    def _holders_by_device(self, prepared: list[PreparedClaim]) -> dict[str, list[_Holder]]:
        """GPU or MIG UUID -> who holds it: a MIG device is held by its claim, a GPU by the claims
        of its whole GPU, MPS or time-sliced shares."""
        pods = self._holders.pods(prepared)
        holders: dict[str, list[_Holder]] = {}
        for claim in prepared:
            for device in claim.devices:
                key = _device_key(device)
                if key:
                    holders.setdefault(key, []).extend(
                        self._claim_holders(claim.namespace, claim.name, claim.uid, pods[claim.uid])
                    )
        return holders

    def _claim_holders(self, namespace: str, claim: str, uid: str, pods: tuple[str, ...]) -> list[_Holder]:
        """The holder labels of a claim: one per pod holding it, or (without tenant labels) one
        naming nothing but the claim's UID, which tells claims apart without saying whose they are."""
        if not self._tenant_labels:
            return [_Holder("", "", uid)]
        return [_Holder(namespace, pod, claim) for pod in pods or ("",)]

    def _usage(self, holders: dict[str, list[_Holder]]) -> Iterator[Metric]:
        labels, mig_labels = [*GPU_LABELS, *HOLDER_LABELS], [*MIG_LABELS, *HOLDER_LABELS]
        utilization = GaugeMetricFamily(
            "fgpu_gpu_utilization_ratio", "GPU busy time (NVML; none in MIG mode, unsupported there)", labels=labels
        )
        used = GaugeMetricFamily("fgpu_gpu_memory_used_bytes", "GPU memory used", labels=labels)
        total = GaugeMetricFamily("fgpu_gpu_memory_total_bytes", "GPU memory", labels=labels)
        instances = GaugeMetricFamily(
            "fgpu_mig_instances", "MIG instances on the GPU, by profile", labels=[*GPU_LABELS, "mig_profile"]
        )
        mig_used = GaugeMetricFamily("fgpu_mig_memory_used_bytes", "MIG device memory used", labels=mig_labels)
        mig_total = GaugeMetricFamily("fgpu_mig_memory_total_bytes", "MIG device memory", labels=mig_labels)
        for gpu in self._gpus:
            try:
                usage = self._nvml.usage(gpu.index)
                records = self._nvml.gpu_instances(gpu.index)
                migs = self._nvml.mig_usage(gpu.index) if records else {}
            except pynvml.NVMLError as err:  # a lost GPU: its other metrics still go out
                log.debug("no usage of GPU %s at this scrape: %s", gpu.uuid, err)
                continue
            for holder in holders.get(gpu.uuid, _NOBODY):
                values = [*_gpu_labels(gpu), holder.namespace, holder.pod, holder.claim]
                if usage.gpu_percent is not None:
                    utilization.add_metric(values, usage.gpu_percent / 100)
                used.add_metric(values, usage.memory_used_bytes)
                total.add_metric(values, usage.memory_total_bytes)
            for profile, count in collections.Counter(self._profile(r) for r in records).items():
                instances.add_metric([*_gpu_labels(gpu), profile], count)
            profiles = {uuid: self._profile(r) for r in records for _, uuid in r.compute_instances}
            for mig_uuid, mig in migs.items():
                for holder in holders.get(mig_uuid, _NOBODY):
                    values = [*_gpu_labels(gpu), mig_uuid, profiles.get(mig_uuid, "")]
                    values += [holder.namespace, holder.pod, holder.claim]
                    mig_used.add_metric(values, mig.memory_used_bytes)
                    mig_total.add_metric(values, mig.memory_total_bytes)
        yield from (utilization, used, total, instances, mig_used, mig_total)

    def _profile(self, record: GpuInstanceRecord) -> str:
        return self._profile_names.get(record.profile_id, f"profile-{record.profile_id}")


def _device_key(device: PreparedDevice) -> str | None:
    return device.mig_uuid if device.kind in MIG_KINDS else device.gpu_uuid


def _gpu_labels(gpu: GpuInfo) -> list[str]:
    return [gpu.uuid, str(gpu.index)]


# --- serving ----------------------------------------------------------------------------------------


def node_registry(collector: Collector) -> CollectorRegistry:
    """This process's metrics: the event counters and the node's state read at scrape time."""
    registry = CollectorRegistry()
    registry.register(REGISTRY)
    registry.register(collector)
    return registry


class MetricsServer(BackgroundWorker):
    """Serves /metrics on the port. A port in use is tried again until it is free: with hostNetwork
    the previous instance of a rolling update holds it until it stops, and kubelet needs the new
    instance up meanwhile, so a bind failure must not end the plugin."""

    thread_name = "metrics"

    def __init__(
        self,
        port: int,
        registry: CollectorRegistry,
        retry_s: float = 2.0,
        sample: Callable[[], object] | None = None,
        sample_s: float = SAMPLE_S,
        limits: ConnectionLimits = METRICS_LIMITS,
    ) -> None:
        super().__init__()
        self._port = port
        self._limits = limits
        self._registry = registry
        self._retry_s = retry_s
        self._sample = sample
        self._sample_s = sample_s

    def _run(self) -> None:
        waiting = False
        while not self._stop.is_set():
            try:
                server = BoundedHTTPServer(
                    ("0.0.0.0", self._port), MetricsHandler.factory(self._registry), self._limits
                )
            except OSError as err:
                if not waiting:
                    log.warning("metrics port %d: %s; trying again every %.0fs", self._port, err, self._retry_s)
                    waiting = True
                self._stop.wait(self._retry_s)
                continue
            thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
            thread.start()
            log.info("Prometheus metrics on port %d", self._port)
            while not self._stop.wait(self._sample_s):
                self._take_sample()
            server.shutdown()
            server.server_close()
            thread.join()

    def _take_sample(self) -> None:
        if self._sample is None:
            return
        try:
            self._sample()
        except Exception:  # the next sample tries again; serving must go on
            log.exception("usage sample failed")
