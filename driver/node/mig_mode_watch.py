"""The GPUs' MIG modes, read again while the plugin runs, so the slices follow what the GPUs can
offer. Where a MIG mode switch waits for a GPU reset (Ampere), a GPU offers only what its current
mode allows (driver/inventory/offers.py: offer_limit); an admin may switch the mode and reset the GPU while
the plugin runs, so the MIG mode is read again every few seconds and the slices follow within one
round. Each GPU that offers less than configured is named once at start, and again when that
changes."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import pynvml

from driver.inventory.devices import Inventory
from driver.inventory.discovery import GpuInfo, discover_gpus, with_current_mig_mode
from driver.inventory.offers import node_inventory, shortfall
from driver.inventory.sharing import SharingConfig
from driver.kube.errors import KubeError
from driver.node.background import BackgroundWorker
from driver.nvml.session import NvmlSession

log = logging.getLogger(__name__)
MIG_MODE_POLL_S = 5.0  # a GetMigMode per MIG-capable GPU: cheap, and a reset takes longer


class MigModeWatch(BackgroundWorker):
    thread_name = "mig-mode-watch"

    def __init__(
        self,
        session: NvmlSession,
        gpus: list[GpuInfo],
        sharing: SharingConfig,
        publish: Callable[[Inventory], None],
        interval_s: float = MIG_MODE_POLL_S,
    ) -> None:
        super().__init__()
        self._session, self._sharing, self._publish, self._interval_s = session, sharing, publish, interval_s
        self._gpus = gpus
        self._published = node_inventory(gpus, sharing)  # what the publisher was created with
        self._lock = threading.Lock()  # check() runs here and, after a driver reload, in the health monitor

    def log_shortfalls(self) -> None:
        for gpu in self._gpus:
            reason = shortfall(gpu, self._sharing)
            if reason is not None:
                log.info("%s", reason)

    def rediscover(self) -> None:
        """The GPUs read afresh, after the driver was loaded again: its version is in the slices'
        attributes, published as check() publishes. The same GPUs, or a restart is needed."""
        with self._lock:
            gpus = discover_gpus(self._session)
            if [g.uuid for g in gpus] != [g.uuid for g in self._gpus]:
                raise RuntimeError("the driver loaded again reports other GPUs; restart the plugin to publish them")
            self._gpus = gpus
            self._check()

    def check(self) -> None:
        """Read the MIG modes; publish the inventory when what the GPUs can offer changed (again
        after a failed write)."""
        with self._lock:
            self._check()

    def _check(self) -> None:
        gpus = with_current_mig_mode(self._session, self._gpus)
        for old, new in zip(self._gpus, gpus, strict=True):
            before, now = shortfall(old, self._sharing), shortfall(new, self._sharing)
            if now != before:
                mode = "on" if new.mig_enabled else "off"
                log.info("GPU %d: MIG mode is %s now; %s", new.index, mode, now or "it offers all it is configured to")
        self._gpus = gpus
        inventory = node_inventory(gpus, self._sharing)
        if inventory == self._published:
            return
        try:
            self._publish(inventory)
        except KubeError as err:
            log.warning("publishing the GPUs' new offer failed, retrying in %.0fs: %s", self._interval_s, err)
            return
        self._published = inventory

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.check()
            except pynvml.NVMLError as err:  # the driver unloaded: the health monitor says so
                log.warning("reading the GPUs' MIG mode failed (%s); going on", err)
            except Exception:
                log.exception("reading the GPUs' MIG mode failed; going on")
