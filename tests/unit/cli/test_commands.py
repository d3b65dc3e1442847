"""The `fgpu` command's layout: every subcommand registered by its own module, `fgpu mock ...`, and
the mock commands' earlier spellings, as users run them."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from driver.cli.main import build_parser

COMMANDS = {
    "discover": "driver.node.commands",
    "kubelet-plugin": "driver.node.commands",
    "health": "driver.node.commands",
    "controller": "driver.controller.commands",
    "webhook": "driver.admission.commands",
    "plan": "driver.cli.plan_command",
    "status": "driver.cli.status_command",
    "rightsize": "driver.cli.rightsize_command",
    "mock": "driver.nvml.commands",
    "slice-template": "driver.cli.slice_template_command",
    "simulate-fleet": "driver.fleet.commands",
}
MOCK_COMMANDS = ("fault", "driver", "usage")
OLD_MOCK_NAMES = tuple(f"mock-{name}" for name in MOCK_COMMANDS)


def fgpu(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "driver.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_build_parser_registers_each_command_from_its_own_module():
    commands = subcommands(build_parser())
    assert sorted(commands) == sorted([*COMMANDS, *OLD_MOCK_NAMES])
    for name, module in COMMANDS.items():
        parser = commands[name]
        leaves = subcommands(parser).values() if name in ("health", "mock") else [parser]
        assert {leaf.get_default("func").__module__ for leaf in leaves} == {module}, name
    assert sorted(subcommands(commands["mock"])) == sorted(MOCK_COMMANDS)


def test_every_command_parses_as_before():
    parse = build_parser().parse_args
    assert parse(["discover", "--node-name=n1", "-o", "json"]).output == "json"
    assert parse(["controller", "--make-room"]).evictions_per_minute == 10
    assert parse(["webhook", "--tls-secret=s"]).port == 8443
    assert parse(["plan", "a.yaml", "--policy=spread"]).manifests == [Path("a.yaml")]
    assert parse(["status", "--idle=30m"]).idle == 1800
    assert parse(["health", "clear", "--gpu=GPU-1"]).gpu == ["GPU-1"]
    assert parse(["mock", "usage", "--gpu=2", "--pid=7", "--end"]).end
    assert parse(["mock-driver", "unload"]).action == "unload"


@pytest.mark.parametrize("name", MOCK_COMMANDS)
def test_mock_commands_help(name: str):
    run = fgpu("mock", name, "--help")
    assert run.returncode == 0 and not run.stderr, run.stderr
    assert run.stdout.startswith(f"usage: fgpu mock {name} [-h] [--nvml NVML]")


def test_the_old_mock_names_are_left_out_of_help_and_still_work_with_a_note(tmp_path: Path):
    listing = fgpu("--help").stdout.split("positional arguments:")[1].split("options:")[0]
    listed = [line.split()[0] for line in listing.splitlines() if line.startswith("    ") and line[4] != " "]
    commands = ["discover", "kubelet-plugin", "health", "controller", "webhook", "plan", "status", "rightsize"]
    assert listed == [*commands, "mock", "simulate-fleet", "slice-template"]
    env = {"PATH": "/usr/bin:/bin", "FGPU_NVML_MOCK_STATE": str(tmp_path / "gpus.json")}
    run = fgpu("mock-usage", "--nvml=mock:l4x4", "--gpu=1", "--utilization=40", env=env)
    assert (run.returncode, run.stderr) == (0, "fgpu: mock-usage is deprecated: use fgpu mock usage\n")
    run = fgpu("mock-fault", "--nvml=mock:l4x4", "--gpu=9", "ecc", env=env)
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        "fgpu: mock-fault is deprecated: use fgpu mock fault",
        "fgpu: mock fault on GPU 9: Invalid Argument",
    ]
