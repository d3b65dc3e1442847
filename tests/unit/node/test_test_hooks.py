"""The node plugin's test hooks (driver/common/testhooks.py): production gets the no-op, built once
and reading nothing at a step; the FGPU_* variables still name the same steps; the plugin hands
its hooks to the preparer and, as plain callbacks, to the MPS partitioner, and partitioner/ knows
nothing of them."""

from __future__ import annotations

import ast
import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest

from driver.claims.refs import ClaimRef
from driver.cli.main import build_parser
from driver.common import testhooks
from driver.common.testhooks import (
    CLOCK_OFFSET_ENV,
    CRASH_ENV,
    HOOK_ENVS,
    NO_TEST_HOOKS,
    PREPARE_STEPS,
    STALL_ENV,
    STALL_SECONDS_ENV,
    STOP_ENV,
    UNPREPARE_STEPS,
    Step,
    TestHooks,
    from_environment,
)
from driver.node.server import PluginProcess
from driver.node.settings import PluginSettings, plugin_settings
from testbed.fakes import InMemoryKubeApi, allocated_claim, result
from tests.support import ROOT


class RecordingHooks(TestHooks):
    def __init__(self) -> None:
        self.steps: list[Step] = []

    def reached(self, step: Step) -> None:
        self.steps.append(step)


def settings(tmp_path: Path) -> PluginSettings:
    paths = [f"--{name}-dir={tmp_path / name}" for name in ("plugin", "cdi", "registrar")]
    argv = ["kubelet-plugin", "--node-name=node-a", "--nvml=mock:dgx-h100", *paths]
    return plugin_settings(build_parser().parse_args(argv))


def test_the_steps_keep_the_values_the_tests_set_the_variables_to():
    assert [step.value for step in PREPARE_STEPS] == [
        "prepare:journaled",
        "prepare:partition-made",
        "prepare:mps-shm-mounted",
        "prepare:device-ready",
        "prepare:cdi-written",
        "prepare:completed",
    ]
    assert [step.value for step in UNPREPARE_STEPS] == [
        "unprepare:journaled",
        "unprepare:mps-daemon-stopped",
        "unprepare:devices-released",
        "unprepare:cdi-removed",
    ]


def test_without_the_variables_the_plugin_gets_the_no_op_which_reads_nothing_at_a_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    for name in HOOK_ENVS:
        monkeypatch.delenv(name, raising=False)
    hooks = settings(tmp_path).test_hooks
    assert hooks is NO_TEST_HOOKS
    with monkeypatch.context() as later:
        # Set after the start: a hook that still read the environment would act on it, or fail here.
        later.setattr(os, "environ", {})
        later.setattr(os, "kill", lambda *args: pytest.fail(f"os.kill{args}"))
        for step in Step:
            hooks.reached(step)
        hooks.stop_before("ledger", ["default/c"])
    assert hooks.clock_offset_s == 0.0


def test_the_environment_names_where_the_plugin_is_killed_or_held(monkeypatch: pytest.MonkeyPatch):
    acted: list[tuple[str, object]] = []
    monkeypatch.setattr(testhooks.os, "kill", lambda pid, sig: acted.append(("kill", sig)))
    monkeypatch.setattr(testhooks.time, "sleep", lambda seconds: acted.append(("sleep", seconds)))
    hooks = from_environment(
        {CRASH_ENV: "prepare:cdi-written", STALL_ENV: "unprepare:journaled", STALL_SECONDS_ENV: "3"}
    )
    for step in Step:
        hooks.reached(step)
    assert acted == [("kill", signal.SIGKILL), ("sleep", 3.0)]


def test_the_controller_hooks_shift_the_clock_and_stop_once(monkeypatch: pytest.MonkeyPatch):
    stops: list[int] = []
    monkeypatch.setattr(testhooks.signal, "pthread_kill", lambda thread, sig: stops.append(sig))
    hooks = from_environment({CLOCK_OFFSET_ENV: "-30", STOP_ENV: "status:default/c"})
    assert hooks.clock_offset_s == -30.0
    hooks.stop_before("ledger", ["default/c"])
    hooks.stop_before("status", ["default/b", "default/c"])
    hooks.stop_before("status", ["default/c"])
    assert stops == [signal.SIGSTOP]


def test_the_plugin_hands_its_hooks_to_the_preparer_and_the_mps_partitioner(tmp_path: Path):
    hooks = RecordingHooks()
    api = InMemoryKubeApi()
    process = PluginProcess(replace(settings(tmp_path), test_hooks=hooks), api=api)
    try:
        api.claims[("default", "ts")] = allocated_claim("default", "ts", "uid-ts", [result("gpu-4-ts")])
        ref = ClaimRef("default", "ts", "uid-ts")
        assert process.preparer.prepare([ref])[ref.uid].error == ""
        assert process.preparer.unprepare([ref]) == {ref.uid: ""}
        # No daemon runs there: stopping it reaches its step all the same (a start mounts a tmpfs: root).
        process.preparer.partition_use.partitioners.mps.stop(0, process.gpus[0].uuid)
    finally:
        process.stop()
    assert hooks.steps == [
        Step.PREPARE_JOURNALED,
        Step.DEVICE_READY,
        Step.CDI_WRITTEN,
        Step.PREPARE_COMPLETED,
        Step.UNPREPARE_JOURNALED,
        Step.DEVICES_RELEASED,
        Step.CDI_REMOVED,
        Step.MPS_DAEMON_STOPPED,
    ]


@pytest.mark.parametrize("module", sorted((ROOT / "partitioner").glob("*.py")), ids=lambda path: path.name)
def test_partitioner_imports_nothing_of_the_test_hooks(module: Path):
    imported = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
            imported.update(f"{node.module}.{alias.name}" for alias in node.names)
    assert not {name for name in imported if name.startswith(testhooks.__name__)}
