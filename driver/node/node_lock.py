"""Claim operations of all plugin instances on a node, one instance at a time.

During a rolling update two instances share the state dir and kubelet may call either one: a
claim prepared through one can be unprepared through the other, or both may work on one GPU at
once (two MPS shares, one daemon). The driver's own locks are threading locks, good for one
process only, and its start-up sweeps read the checkpoint and then act on the GPUs. So each claim
operation, each reconciler unprepare and the start-up recovery hold `<state-dir>/claims.lock`
(flock), and read the checkpoint afresh from disk once they hold it (the driver reads it at the
start of every operation; checkpoint.py re-parses whenever the bytes changed).

Like upstream's kubeletplugin helper (Serialize with RollingUpdate) the lock spans instances; unlike
it, one instance's threads share it: their operations keep the driver's per-claim and per-GPU
locking and run in parallel. Kubelet sends its calls to the newest instance, so the other one
holds the lock only for the calls it already had in flight.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from driver.claims.refs import ClaimRef
from driver.kube import JsonObject
from driver.node.prepare import Driver, PrepareResult

LOCK_FILE = "claims.lock"
T = TypeVar("T")


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


class SerializedDriver(Driver):
    """The driver, each of whose claim operations holds the node's claim lock."""

    def __init__(self, node_lock: NodeClaimLock, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._node_lock = node_lock

    def _serialized(self, refs: list[ClaimRef], operation: Callable[[list[ClaimRef]], T]) -> T:
        if not refs:  # no claim, nothing shared: the liveness self-probe must not wait on the other instance
            return operation(refs)
        with self._node_lock.held():
            return operation(refs)

    def prepare(self, refs: list[ClaimRef]) -> dict[str, PrepareResult]:
        return self._serialized(refs, super().prepare)

    def unprepare(self, refs: list[ClaimRef]) -> dict[str, str]:
        return self._serialized(refs, super().unprepare)

    def refresh_status(self, ref: ClaimRef, claim: JsonObject) -> None:
        """The other instance may be unpreparing the claim: its record is read under the node's lock."""
        with self._node_lock.held():
            super().refresh_status(ref, claim)

    def recover(self) -> None:
        """The sweeps act on what the checkpoint did not list: no other instance may add to it meanwhile."""
        with self._node_lock.held():
            super().recover()
