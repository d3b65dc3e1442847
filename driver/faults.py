"""Fault injection for crash-safety tests: FGPU_CRASH_AT=<step> kills the plugin with SIGKILL at
that step of prepare or unprepare, after the step's journal entry and before what follows."""

from __future__ import annotations

import os
import signal

CRASH_ENV = "FGPU_CRASH_AT"
PREPARE_STEPS = (
    "prepare:journaled",
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
