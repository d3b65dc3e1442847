"""Unix socket paths: their names, validation, stale-file removal, and telling our own socket
file from one that replaced it."""

from __future__ import annotations

import base64
import hashlib
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

# sun_path is 108 bytes with its terminating NUL, but gRPC's C core refuses a unix: path of more
# than 105 (measured with grpcio 1.85: 106 fails). Upstream's Go helper compares against 108, so a
# path of 106 to 108 bytes is named differently here than there (kubelet finds either).
MAX_SOCKET_PATH = 105
# Upstream's RollingUpdateRegistrarSocketFile: how much of each SHA-256 digest goes into a name.
UID_HASH_BYTES = 8
DRIVER_UID_HASH_BYTES = 16


class SocketPathError(ValueError):
    pass


def _digest(text: str, length: int) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()[:length]).rstrip(b"=").decode()


def rolling_update_registrar_socket_file(registrar_dir: Path, driver_name: str, pod_uid: str) -> str:
    """The registration socket's name of the instance in pod `pod_uid`, as upstream's
    kubeletplugin.RollingUpdateRegistrarSocketFile names it: the first of `<driver>-<uid>-reg.sock`,
    `<driver>-<hash(uid)>-reg.sock`, `dra-<hash(driver, uid)>-reg.sock` whose path fits."""
    driver_and_uid = f"{driver_name}\0{pod_uid}"
    candidates = (
        f"{driver_name}-{pod_uid}-reg.sock",
        f"{driver_name}-{_digest(pod_uid, UID_HASH_BYTES)}-reg.sock",
        f"dra-{_digest(driver_and_uid, DRIVER_UID_HASH_BYTES)}-reg.sock",
    )
    for name in candidates:
        if len(str(registrar_dir / name).encode()) <= MAX_SOCKET_PATH:
            return name
    return candidates[-1]


def rolling_update_dra_socket_file(plugin_dir: Path, pod_uid: str) -> str:
    """The DRA socket's name of the instance in pod `pod_uid`: `dra-<uid>.sock` as upstream names
    it, or `dra-<hash(uid)>.sock` where that path would not fit."""
    name = f"dra-{pod_uid}.sock"
    if len(str(plugin_dir / name).encode()) <= MAX_SOCKET_PATH:
        return name
    return f"dra-{_digest(pod_uid, UID_HASH_BYTES)}.sock"


def accepts_connections(path: Path) -> bool:
    """A live listener, not a socket file left by a killed process."""
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def check_socket_path(path: Path) -> None:
    if len(str(path).encode()) > MAX_SOCKET_PATH:
        raise SocketPathError(
            f"socket path {path} is {len(str(path).encode())} bytes; gRPC allows at most {MAX_SOCKET_PATH}"
        )


def prepare_socket_path(path: Path) -> str:
    """Create the parent directory, remove a stale socket, and return the gRPC address. Only this
    instance's own name is replaced: with a pod UID no other instance uses it."""
    check_socket_path(path)
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


@dataclass(frozen=True)
class BoundSocket:
    """A socket file as this process bound it. Kubelet finds us by path, so a file deleted or
    replaced (by another instance or a clean-up) means kubelet no longer reaches this process."""

    path: Path
    device: int
    inode: int

    @classmethod
    def at(cls, path: Path) -> BoundSocket:
        """Record the socket just bound at `path`."""
        info = path.lstat()
        if not stat.S_ISSOCK(info.st_mode):
            raise SocketPathError(f"{path} is not a socket")
        return cls(path, info.st_dev, info.st_ino)

    def problem(self) -> str:
        """Why the path no longer leads to this socket, or "" while it does."""
        try:
            info = self.path.lstat()
        except FileNotFoundError:
            return f"socket {self.path} was deleted"
        if (info.st_dev, info.st_ino) != (self.device, self.inode):
            return f"socket {self.path} was replaced by another file"
        return ""

    def remove(self) -> None:
        """Remove the file if it is still ours: never another instance's socket at our path."""
        if not self.problem():
            os.unlink(self.path)
