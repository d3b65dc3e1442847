"""`fgpu status`'s flags, and what it reads for them: the cluster's slices and claims (rendered by
driver/cli/status.py, which stays pure), or with --idle / --by the node plugins' metrics
(driver/cli/usage_report.py)."""

from __future__ import annotations

import argparse
import sys

from driver.admission.lifetimes import duration
from driver.common.flags import DEFAULT_DRIVER_NAME, SettingsError, Subcommands, env_default

# status.py's RENDERERS, named here: status.py imports the allocator and CEL, which every `fgpu`
# command (the node plugin's) would hold if this module, which the parser imports, did.
OUTPUTS = ("table", "json", "yaml")


def add_status_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kubeconfig", default=env_default(None, "KUBECONFIG"), help="client configuration [KUBECONFIG]"
    )
    parser.add_argument("--node", action="append", help="only these nodes (repeatable, or a comma list)")
    parser.add_argument("-o", "--output", choices=OUTPUTS, default="table")
    parser.add_argument(
        "--idle", type=duration, metavar="DURATION", help="claims held but unused this long or longer (e.g. 30m)"
    )
    parser.add_argument("--by", choices=["namespace"], help="GPU-hours by namespace since each plugin started")
    parser.add_argument(
        "--metrics",
        action="append",
        help="with --idle/--by: a node plugin's metrics URL, http://<node>:<port>/metrics (repeatable or comma list)",
    )


def cmd_status(args: argparse.Namespace) -> int:
    if args.idle is not None or args.by:
        return _usage_status(args)
    from driver.cli.status import RENDERERS, cluster_status
    from driver.kube.client import ClientKubeApi
    from driver.kube.errors import KubeError

    nodes = {name.strip() for value in args.node or () for name in value.split(",") if name.strip()}
    api = ClientKubeApi(args.kubeconfig)
    try:
        slices, claims = api.list_driver_slices(DEFAULT_DRIVER_NAME), api.list_all_claims()
    except KubeError as err:
        print(f"fgpu status: {err}", file=sys.stderr)
        return 2
    finally:
        api.close()
    sys.stdout.write(RENDERERS[args.output](cluster_status(slices, claims, DEFAULT_DRIVER_NAME, nodes)))
    return 0


def _usage_status(args: argparse.Namespace) -> int:
    """`fgpu status --idle` / `--by namespace`: from the node plugins' metrics."""
    from driver.cli.usage_report import (
        MetricsReadError,
        idle_claims,
        read_metrics,
        render_by_namespace,
        render_idle,
        usage_by_namespace,
    )

    urls = [url.strip() for value in args.metrics or () for url in value.split(",") if url.strip()]
    if not urls:
        raise SettingsError(
            "--idle and --by read the node plugins' metrics: give --metrics http://<node>:<port>/metrics"
        )
    try:
        texts = [read_metrics(url) for url in urls]
    except MetricsReadError as err:
        print(f"fgpu status: {err}", file=sys.stderr)
        return 2
    if args.idle is not None:
        sys.stdout.write(render_idle(idle_claims(texts, args.idle), args.output))
    if args.by:
        sys.stdout.write(render_by_namespace(usage_by_namespace(texts), args.output))
    return 0


def register(commands: Subcommands) -> None:
    parser = commands.add_parser("status", help="per node and GPU: what claims hold, what is free, taints")
    add_status_flags(parser)
    parser.set_defaults(func=cmd_status)
