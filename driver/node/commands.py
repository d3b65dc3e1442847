"""The node's commands: `fgpu discover` (the ResourceSlices this node would publish),
`fgpu kubelet-plugin` (the node plugin) and `fgpu health clear` (forget GPU faults). Their flags
and the plugin's settings are in driver/node/settings.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from driver.common.flags import SettingsError, Subcommands, env_default
from driver.common.yamlfile import document_text
from driver.inventory.discovery import discover_gpus
from driver.inventory.offers import check_offers, node_inventory, shortfall
from driver.inventory.slices import build_slices
from driver.node.health.record import HealthRecord
from driver.node.settings import add_node_flags, add_plugin_flags, plugin_settings, sharing_config, validate_names
from driver.nvml.session import NvmlSession


def cmd_discover(args: argparse.Namespace) -> int:
    validate_names(args)
    sharing = sharing_config(args)
    session = NvmlSession.open(args.nvml)
    try:
        gpus = discover_gpus(session)
        check_offers(gpus, sharing)
    finally:
        session.close()
    for reason in filter(None, (shortfall(gpu, sharing) for gpu in gpus)):
        print(reason, file=sys.stderr)  # stdout stays the List of slices
    inventory = node_inventory(gpus, sharing)
    document = {
        "apiVersion": "v1",
        "kind": "List",
        "items": build_slices(args.driver_name, args.node_name, inventory, generation=1, owner=None),
    }
    print(document_text(document, args.output == "json"), end="")
    return 0


def cmd_kubelet_plugin(args: argparse.Namespace) -> int:
    from driver.node.server import run_plugin  # grpc is only needed here

    run_plugin(plugin_settings(args))
    return 0


def cmd_health_clear(args: argparse.Namespace) -> int:
    if not args.state_dir:
        raise SettingsError("--state-dir (or STATE_DIR) is required: the plugin's state directory")
    if not Path(args.state_dir).is_dir():  # clearing would make it: a mistyped path would seem to work
        raise SettingsError(f"--state-dir {args.state_dir!r} is not a directory; give the plugin's state directory")
    left = HealthRecord(Path(args.state_dir)).clear(set(args.gpu) if args.gpu else None)
    print(f"cleared; {len(left)} fault(s) of other GPUs left" if args.gpu else "cleared all faults")
    return 0


def register(commands: Subcommands) -> None:
    discover = commands.add_parser("discover", help="print the ResourceSlices this node would publish")
    add_node_flags(discover)
    discover.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml")
    discover.set_defaults(func=cmd_discover)

    plugin = commands.add_parser("kubelet-plugin", help="run the node plugin")
    add_plugin_flags(plugin)
    plugin.set_defaults(func=cmd_kubelet_plugin)

    health = commands.add_parser("health", help="the node's GPU faults (run where the plugin's state dir is)")
    health_commands = health.add_subparsers(dest="health_command", required=True)
    clear = health_commands.add_parser("clear", help="forget GPU faults now: their taints go within a second")
    clear.add_argument("--state-dir", default=env_default(None, "STATE_DIR"), help="the plugin's state dir [STATE_DIR]")
    clear.add_argument("--gpu", action="append", help="a GPU UUID (repeat; default: every GPU)")
    clear.set_defaults(func=cmd_health_clear)
