"""`fgpu plan`'s flags, and the plan (driver/cli/plan.py) run from them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from driver.allocator.policies import DEFAULT_POLICY, POLICIES
from driver.common.flags import SettingsError, Subcommands
from driver.kube.errors import KubeError


def add_plan_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifests", type=Path, nargs="*", help="files, folders, or - for stdin")
    parser.add_argument("--slices", type=Path, nargs="+", default=[], help="ResourceSlices (fgpu discover's)")
    parser.add_argument("--classes", type=Path, nargs="+", default=[], help="DeviceClasses")
    parser.add_argument(
        "--claims", type=Path, nargs="+", default=[], help="more manifests (allocated claims count as taken)"
    )
    parser.add_argument(
        "--kubeconfig", help="also plan against this cluster's slices, classes, nodes and claims (only reads)"
    )
    parser.add_argument("--policy", choices=list(POLICIES), default=DEFAULT_POLICY)
    parser.add_argument("-o", "--output", choices=["text", "json"], default="text")


def cmd_plan(args: argparse.Namespace) -> int:
    paths = (*args.manifests, *args.slices, *args.classes, *args.claims)
    if not paths and not args.kubeconfig:
        raise SettingsError("plan: give manifests (files, folders, - for stdin) or --kubeconfig")
    # Here, not at the top: the allocator and CEL would weigh on every `fgpu` command (the plugin's).
    from driver.allocator.model import ObjectError
    from driver.cli.plan import PlanInput, plan

    request = PlanInput(tuple(paths), args.kubeconfig, args.policy)
    try:
        return plan(request, sys.stdin, sys.stdout, args.output == "json")
    except (ObjectError, KubeError) as err:
        print(f"fgpu plan: {err}", file=sys.stderr)
        return 2


def register(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "plan",
        help="dry run: plan the claims of manifests (claims, templates, pods, workloads), explain failures",
        description="Every file is read for every kind: ResourceClaims, ResourceClaimTemplates and the Pods, "
        "Deployments, ReplicaSets, StatefulSets, Jobs, CronJobs (and, with Nodes, DaemonSets) that use them, "
        "DeviceClasses, ResourceSlices, Nodes. Exit 1 when a claim cannot be allocated, 2 on bad input.",
    )
    add_plan_flags(parser)
    parser.set_defaults(func=cmd_plan)
