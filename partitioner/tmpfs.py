"""tmpfs mounts the partitioners make on the host (each MPS daemon's shm and pipe directory), with
util-linux's mount.

Python has no mount(2); the mount tools also give the errors an operator knows.
"""

from __future__ import annotations

import os
from pathlib import Path

from partitioner.runner import ToolError, ToolRunner

# What /dev/shm usually has; clients and the MPS server only map files there.
OPTIONS = "nosuid,nodev,noexec"
SHM_MODE = "1777"


def is_mounted(path: Path) -> bool:
    return os.path.ismount(path)


def mount_tmpfs(runner: ToolRunner, path: Path, size_bytes: int, source: str, mode: str = SHM_MODE) -> None:
    """Mount a tmpfs of at most `size_bytes` at `path` (a directory), its root with `mode` (octal).
    A refusal (no CAP_SYS_ADMIN in the host's mount namespace) is one line that says so."""
    options = f"size={size_bytes},mode={mode},{OPTIONS}"
    try:
        runner.run("mount", "-t", "tmpfs", "-o", options, source, str(path))
    except ToolError as err:
        reason = err.output.splitlines()[0] if err.output else str(err)
        raise ToolError(
            f"cannot mount a tmpfs at {path} ({reason}); the plugin needs CAP_SYS_ADMIN in the host's mount namespace"
        ) from err


def unmount(runner: ToolRunner, path: Path) -> None:
    runner.run("umount", str(path))
