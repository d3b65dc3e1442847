"""`fgpu rightsize`'s flags, and the recommendations (driver/sizing/) read from usage histories and
rendered by driver/cli/rightsize.py."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from driver.common.flags import Subcommands, env_default

if TYPE_CHECKING:
    from driver.sizing.history import UsageHistory

OUTPUTS = ("table", "json", "patch")


DEFAULT_NAMESPACE = "fgpu-system"  # the chart's, docs/install.md


def add_rightsize_flags(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--history", type=Path, nargs="+", help="usage history files (merged), UsageHistory JSON")
    source.add_argument(
        "--kubeconfig",
        default=env_default(None, "KUBECONFIG"),
        help="read the node plugins' histories from the cluster (every fgpu-usage-<node> ConfigMap, merged); "
        "the default without --history [KUBECONFIG]",
    )
    parser.add_argument(
        "--namespace",
        default=env_default(DEFAULT_NAMESPACE, "FGPU_NAMESPACE"),
        help="where the plugins keep their ConfigMaps: the driver's namespace [FGPU_NAMESPACE]",
    )
    parser.add_argument("--now", type=float, help="recommend as of this unix time (default: now)")
    parser.add_argument("-o", "--output", choices=OUTPUTS, default="table", help="patch: JSON Patches per template")


def cmd_rightsize(args: argparse.Namespace) -> int:
    # Here, not at the top: the sizing code would weigh on every `fgpu` command (the plugin's).
    from driver.cli.rightsize import RENDERERS
    from driver.kube.errors import KubeError
    from driver.sizing.history import HistoryError
    from driver.sizing.recommend import recommend
    from driver.sizing.sizes import UnknownGpuError

    try:
        history = _from_files(args.history) if args.history else _from_cluster(args.kubeconfig, args.namespace)
        recommendations = recommend(history, time.time() if args.now is None else args.now)
    except (OSError, HistoryError, UnknownGpuError, KubeError) as err:
        print(f"fgpu rightsize: {err}", file=sys.stderr)
        return 2
    sys.stdout.write(RENDERERS[args.output](recommendations))
    return 0


def _from_files(paths: list[Path]) -> UsageHistory:
    from driver.sizing.history import from_json, merge

    history = from_json(paths[0].read_text())
    for path in paths[1:]:
        history = merge(history, from_json(path.read_text()))
    return history


def _from_cluster(kubeconfig: str | None, namespace: str) -> UsageHistory:
    """Every node plugin's ConfigMap in the namespace, merged (driver/sizing/store.py)."""
    from driver.kube.client import ClientKubeApi
    from driver.sizing import store

    api = ClientKubeApi(kubeconfig)
    try:
        return store.merged(api.list_configmaps(namespace, f"{store.COMPONENT_LABEL}={store.COMPONENT}"))
    finally:
        api.close()


def register(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "rightsize",
        help="recommend claim sizes from what workloads really use (docs/rightsizing.md)",
        description="Reads usage histories (the node plugins' UsageHistory: their ConfigMaps in the cluster, or "
        "files), recommends per workload "
        "(namespace, owner, claim template, request) the smallest size that holds the observed peak memory "
        "plus a margin and the p95 compute, and prints them, or JSON Patches to the templates. Changes nothing.",
    )
    add_rightsize_flags(parser)
    parser.set_defaults(func=cmd_rightsize)
