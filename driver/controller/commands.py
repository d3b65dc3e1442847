"""`fgpu controller`: the command, its flags (settings.py) and the controller built and run from them."""

from __future__ import annotations

import argparse
import signal

from driver.common.flags import Subcommands
from driver.controller.settings import ControllerSettings, add_controller_flags, controller_settings


def run_controller(settings: ControllerSettings) -> None:
    """Allocate until SIGTERM or SIGINT."""
    # The controller's code is loaded only to run it: every `fgpu` command imports this module for its flags.
    from prometheus_client import start_http_server

    from driver.common.testhooks import from_environment
    from driver.controller.api import ClientControllerApi
    from driver.controller.controller import Controller

    api = ClientControllerApi(settings.kubeconfig)  # a bad client configuration stops it before it serves anything
    if settings.metrics_port > 0:
        start_http_server(settings.metrics_port)
    controller = Controller(api, settings.identity, settings.policy, settings.lease_namespace, settings.timings,
                            settings.evictions_per_minute, settings.compact, from_environment(),
                            settings.preempt_across_namespaces, stall_s=settings.stall_s,
                            place_pods=settings.place_pods, lifetime_hints=settings.lifetime_hints,
                            empty_nodes=settings.empty_nodes)  # fmt: skip
    if settings.health_port > 0:
        from driver.controller.progress import serve_health

        serve_health(settings.health_port, controller.progress)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: controller.stop())
    controller.run()


def cmd_controller(args: argparse.Namespace) -> int:
    run_controller(controller_settings(args))
    return 0


def register(commands: Subcommands) -> None:
    parser = commands.add_parser("controller", help="allocate the claims labelled gpu.fgpu.dev/allocator=fgpu")
    add_controller_flags(parser)
    parser.set_defaults(func=cmd_controller)
