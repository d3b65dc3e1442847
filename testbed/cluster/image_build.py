"""The fgpu image for the test bed, built from the repository's Dockerfile without a registry or a
daemon: buildah (Debian's package) runs the Dockerfile as it is, with `BASE_IMAGE` a base made by
mmdebstrap from Debian's archive (python3, its venv module, util-linux), and writes a docker-archive
that `ctr images import` names from its RepoTags.

    python -m testbed.cluster.image_build [--name fgpu.test/fgpu:dev]   # prints the archive's path

The archive is cached under ~/.cache/fgpu/images with a stamp of its inputs (the Dockerfile, what
it copies, the base's package list and the image name): an unchanged build costs a hash. buildah
keeps its storage (vfs driver, no overlay mounts) under the cache too, removed after each build, as
are the two system directories it creates regardless (SYSTEM_DIRS).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fgpu" / "images"
IMAGE = "fgpu.test/fgpu:dev"
BASE_NAME = "localhost/fgpu-base:bookworm"
SUITE = "bookworm"  # Debian 12: python3 is 3.11, what pyproject.toml asks for
# What the base has beyond minbase: Python with venv (ensurepip), TLS roots for the API server's
# clients, util-linux and mount (the MPS host service).
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "util-linux", "mount")
HOST_TOOLS = {"buildah": "buildah", "mmdebstrap": "mmdebstrap"}  # command -> Debian package
# The Dockerfile's COPY sources (see .dockerignore): a change in any of them changes the image.
CONTEXT = ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md", "driver", "partitioner")
BUILD_TIMEOUT_S = 1200
# buildah (containers/image and its network setup) creates these whatever --root says: a blob info
# cache and a network config dir. Removed after a build unless they were there before.
SYSTEM_DIRS = (Path("/var/lib/containers"), Path("/run/containers"))
# The host's trust settings, mounted into the build's RUN steps only (never committed to a layer):
# where egress goes through a TLS-inspecting proxy, pip in the build must trust what the host does.
HOST_TRUST = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pip.conf")


class ImageBuildError(RuntimeError):
    pass


def _run(argv: Sequence[str], timeout_s: float = BUILD_TIMEOUT_S, **kwargs: object) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False, **kwargs)
    if done.returncode != 0:
        raise ImageBuildError(f"{' '.join(argv[:3])} ... failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done.stdout


def ensure_host_tools() -> None:
    """buildah and mmdebstrap from Debian, installed like build.sh installs the node's packages."""
    missing = [package for command, package in HOST_TOOLS.items() if shutil.which(command) is None]
    if missing:
        log.info("installing %s ...", " ".join(missing))
        _run(["apt-get", "update", "-qq"])
        _run(["apt-get", "install", "-y", "-qq", *missing], env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


# --- inputs and stamps --------------------------------------------------------------------------


def _context_files(root: Path) -> Iterator[Path]:
    for name in CONTEXT:
        path = root / name
        if path.is_file():
            yield path
        else:
            yield from sorted(
                p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
            )


def image_stamp(name: str, root: Path = ROOT) -> str:
    """A digest of everything the image is made of: name, base packages, Dockerfile and context."""
    digest = hashlib.sha256(f"{name}\n{SUITE}\n{' '.join(BASE_PACKAGES)}\n".encode())
    for path in _context_files(root):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _fresh(artifact: Path, stamp: str) -> bool:
    stamp_file = artifact.with_name(artifact.name + ".stamp")
    return artifact.is_file() and stamp_file.is_file() and stamp_file.read_text() == stamp


def _mark(artifact: Path, stamp: str) -> None:
    # Written after the artifact is in place: a crash in between costs a rebuild, never a stale hit.
    artifact.with_name(artifact.name + ".stamp").write_text(stamp)


# --- the base: a Debian root file system --------------------------------------------------------


def base_rootfs(cache: Path = CACHE) -> Path:
    """A tar of a minimal Debian with BASE_PACKAGES, without docs, man pages or apt lists."""
    out = cache / f"fgpu-base-{SUITE}.tar"
    stamp = hashlib.sha256(f"{SUITE} {' '.join(BASE_PACKAGES)}".encode()).hexdigest()[:16]
    if _fresh(out, stamp):
        return out
    cache.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial.tar")
    log.info("making the base image's root file system (Debian %s) ...", SUITE)
    _run([
        "mmdebstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
        "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
        "--dpkgopt=path-exclude=/usr/share/locale/*", "--dpkgopt=path-include=/usr/share/doc/*/copyright",
        "--customize-hook=rm -rf \"$1\"/var/lib/apt/lists/* \"$1\"/var/cache/apt/*",
        SUITE, str(partial),
    ])  # fmt: skip
    os.replace(partial, out)
    _mark(out, stamp)
    return out


# --- buildah --------------------------------------------------------------------------------------


class Buildah:
    """buildah with its storage in a directory of ours (vfs: plain copies, no mounts left behind)
    and chroot isolation (no user namespaces or runtime needed for RUN)."""

    def __init__(self, storage: Path) -> None:
        self.storage = storage
        self.env = {**os.environ, "BUILDAH_ISOLATION": "chroot", "STORAGE_DRIVER": "vfs"}

    def __call__(self, *args: str, cwd: Path | None = None) -> str:
        flags = [f"--root={self.storage / 'root'}", f"--runroot={self.storage / 'run'}", "--storage-driver=vfs"]
        return _run(["buildah", *flags, *args], env=self.env, cwd=cwd)

    def import_rootfs(self, rootfs: Path, name: str) -> None:
        container = self("from", "--pull=never", "scratch").strip()
        try:
            self("add", container, str(rootfs), "/")
            self("commit", "--quiet", container, name)
        finally:
            self("rm", container)

    def remove_storage(self) -> None:
        if self.storage.exists():
            # buildah's own cleanup first: containers and their chroot mounts, then the files.
            subprocess.run(["buildah", f"--root={self.storage / 'root'}", f"--runroot={self.storage / 'run'}",
                            "--storage-driver=vfs", "rm", "--all"], capture_output=True, check=False)  # fmt: skip
            shutil.rmtree(self.storage, ignore_errors=True)


def build_image(name: str = IMAGE, cache: Path = CACHE, root: Path = ROOT) -> Path:
    """The docker-archive of the Dockerfile's image named `name`, built unless cached."""
    out = cache / f"{name.replace('/', '_').replace(':', '_')}.tar"
    stamp = image_stamp(name, root)
    if _fresh(out, stamp):
        return out
    ensure_host_tools()
    rootfs = base_rootfs(cache)
    buildah = Buildah(cache / "buildah")
    buildah.remove_storage()  # a crashed build's leftovers
    ours = [path for path in SYSTEM_DIRS if not path.exists()]
    try:
        buildah.import_rootfs(rootfs, BASE_NAME)
        log.info("building %s from %s ...", name, root / "Dockerfile")
        trust = [f"--volume={path}:{path}:ro" for path in HOST_TRUST if Path(path).is_file()]
        buildah("bud", "--pull=never", "--layers=false", f"--build-arg=BASE_IMAGE={BASE_NAME}", *trust,
                "--file=Dockerfile", f"--tag={name}", ".", cwd=root)  # fmt: skip
        partial = out.with_suffix(".partial.tar")
        partial.unlink(missing_ok=True)
        buildah("push", "--quiet", name, f"docker-archive:{partial}:{name}")
        os.replace(partial, out)
    finally:
        buildah.remove_storage()
        for path in ours:
            shutil.rmtree(path, ignore_errors=True)
    _mark(out, stamp)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(prog="python -m testbed.cluster.image_build", description=__doc__.split("\n")[0])
    parser.add_argument("--name", default=IMAGE, help=f"image name and tag (default {IMAGE})")
    print(build_image(parser.parse_args(argv).name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
