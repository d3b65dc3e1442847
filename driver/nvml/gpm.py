"""GPM (GPU Performance Monitoring; NVML on Hopper and newer, driver R520+): the SM utilisation of
each MIG GPU instance, which NVML's basic calls do not measure (utilisation is NOT_SUPPORTED on MIG
devices and in MIG mode, and no process is sampled there).

A GPM metric is computed between two samples, so the reader keeps each instance's last sample and
measures from it to the next one it takes, MIN_INTERVAL_S or more later; a read sooner gets the
last measurement (a scrape reads twice), an instance's first read None: not measured yet, as on
a GPU without GPM or where a GPM call fails (a vGPU guest may say it has GPM and fail to sample).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pynvml

log = logging.getLogger(__name__)

# NVML refreshes GPM counters every 100 ms: samples closer than that measure noise.
MIN_INTERVAL_S = 1.0
# What nvmlGpmQueryDeviceSupport raising means no GPM: an NVML older than GPM, or a GPU without it.
NO_GPM_ERRORS = frozenset({pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_NOT_SUPPORTED})


@dataclass(frozen=True)
class _Kept:
    """An instance's last sample: its GPU, when it was taken, and what was measured up to it."""

    gpu: int
    sample: Any
    taken_at: float
    percent: float | None  # None: its instance's first sample


class GpmReader:
    """The GPM samples of one NVML session: each GPU's support, and the last sample of each MIG
    device's GPU instance, by MIG UUID (a re-created instance has a new one, and counters of its
    own)."""

    def __init__(self, nvml: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self._nvml, self._clock = nvml, clock
        self._lock = threading.Lock()  # the metrics' sampler and scrapes read at once
        self._supported: dict[int, bool] = {}
        self._kept: dict[str, _Kept] = {}

    def instance_percent(self, index: int, handle: Any, gi_id: int, mig_uuid: str) -> float | None:
        """The SM utilisation of GPU instance gi_id of GPU `index` (its handle), in percent of the
        instance's SMs, from its last sample to now; None where not measured (the module's rules)."""
        with self._lock:
            if not self._supports(index, handle):
                return None
            now, kept = self._clock(), self._kept.get(mig_uuid)
            if kept is not None and now - kept.taken_at < MIN_INTERVAL_S:
                return kept.percent
            sample = None
            try:
                sample = self._nvml.nvmlGpmSampleAlloc()
                self._nvml.nvmlGpmMigSampleGet(handle, gi_id, sample)
                percent = None if kept is None else self._sm_util(kept.sample, sample)
            except pynvml.NVMLError as err:  # the kept sample stays: the next one measures from it
                if sample is not None:
                    self._nvml.nvmlGpmSampleFree(sample)
                log.debug("no GPM sample of GPU %d instance %d: %s", index, gi_id, err)
                return None
            if kept is not None:
                self._nvml.nvmlGpmSampleFree(kept.sample)
            self._kept[mig_uuid] = _Kept(index, sample, now, percent)
            return percent

    def keep_only(self, index: int, mig_uuids: Iterable[str]) -> None:
        """Free the samples of GPU `index`'s instances that are gone."""
        live = set(mig_uuids)
        with self._lock:
            for mig_uuid in [u for u, kept in self._kept.items() if kept.gpu == index and u not in live]:
                self._nvml.nvmlGpmSampleFree(self._kept.pop(mig_uuid).sample)

    def forget(self) -> None:
        """Drop everything (a driver loaded again: its counters start over, its GPUs may differ)."""
        with self._lock:
            for kept in self._kept.values():
                with contextlib.suppress(pynvml.NVMLError):  # freeing is all that is left to do
                    self._nvml.nvmlGpmSampleFree(kept.sample)
            self._kept.clear()
            self._supported.clear()

    def _supports(self, index: int, handle: Any) -> bool:
        if index not in self._supported:
            try:
                self._supported[index] = bool(self._nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
            except pynvml.NVMLError as err:
                if err.value not in NO_GPM_ERRORS:
                    log.debug("GPM support of GPU %d unknown: %s", index, err)
                    return False  # asked again at the next read
                self._supported[index] = False
        return self._supported[index]

    def _sm_util(self, first: Any, second: Any) -> float | None:
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = 1
        request.sample1, request.sample2 = first, second
        request.metrics[0].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL
        self._nvml.nvmlGpmMetricsGet(request)
        metric = request.metrics[0]
        if metric.nvmlReturn != pynvml.NVML_SUCCESS or math.isnan(metric.value):
            return None
        return min(100.0, max(0.0, metric.value))
