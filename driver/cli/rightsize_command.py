"""`fgpu rightsize`'s flags, and the recommendations (driver/sizing/) read from usage histories and
rendered by driver/cli/rightsize.py."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from driver.common.flags import Subcommands

OUTPUTS = ("table", "json", "patch")


def add_rightsize_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--history", type=Path, nargs="+", required=True, help="usage history files (merged), UsageHistory JSON"
    )
    parser.add_argument("--now", type=float, help="recommend as of this unix time (default: now)")
    parser.add_argument("-o", "--output", choices=OUTPUTS, default="table", help="patch: JSON Patches per template")


def cmd_rightsize(args: argparse.Namespace) -> int:
    # Here, not at the top: the sizing code would weigh on every `fgpu` command (the plugin's).
    from driver.cli.rightsize import RENDERERS
    from driver.sizing.history import HistoryError, UsageHistory, from_json, merge
    from driver.sizing.recommend import recommend
    from driver.sizing.sizes import UnknownGpuError

    try:
        history = UsageHistory()
        for index, path in enumerate(args.history):
            one = from_json(path.read_text())
            history = one if index == 0 else merge(history, one)
        recommendations = recommend(history, time.time() if args.now is None else args.now)
    except (OSError, HistoryError, UnknownGpuError) as err:
        print(f"fgpu rightsize: {err}", file=sys.stderr)
        return 2
    sys.stdout.write(RENDERERS[args.output](recommendations))
    return 0


def register(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "rightsize",
        help="recommend claim sizes from what workloads really use (docs/rightsizing.md)",
        description="Reads usage histories (the node plugins' UsageHistory JSON), recommends per workload "
        "(namespace, owner, claim template, request) the smallest size that holds the observed peak memory "
        "plus a margin and the p95 compute, and prints them, or JSON Patches to the templates. Changes nothing.",
    )
    add_rightsize_flags(parser)
    parser.set_defaults(func=cmd_rightsize)
