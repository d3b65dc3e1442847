"""`fgpu webhook`: the command, its flags (settings.py) and the server run from them (server.py)."""

from __future__ import annotations

import argparse

from driver.admission.settings import add_webhook_flags, webhook_settings
from driver.common.flags import SettingsError, Subcommands


def cmd_webhook(args: argparse.Namespace) -> int:
    from driver.admission.server import run_webhook  # the server's code only to run it

    settings = webhook_settings(args)
    try:
        run_webhook(settings)
    except ValueError as err:
        raise SettingsError(str(err)) from err
    except OSError as err:  # the address is taken or cannot be bound
        raise SettingsError(f"--bind-address/--port {args.bind_address}:{args.port}: {err.strerror or err}") from err
    return 0


def register(commands: Subcommands) -> None:
    parser = commands.add_parser("webhook", help="refuse bad gpu.fgpu.dev opaque configs at admission (HTTPS)")
    add_webhook_flags(parser)
    parser.set_defaults(func=cmd_webhook)
