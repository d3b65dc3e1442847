"""Files that a reader must never see half-written, and files that processes share under a lock.

`atomic_write` writes a temp file next to the target and renames it over the target: a reader (a
container runtime reading a CDI spec, another plugin instance, a running container that
bind-mounts the file) sees the old file or the new one, never part of one. With `durable=True` the
new file is also on disk when it returns, through a power loss: the temp file is fsynced before the
rename and the directory after it. Only what a restarted plugin trusts to undo its work needs that
(the prepared-claims checkpoint); the rest is rewritten at start or by the next write.

`locked` holds an flock on a side file (`<name>.lock`): shared to read the file, exclusive to
read, change and write it again; two plugin instances on a node (a rolling update) and `fgpu
health clear` use it so that no change overwrites another.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from collections.abc import Iterator
from pathlib import Path


def atomic_write(path: Path, data: bytes, *, durable: bool, mode: int | None = None) -> None:
    """Replace `path` by a file holding `data`. `mode`: its permission bits exactly; by default
    those a new file gets (0o666 less the umask)."""
    # A name of its own per write (concurrent writers never share one), hidden and not ending in the
    # target's suffix: nobody who lists the directory by suffix (CDI specs: *.json) takes it for one.
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            if mode is not None:
                os.fchmod(handle.fileno(), mode)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    """The rename itself is on disk once the directory is."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked(lock_path: Path, *, exclusive: bool) -> Iterator[None]:
    """Hold an flock on `lock_path` (created if missing): shared or exclusive, across processes."""
    with open(lock_path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
