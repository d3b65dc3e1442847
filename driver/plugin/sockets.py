"""Unix socket paths: validation, stale-file removal and clean-up."""

from __future__ import annotations

import os
import stat
from pathlib import Path

MAX_SOCKET_PATH = 107  # sun_path is 108 bytes including the terminating NUL


class SocketPathError(ValueError):
    pass


def prepare_socket_path(path: Path) -> str:
    """Create the parent directory, remove a stale socket, and return the gRPC address."""
    if len(str(path).encode()) > MAX_SOCKET_PATH:
        raise SocketPathError(f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes")
    if path.name.startswith("."):
        raise SocketPathError(f"socket {path} starts with '.', which kubelet ignores")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(mode):
            raise SocketPathError(f"{path} exists and is not a socket; refusing to remove it")
        path.unlink()
    return f"unix://{path}"


def remove_socket(path: Path) -> None:
    try:
        if stat.S_ISSOCK(path.lstat().st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
