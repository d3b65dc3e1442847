"""Which plugin instance owns an in-flight journal record.

Each running instance holds an exclusive lock on `<state-dir>/instances/<id>.lock`. During a
rolling update two instances share the state dir (and not a PID namespace), so an instance
recovering at start-up asks the lock, not a PID, whether a record's owner still runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from pathlib import Path


class InstanceLock:
    def __init__(self, state_dir: Path) -> None:
        self._dir = state_dir / "instances"
        self._dir.mkdir(parents=True, exist_ok=True)
        self.id = uuid.uuid4().hex[:12]
        self._fd = os.open(self._dir / f"{self.id}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def owner_alive(self, owner: str) -> bool:
        """True while the instance `owner` runs (it holds its lock); cleans up after dead ones."""
        if owner == self.id:
            return True
        path = self._dir / f"{owner}.lock"
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return False

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self._dir / f"{self.id}.lock").unlink()
        os.close(self._fd)
