"""The GPUs' MIG modes, read again while the plugin runs, so the slices follow what the GPUs can
offer. Where a MIG mode switch waits for a GPU reset (Ampere), a GPU offers only what its current
mode allows (driver/offers.py: offer_limit); an admin may switch the mode and reset the GPU while
the plugin runs, so the MIG mode is read again every few seconds and the slices follow within one
round. Each GPU that offers less than configured is named once at start, and again when that
changes."""

from __future__ import annotations

import logging
from collections.abc import Callable

from driver.devices import Inventory
from driver.discovery import GpuInfo, with_current_mig_mode
from driver.kube import KubeError
from driver.node.background import BackgroundWorker
from driver.nvml.session import NvmlSession
from driver.offers import node_inventory, shortfall
from driver.sharing import SharingConfig

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

    def log_shortfalls(self) -> None:
        for gpu in self._gpus:
            reason = shortfall(gpu, self._sharing)
            if reason is not None:
                log.info("%s", reason)

    def check(self) -> None:
        """Read the MIG modes; publish the inventory when what the GPUs can offer changed (again
        after a failed write)."""
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
            except Exception:
                log.exception("reading the GPUs' MIG mode failed; going on")
