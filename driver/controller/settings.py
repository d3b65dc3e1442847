"""`fgpu controller`: its flags and environment variables -> one typed, checked ControllerSettings;
the command that builds and runs the controller from them is commands.py. What every command
shares (flag parsing, environment defaults, value types) is in driver/common/flags.py."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass

from driver.allocator.policies import DEFAULT_POLICY, POLICIES, Policy
from driver.common.flags import SettingsError, env_default, port, positive, seconds
from driver.controller.leader import LeaseTimings

# client-go's defaults and kube-controller-manager's flag names, in seconds.
LEADER_ELECTION_FLAGS = (
    ("--leader-elect-lease-duration", "LEASE_DURATION", "15", "seconds a standby waits on an unchanged Lease"),
    ("--leader-elect-renew-deadline", "RENEW_DEADLINE", "10", "seconds the leader acts after its last renewal began"),
    ("--leader-elect-retry-period", "RETRY_PERIOD", "2", "seconds between renewals and a standby's looks"),
)


@dataclass(frozen=True)
class ControllerSettings:
    kubeconfig: str | None
    identity: str  # this replica's name in the Lease
    policy: Policy
    lease_namespace: str
    timings: LeaseTimings
    evictions_per_minute: int  # making room's budget; 0: it is off
    compact: bool  # also move pods while nothing waits
    metrics_port: int  # Prometheus metrics; 0 or -1: off
    health_port: int  # GET /healthz, the liveness probe; 0 or -1: off
    stall_s: float  # no progress this long: stalled (the probe fails, the Lease is left to expire)
    preempt_across_namespaces: bool  # making room may preempt lower-priority pods of any namespace
    place_pods: bool = False  # also place the pods without claims of the namespaces that opt in
    lifetime_hints: bool = True  # shares placed by when their claims say they end (docs/allocator.md)
    empty_nodes: bool = False  # compaction empties whole nodes first, for the autoscaler to remove


def add_controller_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kubeconfig", default=env_default(None, "KUBECONFIG"), help="client configuration [KUBECONFIG]"
    )
    parser.add_argument("--policy", choices=list(POLICIES), default=DEFAULT_POLICY, help="placement scoring")
    parser.add_argument("--lease-namespace", default="kube-system", help="where the leader election Lease lives")
    parser.add_argument("--identity", default="", help="this replica's name in the Lease (default: host-pid)")
    parser.add_argument("--metrics-port", type=port, default=0, help="serve Prometheus metrics here (0 or -1: off)")
    parser.add_argument(
        "--health-port", type=port, default=0, help="serve GET /healthz (the liveness probe) here (0 or -1: off)"
    )
    parser.add_argument(
        "--stalled-after",
        type=seconds,
        default=120.0,
        help="seconds without progress after which /healthz fails and the leader gives up its Lease",
    )
    for flag, env, default, what in LEADER_ELECTION_FLAGS:
        parser.add_argument(flag, type=seconds, default=env_default(default, env), help=f"{what} [{env}]")
    parser.add_argument(
        "--make-room",
        action="store_true",
        help="evict movable pods (gpu.fgpu.dev/movable) and lower-priority ones to place a claim that fits nowhere",
    )
    parser.add_argument(
        "--evictions-per-minute", type=positive, default=10, help="making room evicts at most this many pods a minute"
    )
    parser.add_argument(
        "--compact-when-idle",
        action="store_true",
        help="with --make-room: while nothing waits, move movable pods so that lightly used GPUs empty",
    )
    parser.add_argument(
        "--empty-nodes",
        action="store_true",
        help="with --compact-when-idle: first empty whole nodes of movable pods, for the autoscaler to remove",
    )
    parser.add_argument(
        "--preempt-across-namespaces",
        action="store_true",
        help="with --make-room: preempt lower-priority pods of any namespace, not only the pending claim's",
    )

    parser.add_argument(
        "--place-pods",
        action="store_true",
        help="also place the gated pods without claims of namespaces labelled gpu.fgpu.dev/place-pods=fgpu",
    )
    parser.add_argument(
        "--no-lifetime-hints",
        dest="lifetime_hints",
        action="store_false",
        help="do not read gpu.fgpu.dev/expected-duration: place shares without regard to when they end",
    )


def controller_settings(args: argparse.Namespace) -> ControllerSettings:
    try:
        timings = LeaseTimings(args.leader_elect_lease_duration, args.leader_elect_renew_deadline,
                               args.leader_elect_retry_period)  # fmt: skip
    except ValueError as err:
        raise SettingsError(f"--leader-elect-*: {err}") from err
    if args.compact_when_idle and not args.make_room:
        raise SettingsError("--compact-when-idle moves pods as making room does: give --make-room too")
    if args.empty_nodes and not args.compact_when_idle:
        raise SettingsError("--empty-nodes is a way of compacting: give --compact-when-idle too")
    if args.preempt_across_namespaces and not args.make_room:
        raise SettingsError("--preempt-across-namespaces widens making room: give --make-room too")
    return ControllerSettings(
        kubeconfig=args.kubeconfig,
        identity=args.identity or f"{socket.gethostname()}-{os.getpid()}",
        policy=args.policy,
        lease_namespace=args.lease_namespace,
        timings=timings,
        evictions_per_minute=args.evictions_per_minute if args.make_room else 0,
        compact=args.compact_when_idle,
        metrics_port=args.metrics_port,
        health_port=args.health_port,
        stall_s=args.stalled_after,
        preempt_across_namespaces=args.preempt_across_namespaces,
        place_pods=args.place_pods,
        lifetime_hints=args.lifetime_hints,
        empty_nodes=args.empty_nodes,
    )
