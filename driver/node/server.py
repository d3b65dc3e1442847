"""The `fgpu kubelet-plugin` process: wires discovery, state, CDI and publishing to the gRPC
services, serves until SIGTERM, then drains (registration withdrawn first, the DRA service a while
longer), removes its sockets and keeps its state."""

from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent import futures
from functools import partial
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2_grpc

from driver.common.testhooks import Step
from driver.inventory.devices import node_targets
from driver.inventory.discovery import discover_gpus
from driver.inventory.offers import check_offers, node_inventory
from driver.kube.client import ClientKubeApi, KubeApi
from driver.node.cdi import CdiWriter, DriverFiles
from driver.node.checkpoint import Checkpoint
from driver.node.claim_locks import NodeClaimLock
from driver.node.driver_wait import wait_for_driver
from driver.node.health.monitor import HealthBoard, HealthMonitor
from driver.node.health.record import HealthRecord, MigSlices
from driver.node.health.service import HEALTH_SERVICES, add_health_services
from driver.node.instance_lock import InstanceLock
from driver.node.kubelet.api import pluginregistration_v1_pb2_grpc as reg_grpc
from driver.node.kubelet.dra_service import add_dra_services
from driver.node.kubelet.liveness import (
    GatedHealthServicer,
    LivenessMonitor,
    RegistrationState,
    self_probe,
    serve_health_port,
)
from driver.node.kubelet.prepare_retries import PrepareRetries
from driver.node.kubelet.registration import RegistrationService
from driver.node.metrics import SAMPLE_S, ClaimHolders, MetricsServer, NodeCollector, node_registry
from driver.node.mig_mode_watch import MigModeWatch
from driver.node.partition_use import Partitioners
from driver.node.prepare import ClaimPreparer
from driver.node.publisher import SlicePublisher
from driver.node.reconcile import ClaimReconciler
from driver.node.recovery import recover
from driver.node.settings import PluginSettings
from driver.node.sockets import BoundSocket, prepare_socket_path
from driver.node.state import PreparedClaims
from driver.node.usage_history import HistorySettings, Sampler, UsageRecorder
from driver.nvml import mock_driver_root
from driver.nvml.session import NvmlSession
from partitioner.mig import MigPartitioner
from partitioner.mps import MpsPartitioner
from partitioner.runner import ToolRunner
from partitioner.timeslice import TimeSlicer

log = logging.getLogger(__name__)

HOST_INIT_PID = 1  # with hostPID, the host's init: the cgroups MPS daemons join to outlive our container
# After registration, the old instance's drain plus this long, a second retry pass (see _registered).
ANSWERS_SETTLE_S = 5.0


class PluginProcess:
    def __init__(self, settings: PluginSettings, api: KubeApi | None = None, nvml: NvmlSession | None = None) -> None:
        self.settings = settings
        self.api = api or ClientKubeApi(settings.kubeconfig)
        self._nvml = nvml or NvmlSession.open(settings.nvml)
        self.gpus = discover_gpus(self._nvml)
        check_offers(self.gpus, settings.sharing)
        log.info("discovered %d GPU(s): %s", len(self.gpus), ", ".join(g.product_name for g in self.gpus))
        # Made only now that the settings, the client configuration and the GPUs passed: a bad one
        # leaves nothing behind.
        for directory in (settings.state_dir, settings.cdi_dir, settings.plugin_dir):
            directory.mkdir(parents=True, exist_ok=True)
        self.claims = PreparedClaims(Checkpoint(settings.checkpoint_path))
        runner = self._tool_runner()
        self.cdi = CdiWriter(
            settings.cdi_dir,
            settings.driver_name,
            DriverFiles.discover(settings.driver_root, settings.host_driver_root),
            mock_device_nodes=settings.mock_gpus,
        )
        self.instance = InstanceLock(settings.state_dir)
        hooks = settings.test_hooks
        partitioners = Partitioners(
            mig=MigPartitioner(self._nvml),
            mps=MpsPartitioner(
                self._nvml,
                runner,
                settings.state_dir,
                settings.mps_shm_bytes,
                daemon_cgroups_of=HOST_INIT_PID if settings.mps_daemon_in_host_cgroups else None,
                on_shm_mounted=partial(hooks.reached, Step.MPS_SHM_MOUNTED),
                on_daemon_stopped=partial(hooks.reached, Step.MPS_DAEMON_STOPPED),
            ),
            timeslice=TimeSlicer(runner),
        )
        targets = node_targets(self.gpus, settings.sharing)
        self.preparer = ClaimPreparer(
            driver_name=settings.driver_name,
            node_name=settings.node_name,
            targets=targets,
            api=self.api,
            claims=self.claims,
            cdi=self.cdi,
            partitioners=partitioners,
            instance=self.instance,
            node_lock=NodeClaimLock(settings.state_dir),
            driver_missing=lambda: self.health_monitor.driver_missing(),  # made below, asked at prepares
            test_hooks=hooks,
        )
        self.reconciler = ClaimReconciler(
            self.api, self.preparer, self.claims, settings.unprepare_grace_s, settings.reconcile_interval_s
        )
        self.publisher = SlicePublisher(
            self.api, settings.driver_name, settings.node_name, node_inventory(self.gpus, settings.sharing)
        )
        self.mig_mode_watch = MigModeWatch(self._nvml, self.gpus, settings.sharing, self.publisher.set_inventory)
        self.mig_mode_watch.log_shortfalls()
        self.health = GatedHealthServicer()
        self.device_health = HealthBoard()
        self.health_monitor = HealthMonitor(
            self._nvml,
            self.gpus,
            targets,
            HealthRecord(settings.state_dir),
            settings.health,
            self.publisher.set_taints,
            self.device_health,
            self._mig_slices_of,
            on_gpu_back=self.preparer.check_prepared,
            on_driver_back=self._driver_back,
        )
        self.prepare_retries = PrepareRetries(
            self.api,
            settings.driver_name,
            settings.node_name,
            self.claims.answered,
            asked=lambda uids: self.preparer.record_answer(uids, True),
        )
        self.liveness: LivenessMonitor | None = None
        self._dra_server: grpc.Server | None = None
        self._registration_server: grpc.Server | None = None
        self._health_server: grpc.Server | None = None
        self._metrics_server: MetricsServer | None = None
        self._recorder: UsageRecorder | None = None
        self._sampler: Sampler | None = None
        self._sockets: list[BoundSocket] = []
        self._stopped = threading.Event()

    def _tool_runner(self) -> ToolRunner:
        """Real GPUs: the driver's tools under the driver root. Mock GPUs: the mock driver root is
        laid out first (the fake tools, placeholder libraries), the fakes' state under the state dir."""
        settings = self.settings
        if not settings.mock_gpus:
            return ToolRunner(settings.driver_root)
        mock_driver_root.lay_out(settings.driver_root, self._nvml.driver_versions()[0])
        return ToolRunner(settings.driver_root, mock_driver_root.fake_tools_env(settings.state_dir))

    def _driver_back(self) -> None:
        """The driver loaded again destroyed every GPU's volatile state, and may be a new version."""
        self.preparer.check_prepared()
        self.mig_mode_watch.rediscover()
        self._retry_waiting_pods(f"the NVIDIA driver on node {self.settings.node_name} is loaded again")

    def _registered(self, registered: bool) -> None:
        self.health.set_ready(registered)
        if registered:
            # Once more when the instance we replace has stopped: it serves calls sent before its
            # withdrawal for its drain, and one kubelet gave up on meanwhile is marked (_answered).
            again = self.settings.shutdown_drain_s + ANSWERS_SETTLE_S
            self._retry_waiting_pods(f"the {self.settings.driver_name} plugin is registered with kubelet", again)

    def _answered(self, uids: list[str], delivered: bool) -> None:
        """Kubelet gave up on a prepare call that then completed (its timeout; or this instance
        withdrew its registration, and kubelet closes its connection to it, maybe before the answer
        is sent): it waits for its next pod sync (a minute or more) unless asked. Asked now while
        this instance is registered, else by the next one (the record says)."""
        withdrawn = self._stopped.is_set()
        changed = self.preparer.record_answer(uids, delivered and not withdrawn)
        if not changed or delivered:
            return
        log.warning("kubelet cancelled its prepare call for %s before the answer", ", ".join(changed))
        if not withdrawn:
            self._retry_waiting_pods(f"kubelet cancelled its call to prepare {', '.join(changed)} before the answer")

    def _retry_waiting_pods(self, why: str, again_after_s: float = 0.0) -> None:
        if self.settings.retry_waiting_pods:
            self.prepare_retries.request(why, again_after_s)

    def _mig_slices_of(self, gpu_index: int, gi_id: int) -> MigSlices | None:
        """The memory slices of a GPU instance, for a fault NVML attributes to it."""
        for instance in self._nvml.gpu_instances(gpu_index):
            if instance.gi_id == gi_id:
                return MigSlices(instance.start, instance.size)
        return None

    def start(self) -> None:
        settings = self.settings
        recover(self.preparer)
        if settings.health_monitor:
            self.health_monitor.refresh()  # taints recorded before a restart are in the first publish
        self.publisher.start()
        self.mig_mode_watch.start()
        self.reconciler.start()
        self.prepare_retries.start()
        self.preparer.rightsized.start()
        if settings.health_monitor:
            self.health_monitor.start()

        # Before ours are bound: kubelet keeps a killed instance's registration while its socket
        # exists, and once our sockets accept connections nothing stale is left beside them.
        self.instance.remove_dead_instances_sockets()
        dra_server = grpc.server(futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="dra"))
        add_dra_services(dra_server, self.preparer, self._answered)
        if settings.health_monitor:
            add_health_services(dra_server, self.device_health, settings.node_name)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, dra_server)
        self._bind(dra_server, settings.dra_socket)
        dra_server.start()
        self._dra_server = dra_server
        log.info("DRA service on %s", settings.dra_socket)

        # The grace period starts with the registration socket; Ready as soon as kubelet registers us.
        registration_state = RegistrationState(on_change=self._registered)
        registration = RegistrationService(
            settings.driver_name,
            str(settings.dra_socket.absolute()),
            registration_state,
            HEALTH_SERVICES if settings.health_monitor else (),
        )
        reg_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="registration"))
        reg_grpc.add_RegistrationServicer_to_server(registration, reg_server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, reg_server)
        self._bind(reg_server, settings.registration_socket)
        reg_server.start()
        self._registration_server = reg_server
        log.info("registration service on %s", settings.registration_socket)
        if settings.healthcheck_port >= 0:
            self._health_server = serve_health_port(self.health, settings.healthcheck_port)
        self._start_usage()

        probe = partial(self_probe, settings.registration_socket, settings.dra_socket)
        self.liveness = LivenessMonitor(
            self.health, tuple(self._sockets), registration_state, settings.registration_grace_s, probe
        )
        self.liveness.check_once()
        self.liveness.start()

    def _start_usage(self) -> None:
        """The metrics server and the usage history, both fed by one sampling point (metrics.py)."""
        settings = self.settings
        if settings.usage_history_namespace:
            offset = settings.test_hooks.clock_offset_s
            history = HistorySettings(settings.node_name, settings.usage_history_namespace,
                                      settings.usage_sample_period_s, settings.usage_history_interval_s)  # fmt: skip
            self._recorder = UsageRecorder(self.api, history, clock=lambda: time.time() + offset)
            self._recorder.start()
        if settings.metrics_port <= 0 and self._recorder is None:
            return
        collector = NodeCollector(settings.node_name, self.claims, self._nvml, self.gpus, ClaimHolders(self.api),
                                  proc_root=settings.proc_root, tenant_labels=settings.metrics_tenant_labels,
                                  on_claims=self._recorder.observe if self._recorder else None)  # fmt: skip
        sample_s = min(SAMPLE_S, settings.usage_sample_period_s) if self._recorder else SAMPLE_S
        if settings.metrics_port > 0:
            registry = node_registry(collector)
            self._metrics_server = MetricsServer(
                settings.metrics_port, registry, sample=collector.sample_usage, sample_s=sample_s
            )
            self._metrics_server.start()
        else:
            self._sampler = Sampler(collector.sample_usage, sample_s)
            self._sampler.start()

    def _bind(self, server: grpc.Server, path: Path) -> None:
        """Listen on `path` (replacing a stale socket of our own name) and record the file we bound
        before anything can connect to it: killed at any point after, this instance leaves a record
        the next one removes its sockets by."""
        server.add_insecure_port(prepare_socket_path(path))
        self._sockets.append(BoundSocket.at(path))
        self.instance.record_sockets(self._sockets)

    def stop(self) -> None:
        """Withdraw the registration first, so that kubelet turns to another instance (a rolling
        update) while calls it already sent here are still served; then stop serving."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.liveness is not None:
            self.liveness.stop()
        self.health.enter_graceful_shutdown()
        if self._registration_server is not None:
            self._remove_socket(self.settings.registration_socket)
            log.info("registration withdrawn: its socket removed")  # kubelet sees it go now (bench.pod_start times it)
            self._registration_server.stop(grace=1).wait()
        if self._dra_server is not None and self.settings.shutdown_drain_s > 0:
            log.info("serving DRA calls for %.1fs more", self.settings.shutdown_drain_s)
            time.sleep(self.settings.shutdown_drain_s)
        if self._sampler is not None:
            self._sampler.stop()
        if self._recorder is not None:
            self._recorder.stop()  # its last write, while the API client is open
        self.api.close()  # unblocks the publisher's watch
        self.health_monitor.stop()
        self.mig_mode_watch.stop()
        self.publisher.stop()
        self.reconciler.stop()
        self.prepare_retries.stop()
        self.preparer.rightsized.stop()
        for server in (self._dra_server, self._health_server):
            if server is not None:
                server.stop(grace=5).wait()
        self._remove_socket(self.settings.dra_socket)
        if self._metrics_server is not None:
            self._metrics_server.stop()  # before NVML closes: a scrape reads it
        self._nvml.close()
        self.instance.release()
        log.info("stopped; sockets removed, state kept in %s", self.settings.state_dir)

    def _remove_socket(self, path: Path) -> None:
        for bound in self._sockets:
            if bound.path == path:
                bound.remove()  # ours only: another instance's socket at this path stays


def run_plugin(settings: PluginSettings, api: KubeApi | None = None) -> None:
    """Serve until SIGTERM or SIGINT; before the NVIDIA driver is there, wait for it (driver_wait.py).
    `api`: the API server's client (by default from the settings' kubeconfig; benchmarks give an
    in-memory one)."""
    done = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: done.set())
    api = api or ClientKubeApi(settings.kubeconfig)  # a bad client configuration fails now, not after the wait
    nvml = wait_for_driver(settings.nvml, done, settings.healthcheck_port)
    if nvml is None:
        return
    process = PluginProcess(settings, api, nvml)
    process.start()
    done.wait()
    process.stop()
