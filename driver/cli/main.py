"""The `fgpu` command: discover, kubelet-plugin, controller, webhook, plan, status, health, mock-fault,
mock-driver, mock-usage."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml

from driver.allocator.scoring import DEFAULT_POLICY, POLICIES
from driver.cli.logs import LOG_FORMATS, configure_logging
from driver.cli.status import RENDERERS, cluster_status
from driver.common.flags import DEFAULT_DRIVER_NAME, FlagParser, SettingsError, env_default, port, positive, seconds
from driver.inventory.discovery import discover_gpus
from driver.inventory.offers import check_offers, node_inventory, shortfall
from driver.inventory.slices import build_slices
from driver.kube.client import ClientKubeApi, KubeConfigError, KubeError
from driver.node.settings import (
    add_node_flags,
    add_plugin_flags,
    plugin_settings,
    sharing_config,
    validate_names,
)
from driver.nvml.machine import MachineProfileError
from driver.nvml.mock_driver_root import MockDriverRootError
from driver.nvml.session import NvmlSession, NvmlUnavailableError


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
    if args.output == "json":
        print(json.dumps(document, indent=2, sort_keys=True))
    else:
        print(yaml.safe_dump(document, sort_keys=True), end="")
    return 0


def cmd_kubelet_plugin(args: argparse.Namespace) -> int:
    from driver.node.server import run_plugin  # grpc is only needed here

    run_plugin(plugin_settings(args))
    return 0


def cmd_controller(args: argparse.Namespace) -> int:
    import signal
    import socket

    from prometheus_client import start_http_server

    from driver.controller.api import ControllerApi
    from driver.controller.controller import Controller
    from driver.controller.leader import LeaseTimings

    identity = args.identity or f"{socket.gethostname()}-{os.getpid()}"
    try:
        timings = LeaseTimings(args.leader_elect_lease_duration, args.leader_elect_renew_deadline,
                               args.leader_elect_retry_period)  # fmt: skip
    except ValueError as err:
        raise SettingsError(f"--leader-elect-*: {err}") from err
    if args.compact_when_idle and not args.make_room:
        raise SettingsError("--compact-when-idle moves pods as making room does: give --make-room too")
    api = ControllerApi(args.kubeconfig)  # a bad client configuration stops it before it serves anything
    if args.metrics_port > 0:
        start_http_server(args.metrics_port)
    evictions = args.evictions_per_minute if args.make_room else 0
    controller = Controller(
        api, identity, args.policy, args.lease_namespace, timings, evictions, args.compact_when_idle
    )
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: controller.stop())
    controller.run()
    return 0


def cmd_webhook(args: argparse.Namespace) -> int:
    from driver.admission.server import run_webhook, webhook_settings

    if args.port < 1:
        raise SettingsError(f"--port {args.port}: the webhook needs a port (1-65535)")
    try:
        run_webhook(webhook_settings(args))
    except ValueError as err:
        raise SettingsError(str(err)) from err
    except OSError as err:  # the address is taken or cannot be bound
        raise SettingsError(f"--bind-address/--port {args.bind_address}:{args.port}: {err.strerror or err}") from err
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from driver.allocator.model import ObjectError
    from driver.cli.plan import PlanInput, plan

    paths = (*args.manifests, *args.slices, *args.classes, *args.claims)
    if not paths and not args.kubeconfig:
        raise SettingsError("plan: give manifests (files, folders, - for stdin) or --kubeconfig")
    request = PlanInput(tuple(paths), args.kubeconfig, args.policy)
    try:
        return plan(request, sys.stdin, sys.stdout, args.output == "json")
    except (ObjectError, KubeError) as err:
        print(f"fgpu plan: {err}", file=sys.stderr)
        return 2


def cmd_status(args: argparse.Namespace) -> int:
    if args.idle is not None or args.by:
        return _usage_status(args)
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


# client-go's defaults and kube-controller-manager's flag names, in seconds.
LEADER_ELECTION_FLAGS = (
    ("--leader-elect-lease-duration", "LEASE_DURATION", "15", "seconds a standby waits on an unchanged Lease"),
    ("--leader-elect-renew-deadline", "RENEW_DEADLINE", "10", "seconds the leader acts after its last renewal began"),
    ("--leader-elect-retry-period", "RETRY_PERIOD", "2", "seconds between renewals and a standby's looks"),
)


def cmd_health_clear(args: argparse.Namespace) -> int:
    from driver.node.health.record import HealthRecord

    if not args.state_dir:
        raise SettingsError("--state-dir (or STATE_DIR) is required: the plugin's state directory")
    if not Path(args.state_dir).is_dir():  # clearing would make it: a mistyped path would seem to work
        raise SettingsError(f"--state-dir {args.state_dir!r} is not a directory; give the plugin's state directory")
    left = HealthRecord(Path(args.state_dir)).clear(set(args.gpu) if args.gpu else None)
    print(f"cleared; {len(left)} fault(s) of other GPUs left" if args.gpu else "cleared all faults")
    return 0


def _fake_smi_state(state_dir: str | None, command: str) -> Path:
    """Where the fake nvidia-smi keeps its settings: as the plugin's tools see it."""
    from driver.nvml.mock_driver_root import SMI_STATE_ENV, fake_tools_env

    if os.environ.get(SMI_STATE_ENV):
        return Path(os.environ[SMI_STATE_ENV])
    if not state_dir:
        raise SettingsError(f"{command} needs --state-dir (or STATE_DIR): the plugin's, or {SMI_STATE_ENV}")
    return Path(fake_tools_env(Path(state_dir))[SMI_STATE_ENV])


def cmd_mock_fault(args: argparse.Namespace) -> int:
    from driver.nvml.mock import MockNvml
    from driver.nvml.mock_driver_root import forget_timeslices
    from driver.nvml.session import MOCK_STATE_ENV, is_mock, open_backend

    if not is_mock(args.nvml) or not os.environ.get(MOCK_STATE_ENV):
        raise SettingsError(f"mock-fault needs --nvml mock:<machine> and {MOCK_STATE_ENV} (the plugin's mock state)")
    mock: MockNvml = open_backend(args.nvml)
    mock.nvmlInit()
    try:
        if args.fault == "xid":
            mock.inject_xid(args.gpu, args.xid, *([args.gi, args.ci] if args.gi is not None else []))
        elif args.fault == "ecc":
            mock.inject_double_bit_ecc(args.gpu)
        elif args.fault == "reset":
            mock.reset_gpu(args.gpu)
            forget_timeslices(_fake_smi_state(args.state_dir, "mock-fault reset"), {mock.gpu_uuid(args.gpu)})
        else:
            mock.set_gpu_lost(args.gpu, args.fault == "lost")
    except mock.NVMLError as err:
        raise SettingsError(f"mock-fault on GPU {args.gpu}: {err}") from err
    return 0


def cmd_mock_driver(args: argparse.Namespace) -> int:
    """Unload or load the mock GPUs' driver (docs/operations.md); an unload takes the time-slice
    intervals with it, as it does every GPU's volatile state."""
    from driver.nvml.mock import MockNvml
    from driver.nvml.mock_driver_root import forget_timeslices
    from driver.nvml.session import MOCK_STATE_ENV, is_mock, open_backend

    if not is_mock(args.nvml) or not os.environ.get(MOCK_STATE_ENV):
        raise SettingsError(f"mock-driver needs --nvml mock:<machine> and {MOCK_STATE_ENV} (the plugin's mock state)")
    mock: MockNvml = open_backend(args.nvml)
    try:
        if args.action == "unload":
            mock.unload_driver()
            forget_timeslices(_fake_smi_state(args.state_dir, "mock-driver unload"))
        else:
            mock.load_driver(args.version)
    except mock.NVMLError as err:
        raise SettingsError(f"mock-driver {args.action}: {err}") from err
    return 0


def cmd_mock_usage(args: argparse.Namespace) -> int:
    from driver.nvml.mock import MockNvml, MockProcess
    from driver.nvml.session import MOCK_STATE_ENV, is_mock, open_backend

    if not is_mock(args.nvml) or not os.environ.get(MOCK_STATE_ENV):
        raise SettingsError(f"mock-usage needs --nvml mock:<machine> and {MOCK_STATE_ENV} (the plugin's mock state)")
    if (args.utilization is None) == (args.pid is None):
        raise SettingsError("mock-usage: give --utilization, or --pid (with --sm, --memory, --gi/--ci, or --end)")
    mock: MockNvml = open_backend(args.nvml)
    mock.nvmlInit()
    try:
        if args.utilization is not None:
            mock.set_utilization(args.gpu, None if args.utilization < 0 else args.utilization)
        elif args.end:
            mock.end_process(args.gpu, args.pid)
        else:
            mock.set_process(args.gpu, MockProcess(args.pid, args.sm, args.memory, args.gi, args.ci))
    except mock.NVMLError as err:
        raise SettingsError(f"mock-usage on GPU {args.gpu}: {err}") from err
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="fgpu", description="fractional GPUs through Kubernetes DRA")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--log-format", default="text", choices=LOG_FORMATS, help="text, or json: one object a line")
    commands = parser.add_subparsers(dest="command", required=True)

    discover = commands.add_parser("discover", help="print the ResourceSlices this node would publish")
    add_node_flags(discover)
    discover.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml")
    discover.set_defaults(func=cmd_discover)

    plugin = commands.add_parser("kubelet-plugin", help="run the node plugin")
    add_plugin_flags(plugin)
    plugin.set_defaults(func=cmd_kubelet_plugin)

    policies = list(POLICIES)
    controller = commands.add_parser("controller", help="allocate the claims labelled gpu.fgpu.dev/allocator=fgpu")
    controller.add_argument(
        "--kubeconfig", default=env_default(None, "KUBECONFIG"), help="client configuration [KUBECONFIG]"
    )
    controller.add_argument("--policy", choices=policies, default=DEFAULT_POLICY, help="placement scoring")
    controller.add_argument("--lease-namespace", default="kube-system", help="where the leader election Lease lives")
    controller.add_argument("--identity", default="", help="this replica's name in the Lease (default: host-pid)")
    controller.add_argument("--metrics-port", type=port, default=0, help="serve Prometheus metrics here (0 or -1: off)")
    for flag, env, default, what in LEADER_ELECTION_FLAGS:
        controller.add_argument(flag, type=seconds, default=env_default(default, env), help=f"{what} [{env}]")
    controller.add_argument(
        "--make-room",
        action="store_true",
        help="evict movable pods (gpu.fgpu.dev/movable) and lower-priority ones to place a claim that fits nowhere",
    )
    controller.add_argument(
        "--evictions-per-minute", type=positive, default=10, help="making room evicts at most this many pods a minute"
    )
    controller.add_argument(
        "--compact-when-idle",
        action="store_true",
        help="with --make-room: while nothing waits, move movable pods so that lightly used GPUs empty",
    )
    controller.set_defaults(func=cmd_controller)

    health = commands.add_parser("health", help="the node's GPU faults (run where the plugin's state dir is)")
    health_commands = health.add_subparsers(dest="health_command", required=True)
    clear = health_commands.add_parser("clear", help="forget GPU faults now: their taints go within a second")
    clear.add_argument("--state-dir", default=env_default(None, "STATE_DIR"), help="the plugin's state dir [STATE_DIR]")
    clear.add_argument("--gpu", action="append", help="a GPU UUID (repeat; default: every GPU)")
    clear.set_defaults(func=cmd_health_clear)

    mock_fault = commands.add_parser("mock-fault", help="make a mock GPU fail, for tests and demos (docs/health.md)")
    mock_fault.add_argument("--nvml", default=env_default("", "NVML"), help="mock:<machine> [NVML]")
    mock_fault.add_argument("--gpu", type=int, required=True, help="GPU index")
    mock_fault.add_argument(
        "fault",
        choices=["xid", "ecc", "lost", "recover", "reset"],
        help="reset: what nvidia-smi -r does (MIG instances, compute mode, time-slice interval gone)",
    )
    mock_fault.add_argument(
        "--state-dir", default=env_default(None, "STATE_DIR"), help="the plugin's state dir (reset) [STATE_DIR]"
    )
    mock_fault.add_argument("--xid", type=int, default=79, help="the XID number (fault xid)")
    mock_fault.add_argument("--gi", type=int, help="GPU instance id the XID is attributed to (with --ci)")
    mock_fault.add_argument("--ci", type=int, default=0, help="compute instance id (with --gi)")
    mock_fault.set_defaults(func=cmd_mock_fault)

    mock_driver = commands.add_parser(
        "mock-driver", help="unload or load the mock GPUs' driver, for tests and demos (docs/operations.md)"
    )
    mock_driver.add_argument("--nvml", default=env_default("", "NVML"), help="mock:<machine> [NVML]")
    mock_driver.add_argument("action", choices=["unload", "load"])
    mock_driver.add_argument("--version", default="", help="the driver version loaded (an upgrade; load)")
    mock_driver.add_argument(
        "--state-dir", default=env_default(None, "STATE_DIR"), help="the plugin's state dir (unload) [STATE_DIR]"
    )
    mock_driver.set_defaults(func=cmd_mock_driver)

    mock_usage = commands.add_parser(
        "mock-usage", help="set what a mock GPU's NVML reports as used, for tests and demos (docs/kueue.md)"
    )
    mock_usage.add_argument("--nvml", default=env_default("", "NVML"), help="mock:<machine> [NVML]")
    mock_usage.add_argument("--gpu", type=int, required=True, help="GPU index")
    mock_usage.add_argument("--utilization", type=int, help="the GPU's utilisation in percent (-1: simulated again)")
    mock_usage.add_argument("--pid", type=int, help="a compute process on the GPU (or with --gi/--ci its MIG device)")
    mock_usage.add_argument("--sm", type=int, default=0, help="the process's SM utilisation in percent")
    mock_usage.add_argument("--memory", type=int, default=0, help="the process's GPU memory in MiB")
    mock_usage.add_argument("--gi", type=int, help="the GPU instance id of its MIG device (with --ci)")
    mock_usage.add_argument("--ci", type=int, default=0, help="the compute instance id (with --gi)")
    mock_usage.add_argument("--end", action="store_true", help="the process --pid ends")
    mock_usage.set_defaults(func=cmd_mock_usage)

    webhook = commands.add_parser("webhook", help="refuse bad gpu.fgpu.dev opaque configs at admission (HTTPS)")
    webhook.add_argument("--driver-name", default=env_default(DEFAULT_DRIVER_NAME, "DRIVER_NAME"),
                         help="whose opaque configs to check [DRIVER_NAME]")  # fmt: skip
    webhook.add_argument("--bind-address", default="0.0.0.0", help="listen on this address")
    webhook.add_argument(
        "--port", type=port, default=env_default("8443", "WEBHOOK_PORT"), help="HTTPS port [WEBHOOK_PORT]"
    )
    webhook.add_argument("--tls-cert-file", type=Path, help="serving certificate (PEM), read again when it changes")
    webhook.add_argument("--tls-private-key-file", type=Path, help="its private key (PEM)")
    webhook.add_argument(
        "--ca-bundle-file",
        type=Path,
        help="with --tls-cert-file: the CA to write into --webhook-configuration's caBundle",
    )
    from driver.admission.lifetimes import duration  # the webhook's flags (docs/admission.md)

    webhook.add_argument(
        "--tls-secret",
        default="",
        help="self-managed: a CA and serving certificate kept in this Secret, made and renewed here",
    )
    webhook.add_argument(
        "--namespace",
        default=env_default(None, "POD_NAMESPACE"),
        help="the Secret's namespace, the Service's [POD_NAMESPACE]",
    )
    webhook.add_argument("--service-name", default="", help="the Service in front of the webhook: the names certified")
    webhook.add_argument("--extra-san", action="append", help="another DNS name or IP address to certify (repeat)")
    webhook.add_argument(
        "--webhook-configuration",
        default="",
        help="the ValidatingWebhookConfiguration whose caBundle this webhook writes",
    )
    webhook.add_argument(
        "--gate-pods",
        action="store_true",
        help="POST /mutate: add the scheduling gate gpu.fgpu.dev/allocation to pods that use opt-in claims "
        "(reads claims and templates)",
    )
    webhook.add_argument(
        "--mutating-webhook-configuration",
        default="",
        help="the MutatingWebhookConfiguration whose caBundle this webhook writes too (with --webhook-configuration)",
    )
    webhook.add_argument("--cert-validity", type=duration, default="8760h", help="serving certificate's lifetime")
    webhook.add_argument("--cert-renew-before", type=duration, default="720h", help="renew it this long before expiry")
    webhook.add_argument("--ca-validity", type=duration, default="87600h", help="the self-managed CA's lifetime")
    webhook.add_argument(
        "--kubeconfig",
        default=env_default(None, "KUBECONFIG"),
        help="client configuration [KUBECONFIG]; default: the pod's service account",
    )
    webhook.set_defaults(func=cmd_webhook)

    planner = commands.add_parser(
        "plan",
        help="dry run: plan the claims of manifests (claims, templates, pods, workloads), explain failures",
        description="Every file is read for every kind: ResourceClaims, ResourceClaimTemplates and the Pods, "
        "Deployments, ReplicaSets, StatefulSets, Jobs, CronJobs (and, with Nodes, DaemonSets) that use them, "
        "DeviceClasses, ResourceSlices, Nodes. Exit 1 when a claim cannot be allocated, 2 on bad input.",
    )
    planner.add_argument("manifests", type=Path, nargs="*", help="files, folders, or - for stdin")
    planner.add_argument("--slices", type=Path, nargs="+", default=[], help="ResourceSlices (fgpu discover's)")
    planner.add_argument("--classes", type=Path, nargs="+", default=[], help="DeviceClasses")
    planner.add_argument(
        "--claims", type=Path, nargs="+", default=[], help="more manifests (allocated claims count as taken)"
    )
    planner.add_argument(
        "--kubeconfig", help="also plan against this cluster's slices, classes, nodes and claims (only reads)"
    )
    planner.add_argument("--policy", choices=policies, default=DEFAULT_POLICY)
    planner.add_argument("-o", "--output", choices=["text", "json"], default="text")
    planner.set_defaults(func=cmd_plan)

    status = commands.add_parser("status", help="per node and GPU: what claims hold, what is free, taints")
    status.add_argument(
        "--kubeconfig", default=env_default(None, "KUBECONFIG"), help="client configuration [KUBECONFIG]"
    )
    status.add_argument("--node", action="append", help="only these nodes (repeatable, or a comma list)")
    status.add_argument("-o", "--output", choices=list(RENDERERS), default="table")
    from driver.admission.lifetimes import duration

    status.add_argument(
        "--idle", type=duration, metavar="DURATION", help="claims held but unused this long or longer (e.g. 30m)"
    )
    status.add_argument("--by", choices=["namespace"], help="GPU-hours by namespace since each plugin started")
    status.add_argument(
        "--metrics",
        action="append",
        help="with --idle/--by: a node plugin's metrics URL, http://<node>:<port>/metrics (repeatable or comma list)",
    )
    status.set_defaults(func=cmd_status)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        return args.func(args)
    except (SettingsError, MachineProfileError, NvmlUnavailableError, KubeConfigError, MockDriverRootError) as err:
        print(f"fgpu: {err}", file=sys.stderr)
        return 2

