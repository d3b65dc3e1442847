"""Which plugin instance owns an in-flight journal record, and whose sockets are left over.

Each running instance holds an exclusive lock on `<state-dir>/instances/<id>.lock`. During a
rolling update two instances share the state dir (and not a PID namespace), so an instance
recovering at start-up asks the lock, not a PID, whether a record's owner still runs.
Each also lists the sockets it bound in `<id>.sockets`: a killed instance cannot remove them, and
kubelet keeps a registration whose socket file exists, so the next instance removes them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import uuid
from pathlib import Path

from driver.common.files import atomic_write
from driver.node.sockets import BoundSocket, accepts_connections

log = logging.getLogger(__name__)


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

    def record_sockets(self, sockets: list[BoundSocket]) -> None:
        """Name the socket files this instance bound (with their inodes: a later instance of the same
        pod binds the same paths, and those must stay)."""
        entries = [{"path": str(s.path), "device": s.device, "inode": s.inode} for s in sockets]
        atomic_write(self._sockets_record(self.id), json.dumps(entries).encode(), durable=False)

    def remove_dead_instances_sockets(self) -> list[Path]:
        """Remove the sockets of instances that no longer run, where the files are still theirs: the
        same inode (numbers are reused, so also) and nobody listening (a path bound again listens)."""
        removed = []
        for record in sorted(self._dir.glob("*.sockets")):
            owner = record.name.removesuffix(".sockets")
            if self.owner_alive(owner):
                continue
            try:
                entries = json.loads(record.read_text())
            except (OSError, ValueError) as err:
                log.warning("ignoring unreadable socket record %s: %s", record, err)
                entries = []
            for entry in entries:
                bound = BoundSocket(Path(entry["path"]), entry["device"], entry["inode"])
                if not bound.problem() and not accepts_connections(bound.path):
                    bound.remove()
                    removed.append(bound.path)
                    log.info("removed socket %s of stopped instance %s", bound.path, owner)
            record.unlink(missing_ok=True)
        return removed

    def _sockets_record(self, owner: str) -> Path:
        return self._dir / f"{owner}.sockets"

    def release(self) -> None:
        """After a clean stop (its sockets removed): nothing of this instance is left to recover."""
        self._sockets_record(self.id).unlink(missing_ok=True)
        with contextlib.suppress(FileNotFoundError):
            (self._dir / f"{self.id}.lock").unlink()
        os.close(self._fd)
