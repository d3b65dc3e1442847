"""The node's commands (`fgpu discover`, `fgpu kubelet-plugin`): their flags and environment
variables -> one typed, checked settings object for the plugin. What every command shares (flag
parsing, environment defaults, value types) is in driver/common/flags.py."""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

from driver.common.flags import DEFAULT_DRIVER_NAME, SettingsError, env_default, interval, port, seconds
from driver.common.quantity import parse_quantity
from driver.common.testhooks import NO_TEST_HOOKS, TestHooks, from_environment
from driver.inventory.featuregates import GATES, FeatureGateError, FeatureGates
from driver.inventory.sharing import SharingConfig, SharingConfigError, load_sharing_config
from driver.node.health.taints import HealthPolicy, TaintEffect
from driver.node.sockets import (
    SocketPathError,
    check_socket_path,
    rolling_update_dra_socket_file,
    rolling_update_registrar_socket_file,
)
from driver.nvml.session import is_mock
from partitioner.mps import DEFAULT_SHM_BYTES

MOCK_DRIVER_ROOT = "mock-driver-root"  # under the state dir, where mock mode lays out the fake driver
POD_UID = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9_.]*$")  # it becomes part of two socket file names
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass(frozen=True)
class PluginSettings:
    driver_name: str
    node_name: str
    registrar_dir: Path
    plugin_dir: Path
    cdi_dir: Path
    state_dir: Path
    nvml: str
    kubeconfig: str | None
    driver_root: Path
    healthcheck_port: int
    sharing: SharingConfig
    host_driver_root: Path | None = None
    unprepare_grace_s: float = 300.0
    reconcile_interval_s: float = 60.0
    mps_shm_bytes: int = DEFAULT_SHM_BYTES
    mps_daemon_in_host_cgroups: bool = False
    # This pod's UID: per-instance socket names, so that two instances serve during a rolling update.
    rolling_update_uid: str = ""
    registration_grace_s: float = 60.0
    shutdown_drain_s: float = 3.0
    health: HealthPolicy = field(default_factory=HealthPolicy)
    health_monitor: bool = True
    metrics_port: int = -1  # Prometheus metrics; -1 or 0: off
    metrics_tenant_labels: bool = False  # claims' namespaces, names and pods in them (any pod can scrape)
    retry_waiting_pods: bool = True
    # The usage history (docs/rightsizing.md): its ConfigMap's namespace ("": not kept), how often it
    # is written, and how often a sample is taken (tests only: each sample counts 10 s whatever it is).
    usage_history_namespace: str = ""
    usage_history_interval_s: float = 300.0
    usage_sample_period_s: float = 10.0
    proc_root: Path = Path("/proc")  # the host's, with hostPID: each GPU process's pod (tests: a fake one)
    test_hooks: TestHooks = NO_TEST_HOOKS  # the FGPU_* test variables' hooks, set by tests only

    @property
    def mock_gpus(self) -> bool:
        """Mock NVML: the GPUs' device nodes, driver libraries and tools do not exist on the host,
        so the plugin stands in for them (CDI device nodes on /dev/null, a mock driver root)."""
        return is_mock(self.nvml)

    @property
    def registration_socket(self) -> Path:
        if self.rolling_update_uid:
            name = rolling_update_registrar_socket_file(self.registrar_dir, self.driver_name, self.rolling_update_uid)
            return self.registrar_dir / name
        return self.registrar_dir / f"{self.driver_name}-reg.sock"

    @property
    def dra_socket(self) -> Path:
        # Kubelet refuses a second registration of one endpoint, so each instance needs its own.
        if self.rolling_update_uid:
            return self.plugin_dir / rolling_update_dra_socket_file(self.plugin_dir, self.rolling_update_uid)
        return self.plugin_dir / "dra.sock"

    @property
    def checkpoint_path(self) -> Path:
        return self.state_dir / "checkpoint.json"


def add_node_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--driver-name", default=env_default(DEFAULT_DRIVER_NAME, "DRIVER_NAME"), help="DRA driver name [DRIVER_NAME]"
    )
    parser.add_argument("--node-name", default=env_default(None, "NODE_NAME"), help="this node's name [NODE_NAME]")
    parser.add_argument(
        "--offer",
        default=env_default("whole,mig,mps,timeslice", "OFFER"),
        help="device kinds every GPU offers: whole,mig,mps,timeslice (also mig-mps,mig-timeslice: shares "
        "inside a MIG partition) [OFFER]",
    )
    parser.add_argument(
        "--mig-share-profiles",
        default=env_default("", "MIG_SHARE_PROFILES"),
        help="MIG profiles whose partitions offer mig-mps/mig-timeslice shares, e.g. 3g.40gb,7g.80gb "
        "(default: every profile) [MIG_SHARE_PROFILES]",
    )
    parser.add_argument(
        "--sharing-config",
        default=env_default(None, "SHARING_CONFIG"),
        help="YAML file overriding --offer per GPU: gpus: [{index: 0, offer: [mig]}] [SHARING_CONFIG]",
    )
    parser.add_argument(
        "--feature-gates",
        default=env_default("", "FEATURE_GATES"),
        help="Name=true|false,...: "
        + "; ".join(f"{name} (default {gate.default}; needs {gate.needs})" for name, gate in GATES.items())
        + " [FEATURE_GATES]",
    )
    parser.add_argument(
        "--nvml",
        default=env_default("real", "NVML"),
        help="'real' (the NVML library) or 'mock:<machine|profile.yaml>' [NVML]",
    )


def add_plugin_flags(parser: argparse.ArgumentParser) -> None:
    add_node_flags(parser)
    add_health_flags(parser)
    parser.add_argument(
        "--registrar-dir",
        default=env_default("/var/lib/kubelet/plugins_registry", "REGISTRAR_DIR"),
        help="kubelet's plugin registry directory [REGISTRAR_DIR]",
    )
    parser.add_argument(
        "--plugin-dir",
        default=env_default(None, "PLUGIN_DIR"),
        help="directory of the DRA socket, default /var/lib/kubelet/plugins/<driver> [PLUGIN_DIR]",
    )
    parser.add_argument(
        "--cdi-dir", default=env_default("/var/run/cdi", "CDI_DIR"), help="CDI spec directory [CDI_DIR]"
    )
    parser.add_argument(
        "--state-dir", default=env_default(None, "STATE_DIR"), help="checkpoint directory, default the plugin dir"
    )
    parser.add_argument(
        "--kubeconfig", default=env_default(None, "KUBECONFIG"), help="kubeconfig; in-cluster config when absent"
    )
    parser.add_argument(
        "--driver-root",
        default=env_default(None, "DRIVER_ROOT"),
        help="where the NVIDIA driver files are; default /, or with mock NVML a mock driver root laid out "
        f"under the state dir ({MOCK_DRIVER_ROOT}) [DRIVER_ROOT]",
    )
    parser.add_argument(
        "--host-driver-root",
        default=env_default(None, "HOST_DRIVER_ROOT"),
        help="the driver root as the host sees it, when the plugin runs in a container [HOST_DRIVER_ROOT]",
    )
    parser.add_argument(
        "--unprepare-grace",
        type=seconds,
        default=env_default("300", "UNPREPARE_GRACE"),
        help="seconds a prepared claim may be gone from the API server before it is unprepared [UNPREPARE_GRACE]",
    )
    parser.add_argument(
        "--reconcile-interval",
        type=interval,
        default=env_default("60", "RECONCILE_INTERVAL"),
        help="seconds between checks of prepared claims against the API server [RECONCILE_INTERVAL]",
    )
    parser.add_argument(
        "--mps-shm-size",
        default=env_default(None, "MPS_SHM_SIZE"),
        help=f"size of each GPU's MPS tmpfs, the /dev/shm of its daemon and MPS clients, default "
        f"{DEFAULT_SHM_BYTES // 2**20}Mi (a limit: pages are used only once written) [MPS_SHM_SIZE]",
    )
    parser.add_argument(
        "--mps-daemon-in-host-cgroups",
        action=argparse.BooleanOptionalAction,
        default=env_default("false", "MPS_DAEMON_IN_HOST_CGROUPS"),
        help="start MPS daemons in the cgroups of the host's PID 1, so that they outlive the plugin's "
        "container (a DaemonSet pod with hostPID) [MPS_DAEMON_IN_HOST_CGROUPS=true]",
    )
    parser.add_argument(
        "--healthcheck-port",
        type=port,
        default=env_default("-1", "HEALTHCHECK_PORT"),
        help="TCP port for the gRPC health service (liveness probe); -1 disables [HEALTHCHECK_PORT]",
    )
    parser.add_argument(
        "--metrics-port",
        type=port,
        default=env_default("-1", "METRICS_PORT"),
        help="TCP port for Prometheus metrics (/metrics); -1 or 0 disables [METRICS_PORT]",
    )
    parser.add_argument(
        "--metrics-tenant-labels",
        action=argparse.BooleanOptionalAction,
        default=env_default("false", "METRICS_TENANT_LABELS"),
        help="label the metrics with the namespaces, claims and pods holding the GPUs; off, a claim is its UID "
        "(the port is on the pod network: any pod can read it) [METRICS_TENANT_LABELS=true|false]",
    )
    parser.add_argument(
        "--usage-history-namespace",
        default=env_default("", "USAGE_HISTORY_NAMESPACE"),
        help="keep the usage history of the claims this plugin prepares (for fgpu rightsize) in the ConfigMap "
        "fgpu-usage-<node> of this namespace, the driver's; empty: not kept [USAGE_HISTORY_NAMESPACE]",
    )
    parser.add_argument(
        "--usage-history-interval",
        type=interval,
        default=env_default("300", "USAGE_HISTORY_INTERVAL"),
        help="seconds between writes of the usage history (a crash loses at most this much) [USAGE_HISTORY_INTERVAL]",
    )
    # Tests only: a week's samples in minutes (each still counts 10 s), and GPU processes' pods from a fake /proc.
    parser.add_argument("--usage-sample-period", type=interval, default=10.0, help=argparse.SUPPRESS)
    parser.add_argument("--proc-root", default="/proc", help=argparse.SUPPRESS)
    parser.add_argument(
        "--rolling-update-uid",
        default=env_default("", "POD_UID"),
        help="this pod's UID (downward API metadata.uid): sockets <driver>-<uid>-reg.sock and dra-<uid>.sock, "
        "so that two instances serve side by side during a rolling update; empty: <driver>-reg.sock and "
        "dra.sock [POD_UID]",
    )
    parser.add_argument(
        "--registration-grace",
        type=seconds,
        default=env_default("60", "REGISTRATION_GRACE"),
        help="seconds the health service says SERVING without kubelet's registration, after the socket is "
        "created or a registration failed [REGISTRATION_GRACE]",
    )
    parser.add_argument(
        "--retry-waiting-pods",
        action=argparse.BooleanOptionalAction,
        default=env_default("true", "RETRY_WAITING_PODS"),
        help="once kubelet registers the plugin or the NVIDIA driver is back, annotate the node's pending pods "
        "whose claims it could not prepare meanwhile, so that kubelet tries them now rather than at its next "
        "pod sync (up to 90 s); needs list on resourceclaims and patch on pods [RETRY_WAITING_PODS=true|false]",
    )
    parser.add_argument(
        "--shutdown-drain",
        type=seconds,
        default=env_default("3", "SHUTDOWN_DRAIN"),
        help="on SIGTERM, seconds the DRA service keeps serving after the registration socket is removed, "
        "for calls kubelet sent before it noticed [SHUTDOWN_DRAIN]",
    )


def add_health_flags(parser: argparse.ArgumentParser) -> None:
    default = HealthPolicy()
    parser.add_argument(
        "--health-monitor",
        action=argparse.BooleanOptionalAction,
        default=env_default("true", "HEALTH_MONITOR"),
        help="watch the GPUs (XIDs, ECC, reachability), taint failing devices and tell kubelet; "
        "--no-health-monitor where another agent fences GPUs [HEALTH_MONITOR=true|false]",
    )
    parser.add_argument(
        "--health-fault-xids",
        default=env_default(",".join(map(str, sorted(default.fault_xids))), "HEALTH_FAULT_XIDS"),
        help="XIDs that are device faults and taint the GPU's devices; others (application errors such as "
        "13, 31, 43, 45) are only logged [HEALTH_FAULT_XIDS]",
    )
    effects = (
        ("fault", default.fault_effect, "XID faults and double-bit ECC errors"),
        ("lost", default.lost_effect, "a GPU NVML cannot reach"),
    )
    for kind, value, what in effects:
        env = f"HEALTH_{kind.upper()}_EFFECT"
        parser.add_argument(
            f"--health-{kind}-effect",
            default=env_default(value, env),
            choices=get_args(TaintEffect),
            help=f"taint effect for {what} (None: no taint) [{env}]",
        )
    parser.add_argument(
        "--health-recovery",
        type=seconds,
        default=env_default(str(int(default.recovery_s)), "HEALTH_RECOVERY"),
        help="seconds a GPU must be healthy after its last fault before its taints go [HEALTH_RECOVERY]",
    )


def health_policy(args: argparse.Namespace) -> HealthPolicy:
    try:
        xids = frozenset(int(x) for x in args.health_fault_xids.split(",") if x.strip())
    except ValueError as err:
        raise SettingsError(f"--health-fault-xids {args.health_fault_xids!r} is not a list of numbers") from err
    return HealthPolicy(xids, args.health_fault_effect, args.health_lost_effect, args.health_recovery)


def validate_driver_name(name: str | None) -> None:
    if not DNS_SUBDOMAIN.match(name or "") or len(name or "") > 63:
        raise SettingsError(f"--driver-name {name!r} is not a DNS subdomain of at most 63 characters")


def validate_names(args: argparse.Namespace) -> None:
    validate_driver_name(args.driver_name)
    if not args.node_name:
        raise SettingsError("--node-name (or NODE_NAME) is required")
    if not DNS_SUBDOMAIN.match(args.node_name) or len(args.node_name) > 253:
        raise SettingsError(
            f"--node-name {args.node_name!r} is not a node name (a DNS subdomain: lower case letters, digits, "
            "'-' and '.', at most 253 characters); give the Node object's name"
        )


def validate_namespace(namespace: str) -> str:
    if namespace and (not DNS_LABEL.match(namespace) or len(namespace) > 63):
        raise SettingsError(f"--usage-history-namespace {namespace!r} is not a namespace name (a DNS label)")
    return namespace


def validate_pod_uid(uid: str) -> str:
    if uid and not POD_UID.match(uid):
        raise SettingsError(f"--rolling-update-uid {uid!r} is not a pod UID (letters, digits, '-', '_', '.')")
    return uid


def sharing_config(args: argparse.Namespace) -> SharingConfig:
    """What each GPU offers: --offer and --sharing-config, less what disabled feature gates rule out."""
    try:
        path = Path(args.sharing_config) if args.sharing_config else None
        sharing = load_sharing_config(args.offer, path, args.mig_share_profiles)
        return FeatureGates.parse(args.feature_gates).restrict(sharing)
    except (SharingConfigError, FeatureGateError) as err:
        raise SettingsError(str(err)) from err


def default_driver_root(nvml: str, state_dir: Path) -> Path:
    return state_dir / MOCK_DRIVER_ROOT if is_mock(nvml) else Path("/")


def size_bytes(flag: str, value: str) -> int:
    try:
        size = int(parse_quantity(value))
    except ValueError as err:
        raise SettingsError(f"{flag} {value!r} is not a size (e.g. 1Gi, 512Mi)") from err
    if size < 2**20:
        raise SettingsError(f"{flag} {value!r} is less than 1Mi")
    return size


def check_directory(flag: str, path: Path) -> None:
    """A directory the plugin writes in: there and writable, or creatable where its nearest existing
    ancestor is a writable directory. Checked up front, so that a bad one stops the plugin before
    it has made any of the others."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise SettingsError(f"{flag} {path}: {existing} is not a directory; give a directory path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SettingsError(f"{flag} {path}: {existing} is not writable; give a directory this user can write")


def plugin_settings(args: argparse.Namespace) -> PluginSettings:
    validate_names(args)
    plugin_dir = Path(args.plugin_dir or f"/var/lib/kubelet/plugins/{args.driver_name}")
    state_dir = Path(args.state_dir) if args.state_dir else plugin_dir
    settings = PluginSettings(
        driver_name=args.driver_name,
        node_name=args.node_name,
        registrar_dir=Path(args.registrar_dir),
        plugin_dir=plugin_dir,
        cdi_dir=Path(args.cdi_dir),
        state_dir=state_dir,
        nvml=args.nvml,
        kubeconfig=args.kubeconfig,
        driver_root=Path(args.driver_root) if args.driver_root else default_driver_root(args.nvml, state_dir),
        healthcheck_port=args.healthcheck_port,
        sharing=sharing_config(args),
        host_driver_root=Path(args.host_driver_root) if args.host_driver_root else None,
        unprepare_grace_s=args.unprepare_grace,
        reconcile_interval_s=args.reconcile_interval,
        mps_shm_bytes=size_bytes("--mps-shm-size", args.mps_shm_size) if args.mps_shm_size else DEFAULT_SHM_BYTES,
        mps_daemon_in_host_cgroups=args.mps_daemon_in_host_cgroups,
        rolling_update_uid=validate_pod_uid(args.rolling_update_uid),
        registration_grace_s=args.registration_grace,
        shutdown_drain_s=args.shutdown_drain,
        health=health_policy(args),
        health_monitor=args.health_monitor,
        metrics_port=args.metrics_port,
        metrics_tenant_labels=args.metrics_tenant_labels,
        retry_waiting_pods=args.retry_waiting_pods,
        usage_history_namespace=validate_namespace(args.usage_history_namespace),
        usage_history_interval_s=args.usage_history_interval,
        usage_sample_period_s=args.usage_sample_period,
        proc_root=Path(args.proc_root),
        test_hooks=from_environment(),
    )
    for flag, directory in (("--registrar-dir", settings.registrar_dir), ("--plugin-dir", settings.plugin_dir),
                            ("--cdi-dir", settings.cdi_dir), ("--state-dir", settings.state_dir)):  # fmt: skip
        check_directory(flag, directory)
    for socket in (settings.registration_socket, settings.dra_socket):
        try:
            check_socket_path(socket)
        except SocketPathError as err:
            raise SettingsError(f"{err}: use a shorter --registrar-dir or --plugin-dir") from err
    return settings
