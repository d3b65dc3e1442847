"""Claim operations of all plugin instances on a node, one instance at a time (NodeClaimLock).

During a rolling update two instances share the state dir and kubelet may call either one: a
claim prepared through one can be unprepared through the other, or both may work on one GPU at
once (two MPS shares, one daemon). The preparer's own locks are threading locks, good for one
process only, and its start-up sweeps read the checkpoint and then act on the GPUs. So each claim
operation, each reconciler unprepare and the start-up recovery hold `<state-dir>/claims.lock`
(flock), and read the checkpoint afresh from disk once they hold it (the preparer reads it at the
start of every operation; checkpoint.py re-parses whenever the bytes changed).

Like upstream's kubeletplugin helper (Serialize with RollingUpdate) the lock spans instances; unlike
it, one instance's threads share it: their operations keep the preparer's per-claim and per-GPU
locking (prepare.py) and run in parallel. Kubelet sends its calls to the newest instance, so the
other one holds the lock only for the calls it already had in flight.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE = "claims.lock"


class NodeClaimLock:
    """Held by at most one process on the node, by any number of that process's threads."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / LOCK_FILE
        self._guard = threading.Lock()
        self._holders = 0
        self._fd: int | None = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self._acquire()
        try:
            yield
        finally:
            self._release()

    def _acquire(self) -> None:
        # The guard stays taken while flock waits: this process's other threads need the same lock.
        with self._guard:
            if self._holders == 0:
                fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except BaseException:
                    os.close(fd)
                    raise
                self._fd = fd
            self._holders += 1

    def _release(self) -> None:
        with self._guard:
            self._holders -= 1
            if self._holders == 0 and self._fd is not None:
                os.close(self._fd)  # drops the flock
                self._fd = None
