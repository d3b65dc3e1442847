"""The liveness rule: sockets still ours, a self-probe that answers, kubelet's registration within
the grace period; and the monitor that turns it into the health service's status."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from driver.node.kubelet.liveness import (
    READY_SERVICE,
    GatedHealthServicer,
    LivenessFacts,
    LivenessMonitor,
    RegistrationSnapshot,
    RegistrationState,
    Verdict,
    decide,
    self_probe,
)
from driver.node.sockets import BoundSocket

GRACE = 60.0
REGISTERED = RegistrationSnapshot(registered=True, unregistered_for_s=0.0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("facts", "expected"),
    [
        (LivenessFacts((), "", REGISTERED), Verdict(True, "registered with kubelet, sockets answer")),
        (
            LivenessFacts((), "", RegistrationSnapshot(False, GRACE - 1)),
            Verdict(True, "sockets answer, waiting for kubelet to register the plugin"),
        ),
        (
            LivenessFacts((), "", RegistrationSnapshot(False, GRACE)),
            Verdict(False, "kubelet has not registered the plugin for 60s"),
        ),
        (
            LivenessFacts((), "", RegistrationSnapshot(False, GRACE + 5, "endpoint already registered")),
            Verdict(False, "kubelet has not registered the plugin for 65s (last failure: endpoint already registered)"),
        ),
        (
            LivenessFacts(("socket /r.sock was deleted",), "", REGISTERED),
            Verdict(False, "socket /r.sock was deleted"),
        ),
        (
            LivenessFacts(
                ("socket /r.sock was deleted", "socket /d.sock was replaced by another file"), "", REGISTERED
            ),
            Verdict(False, "socket /r.sock was deleted; socket /d.sock was replaced by another file"),
        ),
        (
            LivenessFacts((), "GetInfo on /r.sock: DEADLINE_EXCEEDED", REGISTERED),
            Verdict(False, "self-probe failed: GetInfo on /r.sock: DEADLINE_EXCEEDED"),
        ),
    ],
)
def test_the_rule(facts: LivenessFacts, expected: Verdict):
    assert decide(facts, GRACE) == expected


def test_registration_state_times_the_grace_from_the_socket_or_a_failure():
    clock = Clock()
    state = RegistrationState(clock)
    clock.now += 10
    assert state.snapshot() == RegistrationSnapshot(False, 10.0)  # never registered: since creation
    state.record(False, "first try failed")
    clock.now += 5
    state.record(False, "second try failed")  # kubelet retrying does not extend the grace
    assert state.snapshot() == RegistrationSnapshot(False, 15.0, "second try failed")
    state.record(True)
    clock.now += 1000
    assert state.snapshot() == REGISTERED
    state.record(True)  # kubelet restarted and registered the plugin again
    assert state.snapshot() == REGISTERED
    state.record(False, "validation failed")
    clock.now += 3
    assert state.snapshot() == RegistrationSnapshot(False, 3.0, "validation failed")  # a new grace period


@pytest.fixture
def sockets(tmp_path: Path) -> Iterator[tuple[BoundSocket, BoundSocket]]:
    listeners = []
    for name in ("reg.sock", "dra.sock"):
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(tmp_path / name))
        listeners.append(listener)
    yield BoundSocket.at(tmp_path / "reg.sock"), BoundSocket.at(tmp_path / "dra.sock")
    for listener in listeners:
        listener.close()


class Probe:
    def __init__(self) -> None:
        self.error = ""
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        return self.error


def status(servicer: GatedHealthServicer) -> int:
    return servicer.Check(health_pb2.HealthCheckRequest(), None).status


def test_the_monitor_sets_the_health_status(sockets: tuple[BoundSocket, BoundSocket]):
    clock, probe, servicer = Clock(), Probe(), GatedHealthServicer()
    registration = RegistrationState(clock)
    monitor = LivenessMonitor(servicer, sockets, registration, GRACE, probe)
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

    assert monitor.check_once().serving and status(servicer) == serving  # within the grace
    clock.now += GRACE
    assert not monitor.check_once().serving and status(servicer) == not_serving  # nobody registered
    registration.record(True)
    assert monitor.check_once().serving and status(servicer) == serving

    probe.error = "NodePrepareResources on dra.sock: UNAVAILABLE"
    assert monitor.check_once() == Verdict(False, "self-probe failed: NodePrepareResources on dra.sock: UNAVAILABLE")
    assert status(servicer) == not_serving
    probe.error = ""
    assert monitor.check_once().serving

    calls = probe.calls
    sockets[0].path.unlink()
    assert monitor.check_once() == Verdict(False, f"socket {sockets[0].path} was deleted")
    assert status(servicer) == not_serving
    assert probe.calls == calls  # a socket that is gone is not probed


def ready(servicer: GatedHealthServicer) -> int:
    return servicer.Check(health_pb2.HealthCheckRequest(service=READY_SERVICE), None).status


def test_ready_only_while_kubelet_has_registered_the_instance(sockets: tuple[BoundSocket, BoundSocket]):
    """The readinessProbe: a rolling update's new plugin is Ready (and the old one stopped) only
    once kubelet registered it; alive meanwhile, within the grace."""
    clock, probe, servicer = Clock(), Probe(), GatedHealthServicer()
    registration = RegistrationState(clock, on_change=servicer.set_ready)
    monitor = LivenessMonitor(servicer, sockets, registration, GRACE, probe)
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

    assert monitor.check_once().serving and (status(servicer), ready(servicer)) == (serving, not_serving)
    registration.record(True)
    assert ready(servicer) == serving  # at once, not at the monitor's next round
    assert monitor.check_once().serving and ready(servicer) == serving
    probe.error = "GetInfo on r.sock: UNAVAILABLE"
    monitor.check_once()
    assert ready(servicer) == not_serving
    probe.error = ""
    monitor.check_once()
    registration.record(False, "endpoint already registered")
    assert ready(servicer) == not_serving and status(servicer) == serving  # a new grace
    registration.record(True)
    servicer.enter_graceful_shutdown()  # SIGTERM: not Ready while the registration is withdrawn
    assert ready(servicer) == not_serving


def test_the_first_check_waits_for_the_first_verdict(sockets: tuple[BoundSocket, BoundSocket]):
    """The sockets accept calls a moment before the first evaluation: a client asking then must
    not be told the placeholder NOT_SERVING."""
    servicer = GatedHealthServicer()
    monitor = LivenessMonitor(servicer, sockets, RegistrationState(Clock()), GRACE, Probe())
    answers: list[int] = []
    early = threading.Thread(target=lambda: answers.append(status(servicer)))
    early.start()
    early.join(0.3)
    assert early.is_alive() and answers == []
    monitor.check_once()
    early.join(10)
    assert answers == [health_pb2.HealthCheckResponse.SERVING]


def test_the_self_probe_names_what_did_not_answer(tmp_path: Path):
    error = self_probe(tmp_path / "gone-reg.sock", tmp_path / "gone-dra.sock", timeout_s=2)
    assert error == f"GetInfo on {tmp_path / 'gone-reg.sock'}: UNAVAILABLE"
