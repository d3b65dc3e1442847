"""Fault injection for crash-safety tests: FGPU_CRASH_AT=<step> kills the plugin with SIGKILL at
that step of prepare or unprepare, after the step's journal entry and before what follows;
FGPU_STALL_AT=<step> with FGPU_STALL_S=<seconds> holds it there instead (a slow prepare, for
tests of what kubelet does meanwhile)."""

from __future__ import annotations

import logging
import os
import signal
import time

log = logging.getLogger(__name__)
CRASH_ENV = "FGPU_CRASH_AT"
STALL_ENV = "FGPU_STALL_AT"
STALL_SECONDS_ENV = "FGPU_STALL_S"
PREPARE_STEPS = (
    "prepare:journaled",
    "prepare:partition-made",  # a share's MIG partition exists, its MPS daemon not started yet
    "prepare:mps-shm-mounted",  # the GPU's MPS tmpfs is mounted, its daemon not started yet
    "prepare:device-ready",
    "prepare:cdi-written",
    "prepare:completed",
)
UNPREPARE_STEPS = (
    "unprepare:journaled",
    "unprepare:mps-daemon-stopped",  # the MPS daemon has quit, its tmpfs is still mounted
    "unprepare:devices-released",
    "unprepare:cdi-removed",
)


def crash_point(step: str) -> None:
    if os.environ.get(CRASH_ENV) == step:
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get(STALL_ENV) == step:
        seconds = float(os.environ.get(STALL_SECONDS_ENV, "10"))
        log.warning("fault injection: holding %.0fs at %s", seconds, step)
        time.sleep(seconds)
