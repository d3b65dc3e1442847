"""Test hooks of the controller, set by the end-to-end tests only; never set them in a deployment.

- FGPU_TEST_CLOCK_OFFSET_S=<seconds>: this process's wall clock runs that far ahead (or behind,
  if negative): a replica whose clock is wrong.
- FGPU_TEST_STOP_BEFORE=<ledger|status>:<namespace>/<name>: the process stops itself with SIGSTOP
  (as a paused VM or a debugger would) right before the ledger write that records that claim, or
  before its status write, after the leadership check that precedes the write; the test resumes it
  with SIGCONT. Once per process."""

from __future__ import annotations

import os
import signal
import threading

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
