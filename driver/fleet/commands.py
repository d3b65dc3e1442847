"""`fgpu simulate-fleet`: publish, for every Node labelled gpu.fgpu.dev/machine=<bundled machine>,
the slices fgpu's plugin on that machine would (kwok's nodes, dry runs, capacity planning)."""

from __future__ import annotations

import argparse
import signal

from driver.common.flags import DEFAULT_DRIVER_NAME, SettingsError, Subcommands, env_default
from driver.fleet.machine_types import MACHINE_LABEL, OFFER_ANNOTATION
from driver.inventory.sharing import SharingConfigError, parse_kinds

DEFAULT_OFFER = "whole,mig,mps,timeslice"  # the node plugin's

MAX_WORKERS = 256


def _workers(value: str) -> int:
    try:
        workers = int(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from err
    if not 1 <= workers <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"{value!r}: between 1 and {MAX_WORKERS}")
    return workers


def cmd_simulate_fleet(args: argparse.Namespace) -> int:
    from driver.fleet.publisher import FleetPublisher
    from driver.kube.client import ClientKubeApi

    try:
        parse_kinds(args.offer, "--offer")
    except SharingConfigError as err:
        raise SettingsError(str(err)) from err
    api = ClientKubeApi(args.kubeconfig, connections=args.workers)
    publisher = FleetPublisher(api, args.driver_name, args.offer, args.workers)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: publisher.stop())
    try:
        publisher.run()
    finally:
        api.close()
    return 0


def register(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "simulate-fleet",
        help=f"publish, for each Node labelled {MACHINE_LABEL}=<machine>, the slices fgpu's plugin there would",
        description=f"Publishes, for each Node labelled {MACHINE_LABEL}=<bundled machine> (kwok's nodes, or any "
        "node without fgpu's plugin), the ResourceSlices fgpu's plugin on that machine would publish, and "
        f"removes them when the node goes. A node's {OFFER_ANNOTATION} annotation overrides --offer.",
    )
    parser.add_argument(
        "--kubeconfig", default=env_default(None, "KUBECONFIG"), help="client configuration [KUBECONFIG]"
    )
    parser.add_argument(
        "--driver-name", default=env_default(DEFAULT_DRIVER_NAME, "DRIVER_NAME"), help="DRA driver name [DRIVER_NAME]"
    )
    parser.add_argument(
        "--offer",
        default=env_default(DEFAULT_OFFER, "OFFER"),
        help="device kinds every GPU offers, for nodes without the annotation [OFFER]",
    )
    parser.add_argument("--workers", type=_workers, default=16, help="concurrent writes to the API server")
    parser.set_defaults(func=cmd_simulate_fleet)
