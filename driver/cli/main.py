"""The `fgpu` command: its global flags, its subcommands (each module's `register` adds its own, with
its flags), and the one-line error every subcommand's bad input ends in."""

from __future__ import annotations

import argparse
import sys

from driver.admission import commands as webhook
from driver.cli import plan_command, rightsize_command, slice_template_command, status_command
from driver.cli.logs import LOG_FORMATS, configure_logging
from driver.common.flags import FlagParser, SettingsError
from driver.controller import commands as controller
from driver.fleet import commands as fleet
from driver.kube.errors import KubeConfigError
from driver.node import commands as node
from driver.nvml import commands as mock
from driver.nvml.machine import MachineProfileError
from driver.nvml.mock_driver_root import MockDriverRootError
from driver.nvml.session import NvmlUnavailableError

# discover, kubelet-plugin, health; controller; webhook; plan; status; rightsize; mock fault|driver|usage;
# simulate-fleet; slice-template
REGISTERS = (node.register, controller.register, webhook.register, plan_command.register,
             status_command.register, rightsize_command.register, mock.register, fleet.register,
             slice_template_command.register)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="fgpu", description="fractional GPUs through Kubernetes DRA")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--log-format", default="text", choices=LOG_FORMATS, help="text, or json: one object a line")
    commands = parser.add_subparsers(dest="command", required=True)
    for register in REGISTERS:
        register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        return args.func(args)
    except (SettingsError, MachineProfileError, NvmlUnavailableError, KubeConfigError, MockDriverRootError) as err:
        print(f"fgpu: {err}", file=sys.stderr)
        return 2
