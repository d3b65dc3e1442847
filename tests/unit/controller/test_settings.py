"""`fgpu controller`'s flags -> ControllerSettings (driver/controller/settings.py). Bad values as a
user gives them (one line, exit 2): tests/unit/cli/test_bad_input.py."""

import os
import socket

import pytest

from driver.common.flags import FlagParser, SettingsError
from driver.controller.leader import LeaseTimings
from driver.controller.settings import ControllerSettings, add_controller_flags, controller_settings


def settings(*argv: str) -> ControllerSettings:
    parser = FlagParser(prog="fgpu controller")
    add_controller_flags(parser)
    return controller_settings(parser.parse_args(argv))


def test_the_defaults_are_client_gos_and_making_room_is_off(monkeypatch):
    monkeypatch.delenv("KUBECONFIG", raising=False)
    assert settings() == ControllerSettings(
        kubeconfig=None,
        identity=f"{socket.gethostname()}-{os.getpid()}",
        policy="fragmentation",
        lease_namespace="kube-system",
        timings=LeaseTimings(15.0, 10.0, 2.0),
        evictions_per_minute=0,
        compact=False,
        metrics_port=0,
        health_port=0,
        stall_s=120.0,
        preempt_across_namespaces=False,
    )


def test_flags_and_environment_reach_the_settings(monkeypatch):
    monkeypatch.setenv("LEASE_DURATION", "30")
    got = settings("--identity=a", "--policy=spread", "--make-room", "--evictions-per-minute=3",
                   "--compact-when-idle", "--leader-elect-renew-deadline=20", "--metrics-port=9000")  # fmt: skip
    assert (got.identity, got.policy, got.evictions_per_minute, got.compact, got.metrics_port) == (
        "a",
        "spread",
        3,
        True,
        9000,
    )
    assert got.timings == LeaseTimings(30.0, 20.0, 2.0)
    got = settings("--make-room", "--preempt-across-namespaces", "--health-port=8081", "--stalled-after=60")
    assert (got.preempt_across_namespaces, got.health_port, got.stall_s) == (True, 8081, 60.0)
    assert settings("--place-pods").place_pods and not got.place_pods
    assert settings("--make-room", "--compact-when-idle", "--empty-nodes").empty_nodes and not got.empty_nodes


def test_settings_that_do_not_go_together_name_their_flags():
    with pytest.raises(SettingsError, match=r"^--leader-elect-\*: lease timings need"):
        settings("--leader-elect-retry-period=20")
    with pytest.raises(SettingsError, match=r"^--compact-when-idle moves pods as making room does"):
        settings("--compact-when-idle")
    with pytest.raises(SettingsError, match=r"^--empty-nodes is a way of compacting: give --compact-when-idle"):
        settings("--make-room", "--empty-nodes")
    with pytest.raises(SettingsError, match=r"^--preempt-across-namespaces widens making room"):
        settings("--preempt-across-namespaces")
