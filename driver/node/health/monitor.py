"""The health monitor: NVML's XID and ECC events and a reachability probe of every GPU become
faults in the health record; what is in force becomes device taints in the published slices and
device health for kubelet's stream. It re-reads the record on every round, so another instance's
findings and `fgpu health clear` take effect here within a round, without a restart."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from driver.inventory.devices import DeviceTaint, DeviceTarget
from driver.inventory.discovery import GpuInfo
from driver.kube.errors import KubeError
from driver.node import metrics
from driver.node.background import BackgroundWorker
from driver.node.health.record import GpuFault, HealthRecord, MigSlices
from driver.node.health.taints import DeviceHealthReport, HealthPolicy, describe, device_health, device_taints
from driver.nvml.session import DriverGoneError, EventWatch, GpuLostError, NvmlEvent, NvmlSession, gpu_reachable

log = logging.getLogger(__name__)
ROUND_S = 1.0  # how long one wait for NVML events lasts; also the probe and re-read period
MAX_BACKOFF_S = 30.0


@dataclass(frozen=True)
class HealthSnapshot:
    version: int
    devices: dict[str, DeviceHealthReport]
    taken_at: float


class HealthBoard:
    """The latest device health, for kubelet's streams to wait on."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._snapshot = HealthSnapshot(0, {}, time.time())

    def publish(self, devices: dict[str, DeviceHealthReport]) -> None:
        with self._changed:
            if devices != self._snapshot.devices or self._snapshot.version == 0:
                self._snapshot = HealthSnapshot(self._snapshot.version + 1, devices, time.time())
                self._changed.notify_all()

    def wait_newer(self, version: int, timeout_s: float) -> HealthSnapshot:
        """The snapshot once it is newer than `version`, or the current one after the timeout."""
        with self._changed:
            self._changed.wait_for(lambda: self._snapshot.version > version, timeout_s)
            return self._snapshot


class HealthMonitor(BackgroundWorker):
    thread_name = "health-monitor"

    def __init__(
        self,
        session: NvmlSession,
        gpus: list[GpuInfo],
        targets: list[DeviceTarget],
        record: HealthRecord,
        policy: HealthPolicy,
        publish_taints: Callable[[dict[str, tuple[DeviceTaint, ...]]], None],
        board: HealthBoard,
        mig_slices_of: Callable[[int, int], MigSlices | None],
        on_gpu_back: Callable[[int], object] = lambda _: None,
        on_driver_back: Callable[[], object] = lambda: None,
    ) -> None:
        """`on_gpu_back(index)`: a GPU that was unreachable answers again, so it was reset (the driver's
        recovery or an admin's `nvidia-smi -r`), which destroyed its volatile state. `on_driver_back()`:
        the NVIDIA driver was unloaded and is loaded again (maybe another version), which destroyed
        every GPU's volatile state."""
        super().__init__()
        self._on_gpu_back, self._on_driver_back = on_gpu_back, on_driver_back
        self._session, self._gpus, self._targets = session, gpus, targets
        self._record, self._policy, self._publish_taints, self._board = record, policy, publish_taints, board
        self._mig_slices_of = mig_slices_of  # (GPU index, GPU instance id) -> its memory slices
        self._published: dict[str, tuple[DeviceTaint, ...]] = {}  # in the publisher's slices
        self._retry_at = 0.0
        self._backoff = 1.0
        self._lost: set[int] = set()  # GPU indices seen unreachable at the last probe
        self._driver_missing = ""  # why NVML found no driver at the last round; "": it answered
        self._driver_loads = session.driver_loads  # the session's reopenings seen: one more is a new driver

    def driver_missing(self) -> str:
        """Why the NVIDIA driver did not answer at the last round ("": it did)."""
        return self._driver_missing

    def _run(self) -> None:
        watch = EventWatch(self._session, [g.index for g in self._gpus])
        try:
            while not self._stop.is_set():
                try:
                    self.round(watch)
                except Exception:
                    log.exception("health monitor round failed; going on")
                    self._stop.wait(ROUND_S)
        finally:
            watch.close()

    def round(self, watch: EventWatch) -> None:
        """Wait up to a round for events, probe the GPUs, then bring taints and health up to date.
        Without a driver, every GPU is out of reach: faults of kind driver until it is back."""
        missing = self._session.driver_missing()
        if missing:
            self._without_driver(missing)
            self.refresh()
            self._stop.wait(ROUND_S)
            return
        if self._driver_missing or self._session.driver_loads != self._driver_loads:
            self._driver_back(watch)
        try:
            try:
                event = watch.next(ROUND_S)
                while event is not None:
                    self._on_event(event)
                    event = watch.next(0)
            except GpuLostError:
                self._stop.wait(ROUND_S)  # the probe below says which GPU
            self._probe()
        except DriverGoneError:
            return  # gone since this round began: the next one finds it gone
        self.refresh()

    def _on_event(self, event: NvmlEvent) -> None:
        gpu = next(g for g in self._gpus if g.index == event.gpu_index)
        mig = self._mig_slices_of(gpu.index, event.gi_id) if event.gi_id is not None else None
        now = time.time()
        fault = GpuFault(gpu.uuid, "xid" if event.kind == "xid" else "ecc", event.xid, mig, now, now)
        metrics.record_health_event(gpu.uuid, "xid" if event.kind == "xid" else "ecc_double_bit", event.xid)
        if event.kind == "xid" and event.xid not in self._policy.fault_xids:
            log.warning("GPU %s: XID %s (an application error, not tainting)", gpu.uuid, event.xid)
            return
        log.warning("GPU %s: %s", gpu.uuid, describe(fault))
        self._record.record(fault)

    def _without_driver(self, why: str) -> None:
        if not self._driver_missing:
            log.warning("the NVIDIA driver does not answer (%s): every GPU's devices tainted, prepares refused", why)
        self._driver_missing = why
        now = time.time()
        self._record.record(*(GpuFault(gpu.uuid, "driver", first_seen=now, last_seen=now) for gpu in self._gpus))

    def _driver_back(self, watch: EventWatch) -> None:
        """A driver loaded again: the event set is the old driver's, the GPUs lost their volatile
        state. The claims are checked (made again) before the taints go, so that no new claim is
        allocated beside one whose MIG instance is not there yet; a failure is retried next round."""
        log.warning("the NVIDIA driver answers again; checking every prepared claim")
        watch.renew()
        self._on_driver_back()
        self._record.update(lambda faults: [f for f in faults if f.kind != "driver"])
        self._driver_missing, self._driver_loads = "", self._session.driver_loads

    def _probe(self) -> None:
        for gpu in self._gpus:
            if gpu_reachable(self._session, gpu.index):
                if gpu.index in self._lost:
                    self._lost.discard(gpu.index)
                    log.warning("GPU %s: reachable again (reset); checking its prepared claims", gpu.uuid)
                    self._on_gpu_back(gpu.index)
                continue
            if gpu.index not in self._lost:
                self._lost.add(gpu.index)
                log.warning("GPU %s: unreachable", gpu.uuid)
                metrics.record_health_event(gpu.uuid, "gpu_lost")
            now = time.time()
            self._record.record(GpuFault(gpu.uuid, "lost", first_seen=now, last_seen=now))

    def refresh(self) -> None:
        """Taints and health from the record as it is now; a failed publish is retried with backoff."""
        faults = self._record.read()
        now = time.time()
        self._board.publish(device_health(self._targets, faults, now, self._policy))
        taints = device_taints(self._targets, faults, now, self._policy)
        if taints == self._published or time.monotonic() < self._retry_at:
            return
        try:
            self._publish_taints(taints)
        except KubeError as err:
            log.warning("publishing device taints failed, retrying in %.0fs: %s", self._backoff, err)
            self._retry_at = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, MAX_BACKOFF_S)
            return
        self._backoff, self._retry_at = 1.0, 0.0
        log.info("device taints in force: %s", ", ".join(sorted(taints)) or "none")
        metrics.set_taints_in_force(Counter(t.effect for device in taints.values() for t in device))
        self._published = taints
