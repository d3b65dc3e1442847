"""Whether this plugin instance can serve kubelet, as the gRPC health service reports it (the
DaemonSet's livenessProbe, on the sockets and the TCP health port alike).

SERVING only while all of these hold:
- both sockets are still at their paths and are the files this process bound (kubelet finds the
  plugin by path: a deleted or replaced file cuts it off however well the process runs);
- a self-probe through them answers: GetInfo on the registration socket, NodePrepareResources
  without claims on the DRA socket (a wedged server or exhausted workers show here);
- kubelet registered the plugin (NotifyRegistrationStatus registered=true), or it has been
  unregistered for less than the grace period: since the socket was created, or since kubelet
  reported a failed registration. Kubelet's plugin watcher registers within seconds, so a plugin
  still unregistered after the grace is one kubelet does not use, and a restart may fix that.
  A kubelet restart re-registers the plugin and keeps it SERVING.

Readiness (the DaemonSet's readinessProbe: the health service's `registered` service) is SERVING
only while kubelet has registered this instance and the rule above holds: a rolling update
terminates the old plugin, which withdraws its registration, only once the new one is Ready, so
kubelet always has a registered plugin. Set at once when kubelet reports the registration, and
re-evaluated with liveness.

Evaluated by a small background loop, not inside Check: the probe goes through the same gRPC
servers that answer Check, so probing from a Check handler would take a worker of the server it
probes (the registration server has two) and concurrent Checks could starve it into a false
NOT_SERVING. The loop keeps Check and Watch instant, gives Watch real transitions, and a liveness
probe (period 10 s, failure threshold 3) does not notice its one-second lag.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from driver.node.background import BackgroundWorker
from driver.node.kubelet.api import dra_v1_pb2, dra_v1_pb2_grpc
from driver.node.kubelet.api import pluginregistration_v1_pb2 as reg_pb
from driver.node.kubelet.api import pluginregistration_v1_pb2_grpc as reg_grpc
from driver.node.sockets import BoundSocket

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 3.0  # each call of the self-probe; a loaded node answers an empty call in milliseconds
FIRST_VERDICT_WAIT_S = 2 * PROBE_TIMEOUT_S + 1  # the longest the first evaluation can take
READY_SERVICE = "registered"  # the readinessProbe's gRPC health service


@dataclass(frozen=True)
class RegistrationSnapshot:
    registered: bool
    unregistered_for_s: float  # 0 while registered
    error: str = ""  # kubelet's reason for the last failed registration


class RegistrationState:
    """What kubelet last said about registering this instance, and since when it is unregistered."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, on_change: Callable[[bool], None] = lambda _: None
    ) -> None:
        """`on_change(registered)` is called with each report of kubelet's."""
        self._clock = clock
        self._on_change = on_change
        self._lock = threading.Lock()
        self._registered = False
        self._unregistered_since = clock()  # created with the registration socket
        self._error = ""

    def record(self, registered: bool, error: str = "") -> None:
        with self._lock:
            if registered:
                self._registered, self._error = True, ""
            else:
                if self._registered:  # a failure after a success starts a new grace period
                    self._registered, self._unregistered_since = False, self._clock()
                # Repeated failures keep the first one's time: kubelet retrying must not extend the grace.
                self._error = error
        self._on_change(registered)

    def snapshot(self) -> RegistrationSnapshot:
        with self._lock:
            if self._registered:
                return RegistrationSnapshot(registered=True, unregistered_for_s=0.0)
            return RegistrationSnapshot(False, self._clock() - self._unregistered_since, self._error)


@dataclass(frozen=True)
class LivenessFacts:
    socket_problems: tuple[str, ...]  # why a socket no longer reaches us; empty when both do
    probe_error: str  # "" when the self-probe answered
    registration: RegistrationSnapshot


@dataclass(frozen=True)
class Verdict:
    serving: bool
    reason: str

    @property
    def status(self) -> int:  # a HealthCheckResponse.ServingStatus value
        return health_pb2.HealthCheckResponse.SERVING if self.serving else health_pb2.HealthCheckResponse.NOT_SERVING


def decide(facts: LivenessFacts, grace_s: float) -> Verdict:
    """The liveness rule (module docstring), first failing condition named."""
    if facts.socket_problems:
        return Verdict(False, "; ".join(facts.socket_problems))
    if facts.probe_error:
        return Verdict(False, f"self-probe failed: {facts.probe_error}")
    registration = facts.registration
    if registration.registered:
        return Verdict(True, "registered with kubelet, sockets answer")
    if registration.unregistered_for_s < grace_s:
        return Verdict(True, "sockets answer, waiting for kubelet to register the plugin")
    failed = f" (last failure: {registration.error})" if registration.error else ""
    return Verdict(False, f"kubelet has not registered the plugin for {registration.unregistered_for_s:.0f}s{failed}")


class GatedHealthServicer(health.HealthServicer):
    """grpc's health service, whose Check waits for the monitor's first verdict: the sockets
    accept calls before the first self-probe through them can run, and a client that asks at once
    should get the verdict, not the placeholder. Watch needs no gate: it streams the verdict when it
    comes."""

    def __init__(self) -> None:
        super().__init__()
        self.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # should the first verdict not come in time
        self.set_ready(False)
        self.decided = threading.Event()

    def set_ready(self, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        self.set(READY_SERVICE, status)

    def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        self.decided.wait(FIRST_VERDICT_WAIT_S)
        return super().Check(request, context)


def serve_health_port(servicer: health.HealthServicer, port: int) -> grpc.Server:
    """The health service alone on TCP, for the probes: with hostNetwork anything on the node's
    network reaches this port, so the DRA service must not be on it."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="health"))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"[::]:{port}")
    server.start()
    return server


def self_probe(registration_socket: Path, dra_socket: Path, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """Call each socket the way kubelet does, without side effects; "" when both answer."""
    try:
        with grpc.insecure_channel(f"unix://{registration_socket}") as channel:
            reg_grpc.RegistrationStub(channel).GetInfo(reg_pb.InfoRequest(), timeout=timeout_s)
    except grpc.RpcError as err:
        return f"GetInfo on {registration_socket}: {err.code().name}"
    try:
        with grpc.insecure_channel(f"unix://{dra_socket}") as channel:
            request = dra_v1_pb2.NodePrepareResourcesRequest()
            dra_v1_pb2_grpc.DRAPluginStub(channel).NodePrepareResources(request, timeout=timeout_s)
    except grpc.RpcError as err:
        return f"NodePrepareResources on {dra_socket}: {err.code().name}"
    return ""


class LivenessMonitor(BackgroundWorker):
    """Re-evaluates the rule every CHECK_INTERVAL_S and sets the health service's overall status."""

    thread_name = "liveness"

    def __init__(
        self,
        health_servicer: GatedHealthServicer,
        sockets: tuple[BoundSocket, ...],
        registration: RegistrationState,
        grace_s: float,
        probe: Callable[[], str],
    ) -> None:
        super().__init__()
        self._health = health_servicer
        self._sockets = sockets
        self._registration = registration
        self._grace_s = grace_s
        self._probe = probe
        self._last: Verdict | None = None

    def facts(self) -> LivenessFacts:
        problems = tuple(problem for problem in (s.problem() for s in self._sockets) if problem)
        # A socket that is gone cannot be probed; its problem already says enough.
        probe_error = "" if problems else self._probe()
        return LivenessFacts(problems, probe_error, self._registration.snapshot())

    def check_once(self) -> Verdict:
        facts = self.facts()
        verdict = decide(facts, self._grace_s)
        self._health.set("", verdict.status)
        self._health.set_ready(verdict.serving and facts.registration.registered)
        self._health.decided.set()
        if self._last is None or verdict.serving != self._last.serving:  # transitions only, not every second
            name = health_pb2.HealthCheckResponse.ServingStatus.Name(verdict.status)
            log.log(logging.INFO if verdict.serving else logging.WARNING, "health: %s (%s)", name, verdict.reason)
        self._last = verdict
        return verdict

    def _run(self) -> None:
        while not self._stop.wait(CHECK_INTERVAL_S):
            try:
                self.check_once()
            except Exception:  # the loop must outlive a surprise; the status keeps its last value
                log.exception("evaluating the plugin's health failed")
