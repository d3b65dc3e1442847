"""`fgpu mock fault|driver|usage`: change what the mock GPUs' NVML reports while the plugin runs (a
failing GPU, the driver unloaded, a process's usage), for tests and demos. Each writes the mock's
state file (FGPU_NVML_MOCK_STATE), which the running plugin reads as it would ask a real GPU.

The spellings before `fgpu mock ...` (`mock-fault`, `mock-driver`, `mock-usage`) still work, left
out of `--help`, with a note on stderr: docs and scripts of earlier releases use them."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from driver.common.flags import SettingsError, Subcommands, above_zero, env_default
from driver.nvml.mock import MockNvml, MockProcess
from driver.nvml.mock_driver_root import SMI_STATE_ENV, fake_tools_env, forget_timeslices
from driver.nvml.session import MOCK_STATE_ENV, is_mock, open_backend
from driver.nvml.usage_profiles import SHAPES, WORKLOAD_PROFILES, UsageProfile


@dataclass(frozen=True)
class MockCommand:
    name: str  # fgpu mock <name>
    help: str
    add_flags: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _require_mock(nvml: str, command: str) -> None:
    """The mock GPUs the plugin runs on: its state file, so that the plugin sees the change."""
    if not is_mock(nvml) or not os.environ.get(MOCK_STATE_ENV):
        raise SettingsError(f"{command} needs --nvml mock:<machine> and {MOCK_STATE_ENV} (the plugin's mock state)")


def _fake_smi_state(state_dir: str | None, command: str) -> Path:
    """Where the fake nvidia-smi keeps its settings: as the plugin's tools see it."""
    if os.environ.get(SMI_STATE_ENV):
        return Path(os.environ[SMI_STATE_ENV])
    if not state_dir:
        raise SettingsError(f"{command} needs --state-dir (or STATE_DIR): the plugin's, or {SMI_STATE_ENV}")
    return Path(fake_tools_env(Path(state_dir))[SMI_STATE_ENV])


def _add_nvml_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nvml", default=env_default("", "NVML"), help="mock:<machine> [NVML]")


def add_fault_flags(parser: argparse.ArgumentParser) -> None:
    _add_nvml_flag(parser)
    parser.add_argument("--gpu", type=int, required=True, help="GPU index")
    parser.add_argument(
        "fault",
        choices=["xid", "ecc", "lost", "recover", "reset"],
        help="reset: what nvidia-smi -r does (MIG instances, compute mode, time-slice interval gone)",
    )
    parser.add_argument(
        "--state-dir", default=env_default(None, "STATE_DIR"), help="the plugin's state dir (reset) [STATE_DIR]"
    )
    parser.add_argument("--xid", type=int, default=79, help="the XID number (fault xid)")
    parser.add_argument("--gi", type=int, help="GPU instance id the XID is attributed to (with --ci)")
    parser.add_argument("--ci", type=int, default=0, help="compute instance id (with --gi)")


def cmd_mock_fault(args: argparse.Namespace) -> int:
    _require_mock(args.nvml, "mock fault")
    mock: MockNvml = open_backend(args.nvml)
    mock.nvmlInit()
    try:
        if args.fault == "xid":
            mock.inject_xid(args.gpu, args.xid, *([args.gi, args.ci] if args.gi is not None else []))
        elif args.fault == "ecc":
            mock.inject_double_bit_ecc(args.gpu)
        elif args.fault == "reset":
            mock.reset_gpu(args.gpu)
            forget_timeslices(_fake_smi_state(args.state_dir, "mock fault reset"), {mock.gpu_uuid(args.gpu)})
        else:
            mock.set_gpu_lost(args.gpu, args.fault == "lost")
    except mock.NVMLError as err:
        raise SettingsError(f"mock fault on GPU {args.gpu}: {err}") from err
    return 0


def add_driver_flags(parser: argparse.ArgumentParser) -> None:
    _add_nvml_flag(parser)
    parser.add_argument("action", choices=["unload", "load"])
    parser.add_argument("--version", default="", help="the driver version loaded (an upgrade; load)")
    parser.add_argument(
        "--state-dir", default=env_default(None, "STATE_DIR"), help="the plugin's state dir (unload) [STATE_DIR]"
    )


def cmd_mock_driver(args: argparse.Namespace) -> int:
    """Unload or load the mock GPUs' driver (docs/operations.md); an unload takes the time-slice
    intervals with it, as it does every GPU's volatile state."""
    _require_mock(args.nvml, "mock driver")
    mock: MockNvml = open_backend(args.nvml)
    try:
        if args.action == "unload":
            mock.unload_driver()
            forget_timeslices(_fake_smi_state(args.state_dir, "mock driver unload"))
        else:
            mock.load_driver(args.version)
    except mock.NVMLError as err:
        raise SettingsError(f"mock driver {args.action}: {err}") from err
    return 0


def _whole(value: str) -> int:
    """A whole number 0 or more, else -1."""
    try:
        return max(-1, int(value))
    except ValueError:
        return -1


def _mib(value: str) -> int:
    """MiB (or MiB a day)."""
    number = _whole(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of MiB (0 or more)")
    return number


def _percent(value: str) -> int:
    number = _whole(value)
    if not 0 <= number <= 100:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole percent (0-100)")
    return number


def _workload(value: str) -> UsageProfile:
    if value not in WORKLOAD_PROFILES:
        known = ", ".join(WORKLOAD_PROFILES)
        raise argparse.ArgumentTypeError(f"{value!r} is not a bundled example workload (one of {known})")
    return WORKLOAD_PROFILES[value]


def add_usage_flags(parser: argparse.ArgumentParser) -> None:
    _add_nvml_flag(parser)
    parser.add_argument("--gpu", type=int, required=True, help="GPU index")
    parser.add_argument("--utilization", type=int, help="the GPU's utilisation in percent (-1: simulated again)")
    parser.add_argument("--pid", type=int, help="a compute process on the GPU (or with --gi/--ci its MIG device)")
    parser.add_argument("--sm", type=_percent, help="the process's SM utilisation in percent (0; --shape's level)")
    parser.add_argument("--memory", type=_mib, help="the process's GPU memory in MiB (0; --shape's level)")
    parser.add_argument("--gi", type=int, help="the GPU instance id of its MIG device (with --ci)")
    parser.add_argument("--ci", type=int, default=0, help="the compute instance id (with --gi)")
    parser.add_argument("--end", action="store_true", help="the process --pid ends")
    parser.add_argument(
        "--shape", choices=SHAPES, help="its use moves over time from --memory and --sm (docs/rightsizing.md)"
    )
    parser.add_argument("--burst-memory", type=_mib, help="bursty: its memory in MiB for 10 minutes every 6 hours")
    parser.add_argument("--burst-sm", type=_percent, help="bursty: its SM utilisation in percent in a burst")
    parser.add_argument("--growth", type=_mib, help="growing: the memory in MiB it adds a day")
    parser.add_argument(
        "--workload", type=_workload, metavar="KIND/NAME", help="its use moves as a bundled example's (Job/trainer)"
    )
    parser.add_argument("--time-scale", type=above_zero, help="profile seconds a second (86400: a day a second; 1)")


# Flags by their argparse dest: what a --shape profile is made of (--workload has its own), and
# what only a profile uses.
_SHAPE_FLAGS = {"shape": "--shape", "memory": "--memory", "sm": "--sm"}
_PROFILE_ONLY_FLAGS = {"burst_memory": "--burst-memory", "burst_sm": "--burst-sm", "growth": "--growth"}


def _given(args: argparse.Namespace, flags: dict[str, str]) -> list[str]:
    return [flag for dest, flag in flags.items() if getattr(args, dest) is not None]


def _profile(args: argparse.Namespace) -> UsageProfile | None:
    """The process's usage profile: an example workload's, one of --shape, or None (a fixed use)."""
    if args.workload is not None:
        if given := _given(args, _SHAPE_FLAGS | _PROFILE_ONLY_FLAGS):
            raise SettingsError(f"mock usage: --workload has its own use profile: leave out {', '.join(given)}")
        return args.workload
    if args.shape is not None:
        return UsageProfile(
            args.shape, args.memory or 0, args.sm or 0, args.burst_memory or 0, args.burst_sm or 0, args.growth or 0
        )
    if given := _given(args, _PROFILE_ONLY_FLAGS | {"time_scale": "--time-scale"}):
        raise SettingsError(f"mock usage: {given[0]} needs --shape or --workload")
    return None


def cmd_mock_usage(args: argparse.Namespace) -> int:
    _require_mock(args.nvml, "mock usage")
    if (args.utilization is None) == (args.pid is None):
        raise SettingsError(
            "mock usage: give --utilization, or --pid (with --sm, --memory, --shape or --workload, --gi/--ci, or --end)"
        )
    profile = _profile(args)
    mock: MockNvml = open_backend(args.nvml)
    mock.nvmlInit()
    try:
        if args.utilization is not None:
            mock.set_utilization(args.gpu, None if args.utilization < 0 else args.utilization)
        elif args.end:
            mock.end_process(args.gpu, args.pid)
        else:
            fixed = (args.sm or 0, args.memory or 0)
            process = MockProcess(args.pid, *fixed, args.gi, args.ci, profile, time_scale=args.time_scale or 1.0)
            mock.set_process(args.gpu, process)
    except mock.NVMLError as err:
        raise SettingsError(f"mock usage on GPU {args.gpu}: {err}") from err
    return 0


MOCK_COMMANDS = (
    MockCommand("fault", "make a mock GPU fail, for tests and demos (docs/health.md)", add_fault_flags, cmd_mock_fault),
    MockCommand(
        "driver",
        "unload or load the mock GPUs' driver, for tests and demos (docs/operations.md)",
        add_driver_flags,
        cmd_mock_driver,
    ),
    MockCommand(
        "usage",
        "set what a mock GPU's NVML reports as used, for tests and demos (docs/kueue.md)",
        add_usage_flags,
        cmd_mock_usage,
    ),
)


def _deprecated(command: MockCommand, args: argparse.Namespace) -> int:
    print(f"fgpu: mock-{command.name} is deprecated: use fgpu mock {command.name}", file=sys.stderr)
    return command.run(args)


def register(commands: Subcommands) -> None:
    mock = commands.add_parser("mock", help="change what the mock GPUs report, for tests and demos")
    kinds = mock.add_subparsers(dest="mock_command", required=True)
    for command in MOCK_COMMANDS:
        parser = kinds.add_parser(command.name, help=command.help)
        command.add_flags(parser)
        parser.set_defaults(func=command.run)
    for command in MOCK_COMMANDS:
        old = commands.add_parser(f"mock-{command.name}")  # no help: not listed in `fgpu --help`
        command.add_flags(old)
        old.set_defaults(func=partial(_deprecated, command))
