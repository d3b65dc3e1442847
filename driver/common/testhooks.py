"""Test hooks: places where a test, through an environment variable, makes the process crash, hold,
stop, or see another wall clock. Set by tests only; never set them in a deployment.

The hooks are an object, built once at process start from the environment (`from_environment`)
and handed to what has such a place. Without any of the variables below it is NO_TEST_HOOKS,
which does nothing and reads nothing: a deployment runs no test code at those places. The node
plugin builds its hooks with its settings (driver/node/settings.py) and hands them to the claim
preparer; partitioner/ never sees them: the preparer passes the MPS daemon's steps to
partitioner/mps.py as plain callbacks.

The node plugin's crash points (crash-safety tests), at a step of prepare or unprepare (`Step`),
after the step's journal entry and before what follows:
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
The controller's are handed to it likewise (driver/controller/settings.py): its wall clock
(driver/controller/clock.py) and its claim writer (driver/controller/writes.py) take them.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

log = logging.getLogger(__name__)

CRASH_ENV = "FGPU_CRASH_AT"
STALL_ENV = "FGPU_STALL_AT"
STALL_SECONDS_ENV = "FGPU_STALL_S"
CLOCK_OFFSET_ENV = "FGPU_TEST_CLOCK_OFFSET_S"
STOP_ENV = "FGPU_TEST_STOP_BEFORE"
HOOK_ENVS = (CRASH_ENV, STALL_ENV, STALL_SECONDS_ENV, CLOCK_OFFSET_ENV, STOP_ENV)


class Step(StrEnum):
    """A step of the node plugin's prepare or unprepare; its value is what FGPU_CRASH_AT and
    FGPU_STALL_AT name."""

    PREPARE_JOURNALED = "prepare:journaled"
    PARTITION_MADE = "prepare:partition-made"  # a share's MIG partition exists, its MPS daemon not started yet
    MPS_SHM_MOUNTED = "prepare:mps-shm-mounted"  # the GPU's MPS tmpfs is mounted, its daemon not started yet
    DEVICE_READY = "prepare:device-ready"
    CDI_WRITTEN = "prepare:cdi-written"
    PREPARE_COMPLETED = "prepare:completed"
    UNPREPARE_JOURNALED = "unprepare:journaled"
    MPS_DAEMON_STOPPED = "unprepare:mps-daemon-stopped"  # the MPS daemon has quit, its tmpfs is still mounted
    DEVICES_RELEASED = "unprepare:devices-released"
    CDI_REMOVED = "unprepare:cdi-removed"


PREPARE_STEPS = tuple(step for step in Step if step.startswith("prepare:"))
UNPREPARE_STEPS = tuple(step for step in Step if step.startswith("unprepare:"))


class TestHooks:
    """The places a test may act at. This base acts at none of them: it is production's
    (NO_TEST_HOOKS); EnvTestHooks acts where the environment says."""

    __test__ = False  # its name would otherwise make pytest take it for a test class
    clock_offset_s: float = 0.0  # how far this process's wall clock runs ahead

    def reached(self, step: Step) -> None:
        """The node plugin is at `step` of a prepare or unprepare."""

    def stop_before(self, write: str, claims: Iterable[str]) -> None:
        """The controller is about to send `write` ("ledger" or "status") for these claims
        ("<namespace>/<name>")."""


NO_TEST_HOOKS = TestHooks()


@dataclass
class EnvTestHooks(TestHooks):
    """What the environment's FGPU_* variables ask for, read when built (from_environment)."""

    crash_at: str = ""
    stall_at: str = ""
    stall_s: float = 10.0
    clock_offset_s: float = 0.0
    stop_at: str = ""  # "<ledger|status>:<namespace>/<name>"
    _stopped: bool = field(default=False, init=False)

    def reached(self, step: Step) -> None:
        if step == self.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.stall_at:
            log.warning("fault injection: holding %.0fs at %s", self.stall_s, step.value)
            time.sleep(self.stall_s)

    def stop_before(self, write: str, claims: Iterable[str]) -> None:
        if self.stop_at and not self._stopped and any(self.stop_at == f"{write}:{claim}" for claim in claims):
            self._stopped = True
            # To this thread: it stops before it returns. A signal to the process may be taken by
            # another thread first, and this one would send its write before the stop took hold.
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def from_environment(environ: Mapping[str, str] = os.environ) -> TestHooks:
    """The hooks the environment asks for; NO_TEST_HOOKS where it sets none of the variables."""
    if not any(environ.get(name) for name in HOOK_ENVS):
        return NO_TEST_HOOKS
    return EnvTestHooks(
        crash_at=environ.get(CRASH_ENV, ""),
        stall_at=environ.get(STALL_ENV, ""),
        stall_s=float(environ.get(STALL_SECONDS_ENV, "10")),
        clock_offset_s=float(environ.get(CLOCK_OFFSET_ENV) or 0),
        stop_at=environ.get(STOP_ENV, ""),
    )
