"""How claim operations are kept apart: within the plugin, one operation per claim and one per GPU
at a time (KeyedLocks); across the plugin instances of a node, one instance at a time (NodeClaimLock).

A claim's lock stays while any thread holds or waits for it, and goes when none does: were it
dropped earlier, a thread waiting on the old lock and a newcomer with a new one could work on the
same claim at once.

During a rolling update two instances share the state dir and kubelet may call either one: a
claim prepared through one can be unprepared through the other, or both may work on one GPU at
once (two MPS shares, one daemon). The preparer's own locks are threading locks, good for one
process only, and its start-up sweeps read the checkpoint and then act on the GPUs. So each claim
operation, each reconciler unprepare and the start-up recovery hold `<state-dir>/claims.lock`
(flock), and read the checkpoint afresh from disk once they hold it (the preparer reads it at the
start of every operation; checkpoint.py re-parses whenever the bytes changed).

Like upstream's kubeletplugin helper (Serialize with RollingUpdate) the lock spans instances; unlike
it, one instance's threads share it: their operations keep the preparer's per-claim and per-GPU
locking (prepare.py, partition_use.py) and run in parallel. Kubelet sends its calls to the newest instance, so the
other one holds the lock only for the calls it already had in flight.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOCK_FILE = "claims.lock"


@dataclass
class _Entry:
    lock: AbstractContextManager[Any]
    users: int = 0  # threads that hold the lock or wait for it


class KeyedLocks:
    """A lock per key ("claim/<uid>", "gpu/<index>"), made when a thread first wants it and dropped
    once no thread holds or waits for it, so that all threads working on one key at one time share
    one lock and the table keeps only keys in use."""

    def __init__(self, new_lock: Callable[[], AbstractContextManager[Any]] = threading.Lock) -> None:
        """`new_lock`: makes each key's lock (a test passes one that reports a thread waiting)."""
        self._guard = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._new_lock = new_lock

    @contextlib.contextmanager
    def held(self, key: str) -> Iterator[None]:
        with self._guard:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry(self._new_lock())
            entry.users += 1  # counted before it waits: the entry cannot go while this thread waits
        try:
            with entry.lock:
                yield
        finally:
            with self._guard:
                entry.users -= 1
                if entry.users == 0:
                    del self._entries[key]

    def in_use(self) -> set[str]:
        """The keys some thread holds or waits for."""
        with self._guard:
            return set(self._entries)


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
