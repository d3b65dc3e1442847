"""Test hooks: places where a test, through an environment variable, makes the process crash, hold,
stop, or see another wall clock. Set by tests only; never set them in a deployment.

The node plugin's crash points (crash-safety tests), at a step of prepare or unprepare (the steps
below), after the step's journal entry and before what follows:
- FGPU_CRASH_AT=<step>: the plugin kills itself with SIGKILL there.
- FGPU_STALL_AT=<step> with FGPU_STALL_S=<seconds>: it holds there instead (a slow prepare, for
  tests of what kubelet does meanwhile).

The controller's (end-to-end tests):
- FGPU_TEST_CLOCK_OFFSET_S=<seconds>: this process's wall clock runs that far ahead (or behind,
  if negative): a replica whose clock is wrong.
- FGPU_TEST_STOP_BEFORE=<ledger|status>:<namespace>/<name>: the process stops itself with SIGSTOP
  (as a paused VM or a debugger would) right before the ledger write that records that claim, or
  before its status write, after the leadership check that precedes the write; the test resumes it
  with SIGCONT. Once per process.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)

# --- the node plugin's crash points ---------------------------------------------------------------

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


# --- the controller's clock and stop points -------------------------------------------------------

CLOCK_OFFSET_ENV = "FGPU_TEST_CLOCK_OFFSET_S"
STOP_ENV = "FGPU_TEST_STOP_BEFORE"
_stopped = False


def clock_offset_s() -> float:
    return float(os.environ.get(CLOCK_OFFSET_ENV) or 0)


def stop_point(step: str, *claims: str) -> None:
    global _stopped
    target = os.environ.get(STOP_ENV)
    if target and not _stopped and any(target == f"{step}:{claim}" for claim in claims):
        _stopped = True
        # To this thread: it stops before it returns. A signal to the process may be taken by
        # another thread first, and this one would send its write before the stop took hold.
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
