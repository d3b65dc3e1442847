"""The prepared-claims checkpoint file: versioned, checksummed, atomic, and locked.

Every change runs under an exclusive file lock and re-reads the file first (a parse is cached
while the file's bytes are unchanged), so two plugin instances on one node (a rolling update) serialise
on it instead of overwriting each other. Concurrent changes are written together (group commit). A
write goes to a temp file that is fsynced and renamed over the old one, then the directory is
fsynced. A file that is corrupt or of an unknown version is moved aside with a clear log line
and the plugin starts empty: it never crash-loops on its own state.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from driver.common.files import atomic_write, locked

log = logging.getLogger(__name__)

CHECKPOINT_VERSION = 1
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


def current_boot_id() -> str:
    try:
        return BOOT_ID_PATH.read_text().strip()
    except OSError:
        return "unknown"


@dataclass
class CheckpointData:
    """The file's payload: prepared claims keyed by UID, as JSON-ready dicts."""

    boot_id: str
    claims: dict[str, dict[str, Any]] = field(default_factory=dict)


def _checksum(payload: dict[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


class _UnusableError(ValueError):
    """The file is corrupt or of another version: it is moved aside."""


@dataclass
class _Change:
    """A queued mutation and its outcome (group commit)."""

    mutate: Callable[[CheckpointData], None]
    done: bool = False
    error: BaseException | None = None


class Checkpoint:
    def __init__(self, path: Path, boot_id: str | None = None) -> None:
        self.path = path
        self._lock_path = path.with_name(path.name + ".lock")
        self._boot_id = boot_id or current_boot_id()
        self._writer = threading.Lock()  # one thread writes at a time, for all queued changes
        self._queue_lock = threading.Lock()
        self._queue: list[_Change] = []
        self._cache: tuple[bytes, CheckpointData] | None = None  # the file's bytes and their parse
        path.parent.mkdir(parents=True, exist_ok=True)

    def read(self) -> CheckpointData:
        """The current data. Do not mutate it: use apply()."""
        with locked(self._lock_path, exclusive=False):
            return self._load()

    def apply(self, mutate: Callable[[CheckpointData], None]) -> None:
        """Apply a change durably. Changes queued by concurrent callers while a write is in
        flight are written together in the next write: one fsync for the whole group."""
        change = _Change(mutate)
        with self._queue_lock:
            self._queue.append(change)
        with self._writer:
            if not change.done:
                with self._queue_lock:
                    batch, self._queue = self._queue, []
                self._write(batch)
        if change.error is not None:
            raise change.error

    def _write(self, batch: list[_Change]) -> None:
        try:
            with locked(self._lock_path, exclusive=True):
                current = self._load()
                data = CheckpointData(boot_id=current.boot_id, claims=dict(current.claims))
                for change in batch:
                    change.mutate(data)
                if data.claims != current.claims or data.boot_id != self._boot_id:
                    data.boot_id = self._boot_id
                    self._store(data)
        except BaseException as err:
            for change in batch:
                change.error = err
            raise
        finally:
            for change in batch:
                change.done = True

    def _load(self) -> CheckpointData:
        """Parse the file, or reuse the last parse while its bytes are unchanged (the hot path:
        every prepare reads the checkpoint). The bytes decide, not the file's stat: with two
        instances writing, a new file can get a freed inode back within one timestamp tick."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return CheckpointData(boot_id=self._boot_id)
        cached = self._cache
        if cached is not None and cached[0] == raw:
            return cached[1]
        try:
            data = self._parse(raw)
        except _UnusableError as err:
            return self._reset(str(err))
        self._cache = (raw, data)
        return data

    def _parse(self, raw: bytes) -> CheckpointData:
        try:
            document = json.loads(raw)
            version = document["version"]
            payload = {"version": version, "bootId": document["bootId"], "claims": document["claims"]}
        except (ValueError, KeyError, TypeError) as err:
            raise _UnusableError(f"unreadable ({err})") from err
        if version != CHECKPOINT_VERSION:
            raise _UnusableError(f"version {version} is not the version {CHECKPOINT_VERSION} this fgpu understands")
        if document.get("checksum") != _checksum(payload):
            raise _UnusableError("checksum mismatch (the file was modified or partly written)")
        if payload["bootId"] != self._boot_id:
            log.warning(
                "checkpoint %s was written during boot %s, this is boot %s: claims prepared before the "
                "reboot are kept and their CDI specs are rewritten when kubelet prepares them again",
                self.path,
                payload["bootId"],
                self._boot_id,
            )
        return CheckpointData(boot_id=payload["bootId"], claims=payload["claims"])

    def _reset(self, reason: str) -> CheckpointData:
        aside = self.path.with_name(f"{self.path.name}.bad-{int(time.time())}")
        with contextlib.suppress(FileNotFoundError):  # another instance moved it first
            os.replace(self.path, aside)
        log.error("checkpoint %s is %s; moved it to %s and starting with no prepared claims", self.path, reason, aside)
        return CheckpointData(boot_id=self._boot_id)

    def _store(self, data: CheckpointData) -> None:
        payload = {"version": CHECKPOINT_VERSION, "bootId": data.boot_id, "claims": data.claims}
        document = {**payload, "checksum": _checksum(payload)}
        raw = json.dumps(document, sort_keys=True).encode()
        atomic_write(self.path, raw, durable=True)
        self._cache = (raw, data)
