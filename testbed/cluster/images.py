"""Container images for the test-bed node, written without any registry or image builder.

The real node (kubelet + containerd) needs a sandbox image and a userland for test pods, and the test
bed must not reach a registry. This module writes OCI image-layout tar archives from local files, which
`ctr -n k8s.io images import <tar>` imports under the name given here:

- `build_image`: the general writer (any number of layers); the fgpu plugin image is assembled with it.
- `pause_image`: `fgpu.test/pause:1`, the static pause program from `testbed/cluster/cmd/pause`.
- `userland_image`: `fgpu.test/busybox:1`, Debian's busybox-static with applet links.

Archives are byte-for-byte reproducible (fixed mtimes, root ownership, sorted entries, gzip without a
timestamp) and cached: a stamp next to each archive records its inputs, and an unchanged build is skipped.

Naming on import (containerd v2, core/transfer/image/imagestore.go and client/import.go): each manifest
in index.json is named from its `io.containerd.image.name` annotation, a full reference used as is;
only without it is `org.opencontainers.image.ref.name` (OCI: the tag alone) joined to `--base-name`
(or `import-<date>`). We set both, the way containerd's own exporter does.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import platform
import posixpath
import stat
import struct
import subprocess
import tarfile
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Literal

PAUSE_IMAGE = "fgpu.test/pause:1"
BUSYBOX_IMAGE = "fgpu.test/busybox:1"
BUSYBOX = Path("/bin/busybox")
# The applets test pods use, each a /bin link to busybox.
# fmt: off
BUSYBOX_APPLETS = (
    "sh", "cat", "ls", "env", "sleep", "mount", "grep", "stat", "echo", "test", "head", "tail", "wc", "find",
    "readlink", "id", "hostname", "ip", "ping", "nc", "wget", "true", "false", "printf", "tr", "cut", "df",
    "du", "mkdir", "rm", "touch", "date", "ps", "kill", "uname", "tee", "sort", "dd", "xargs", "seq",
)
# fmt: on

ANNOTATION_IMAGE_NAME = "io.containerd.image.name"
ANNOTATION_REF_NAME = "org.opencontainers.image.ref.name"
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"

# Bump when the archive format written here changes, so cached archives are rebuilt.
FORMAT_VERSION = 1
MTIME = 0
GZIP_LEVEL = 6
CLUSTER_MODULE = Path(__file__).resolve().parent

_PASSWD = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
_GROUP = b"root:x:0:\nnobody:x:65534:\n"
_GOARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64", "ppc64le": "ppc64le"}


def host_arch() -> str:
    """The OCI (Go) name of this machine's architecture, which containerd unpacks by default."""
    machine = platform.machine()
    return _GOARCH.get(machine, machine)


@dataclass(frozen=True)
class ImageConfig:
    """The runtime part of an OCI image config (what `docker inspect` shows under Config)."""

    entrypoint: Sequence[str] = ()
    cmd: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    workdir: str = ""
    user: str = ""
    architecture: str = field(default_factory=host_arch)
    os: str = "linux"

    def runtime(self) -> dict[str, object]:
        """The `config` object, with empty fields left out like Go's omitempty."""
        fields: dict[str, object] = {
            "Entrypoint": list(self.entrypoint),
            "Cmd": list(self.cmd),
            "Env": [f"{key}={value}" for key, value in self.env.items()],
            "WorkingDir": self.workdir,
            "User": self.user,
        }
        return {key: value for key, value in fields.items() if value}


@dataclass(frozen=True)
class Layer:
    """One filesystem layer. Paths are absolute in the image ("/bin/sh"); parents are added as 0755.

    files: image path -> host file (its mode is kept) or content (mode 0644 unless in `modes`).
    symlinks: image path -> link target, as given (relative targets resolve in the image).
    dirs: image path -> mode, for directories that need one (e.g. "/tmp": 0o1777) or are empty.
    modes: image path -> mode of a file, overriding the above.
    """

    files: Mapping[str, Path | bytes] = field(default_factory=dict)
    symlinks: Mapping[str, str] = field(default_factory=dict)
    dirs: Mapping[str, int] = field(default_factory=dict)
    modes: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class _Entry:
    path: str  # relative, normalized: "bin/sh"
    kind: Literal["dir", "file", "symlink"]
    mode: int
    data: Path | bytes | None = None
    target: str = ""


@dataclass(frozen=True)
class _Blob:
    digest: str  # "sha256:<hex>"
    size: int

    def descriptor(self, media_type: str) -> dict[str, object]:
        return {"mediaType": media_type, "digest": self.digest, "size": self.size}


# --- public API ---------------------------------------------------------------------------------


def build_image(name: str, layers: Sequence[Layer], config: ImageConfig, out_tar: Path) -> Path:
    """Writes the OCI image-layout archive of `layers` + `config` named `name` to `out_tar`.

    Skips the work when `out_tar` exists and was built from the same inputs. Returns `out_tar`.
    """
    tag = _tag_of(name)
    entries = [_layer_entries(layer) for layer in layers]
    key = _cache_key(name, entries, config)
    stamp = _stamp_path(out_tar)
    if out_tar.is_file() and stamp.is_file() and stamp.read_text() == key:
        return out_tar
    out_tar.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_tar.parent, prefix=".image-") as tmp:
        work = Path(tmp)
        _write_layout(work, name, tag, entries, config)
        os.replace(work / "image.tar", out_tar)
    _write_atomic(stamp, key.encode())
    return out_tar


def pause_image(pause_binary: Path, out_dir: Path) -> Path:
    """`fgpu.test/pause:1`: the static pause program as /pause, the pod sandbox image."""
    _require_static(pause_binary, "the pause binary (CGO_ENABLED=0 go build ./cmd/pause in testbed/cluster)")
    layer = Layer(files={"/pause": pause_binary}, modes={"/pause": 0o755})
    config = ImageConfig(entrypoint=["/pause"])
    return build_image(PAUSE_IMAGE, [layer], config, out_dir / "pause.tar")


def userland_image(out_dir: Path, busybox: Path = BUSYBOX) -> Path:
    """`fgpu.test/busybox:1`: Debian's busybox-static as /bin/busybox, applet links, /tmp, /etc."""
    if not busybox.is_file():
        raise FileNotFoundError(
            f"{busybox} is missing: install Debian's busybox-static (apt-get install -y busybox-static)"
        )
    # Debian's dynamically linked busybox installs to the same path and would not run in the image.
    _require_static(busybox, f"{busybox} (Debian package busybox-static, not busybox)")
    layer = Layer(
        files={"/bin/busybox": busybox, "/etc/passwd": _PASSWD, "/etc/group": _GROUP},
        modes={"/bin/busybox": 0o755},
        symlinks={f"/bin/{applet}": "busybox" for applet in BUSYBOX_APPLETS},
        dirs={"/tmp": 0o1777, "/root": 0o700, "/usr/bin": 0o755},
    )
    config = ImageConfig(cmd=["sh"], env={"PATH": "/bin:/usr/bin"})
    return build_image(BUSYBOX_IMAGE, [layer], config, out_dir / "busybox.tar")


def build_pause_binary(out_dir: Path) -> Path:
    """Builds testbed/cluster/cmd/pause statically into `out_dir/pause` (a second or two)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / "pause"
    env = {**os.environ, "CGO_ENABLED": "0"}
    cmd = ["go", "build", "-trimpath", "-ldflags", "-s -w", "-o", str(target), "./cmd/pause"]
    subprocess.run(cmd, cwd=CLUSTER_MODULE, env=env, check=True)
    return target


# --- layer entries ------------------------------------------------------------------------------


def _tag_of(name: str) -> str:
    """The tag of a full reference, refusing names a container runtime would rewrite."""
    repository, _, tag = name.rpartition(":")
    if not repository or "/" in tag or not tag:
        raise ValueError(f"image name {name!r} needs a tag, e.g. fgpu.test/pause:1")
    domain = repository.split("/", 1)[0]
    # Without a registry domain, CRI normalizes "pause:1" to "docker.io/library/pause:1", which would
    # not match the name imported here.
    if "/" not in repository or not ("." in domain or ":" in domain or domain == "localhost"):
        raise ValueError(f"image name {name!r} needs a registry domain, e.g. fgpu.test/{repository}:{tag}")
    return tag


def _image_path(path: str) -> str:
    # Anchored at "/", normpath cannot climb above the image's root: "/a/../../b" is "b".
    clean = posixpath.normpath("/" + path).lstrip("/")
    if not clean:
        raise ValueError(f"bad path in image: {path!r} is the root itself")
    return clean


def _layer_entries(layer: Layer) -> list[_Entry]:
    """The layer's entries with implicit parent directories, sorted so parents come first."""
    entries: dict[str, _Entry] = {}
    modes = {_image_path(path): mode for path, mode in layer.modes.items()}
    for path, mode in layer.dirs.items():
        entries[_image_path(path)] = _Entry(_image_path(path), "dir", mode)
    for path, data in layer.files.items():
        clean = _image_path(path)
        entries[clean] = _Entry(clean, "file", modes.get(clean, _host_mode(data)), data=data)
    for path, target in layer.symlinks.items():
        entries[_image_path(path)] = _Entry(_image_path(path), "symlink", 0o777, target=target)
    for path in list(entries):
        parent = posixpath.dirname(path)
        while parent and parent not in entries:
            entries[parent] = _Entry(parent, "dir", 0o755)
            parent = posixpath.dirname(parent)
    return sorted(entries.values(), key=lambda entry: entry.path.split("/"))


def _host_mode(data: Path | bytes) -> int:
    return 0o644 if isinstance(data, bytes) else stat.S_IMODE(data.stat().st_mode)


def _tarinfo(entry: _Entry) -> tarfile.TarInfo:
    info = tarfile.TarInfo(entry.path)
    info.mode, info.mtime = entry.mode, MTIME
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    if entry.kind == "dir":
        info.type = tarfile.DIRTYPE
    elif entry.kind == "symlink":
        info.type, info.linkname = tarfile.SYMTYPE, entry.target
    return info


def _add_entry(tar: tarfile.TarFile, entry: _Entry) -> None:
    info = _tarinfo(entry)
    if entry.kind != "file":
        tar.addfile(info)
    elif isinstance(entry.data, bytes):
        info.size = len(entry.data)
        tar.addfile(info, io.BytesIO(entry.data))
    else:
        assert entry.data is not None
        with entry.data.open("rb") as source:
            info.size = os.fstat(source.fileno()).st_size
            tar.addfile(info, source)


# --- blobs and the layout -----------------------------------------------------------------------


class _Digesting:
    """A write-only stream that hashes and counts what passes through to `sink`."""

    def __init__(self, sink: BinaryIO | gzip.GzipFile) -> None:
        self.sink, self.hash, self.size = sink, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        self.size += len(data)
        return self.sink.write(data)

    def flush(self) -> None:
        self.sink.flush()

    def blob(self) -> _Blob:
        return _Blob("sha256:" + self.hash.hexdigest(), self.size)


def _write_layer(entries: Iterable[_Entry], path: Path) -> tuple[_Blob, str]:
    """Writes the gzip'd layer tar to `path` in one pass; returns its blob and its diff_id."""
    with path.open("wb") as out:
        compressed = _Digesting(out)
        # filename="" and mtime=0 keep the gzip header free of the temp file's name and the time.
        with gzip.GzipFile(filename="", mode="wb", fileobj=compressed, compresslevel=GZIP_LEVEL, mtime=0) as gz:
            plain = _Digesting(gz)
            with tarfile.open(fileobj=plain, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for entry in entries:
                    _add_entry(tar, entry)
    return compressed.blob(), plain.blob().digest


def _json(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _blob_of(data: bytes) -> _Blob:
    return _Blob("sha256:" + hashlib.sha256(data).hexdigest(), len(data))


def _config_json(config: ImageConfig, diff_ids: list[str]) -> bytes:
    return _json(
        {
            "architecture": config.architecture,
            "os": config.os,
            "config": config.runtime(),
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
            "history": [{"created_by": "fgpu testbed/cluster/images.py"} for _ in diff_ids],
        }
    )


def _index_json(name: str, tag: str, manifest: _Blob, config: ImageConfig) -> bytes:
    descriptor = manifest.descriptor(MEDIA_MANIFEST)
    descriptor["platform"] = {"architecture": config.architecture, "os": config.os}
    descriptor["annotations"] = {ANNOTATION_IMAGE_NAME: name, ANNOTATION_REF_NAME: tag}
    return _json({"schemaVersion": 2, "mediaType": MEDIA_INDEX, "manifests": [descriptor]})


def _write_layout(work: Path, name: str, tag: str, layers: list[list[_Entry]], config: ImageConfig) -> None:
    """Writes work/image.tar: oci-layout, index.json and blobs/sha256/* (manifest, config, layers)."""
    layer_blobs: list[tuple[_Blob, Path]] = []
    diff_ids: list[str] = []
    for number, entries in enumerate(layers):
        path = work / f"layer-{number}.tar.gz"
        blob, diff_id = _write_layer(entries, path)
        layer_blobs.append((blob, path))
        diff_ids.append(diff_id)
    config_bytes = _config_json(config, diff_ids)
    manifest_bytes = _json(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": _blob_of(config_bytes).descriptor(MEDIA_CONFIG),
            "layers": [blob.descriptor(MEDIA_LAYER) for blob, _ in layer_blobs],
        }
    )
    index_bytes = _index_json(name, tag, _blob_of(manifest_bytes), config)
    blobs: dict[str, bytes | Path] = {_blob_of(manifest_bytes).digest: manifest_bytes}
    blobs[_blob_of(config_bytes).digest] = config_bytes
    for blob, path in layer_blobs:
        blobs.setdefault(blob.digest, path)
    with tarfile.open(work / "image.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        _add_entry(tar, _Entry("oci-layout", "file", 0o644, data=_json({"imageLayoutVersion": "1.0.0"})))
        _add_entry(tar, _Entry("index.json", "file", 0o644, data=index_bytes))
        _add_entry(tar, _Entry("blobs", "dir", 0o755))
        _add_entry(tar, _Entry("blobs/sha256", "dir", 0o755))
        for digest, data in blobs.items():
            _add_entry(tar, _Entry("blobs/sha256/" + digest.removeprefix("sha256:"), "file", 0o644, data=data))


# --- cache and checks ---------------------------------------------------------------------------


def _stamp_path(out_tar: Path) -> Path:
    return out_tar.with_name(out_tar.name + ".stamp")


def _content_digest(data: Path | bytes | None) -> str:
    if data is None:
        return ""
    if isinstance(data, bytes):
        return hashlib.sha256(data).hexdigest()
    with data.open("rb") as source:
        return hashlib.file_digest(source, "sha256").hexdigest()


def _cache_key(name: str, layers: list[list[_Entry]], config: ImageConfig) -> str:
    """A digest of everything the archive is made from: the writer's version, name, config, entries."""

    def describe(entry: _Entry) -> list[object]:
        return [entry.path, entry.kind, entry.mode, entry.target, _content_digest(entry.data)]

    description = {
        "format": FORMAT_VERSION,
        "name": name,
        "config": [config.runtime(), config.architecture, config.os],
        "layers": [[describe(entry) for entry in entries] for entries in layers],
    }
    return hashlib.sha256(_json(description)).hexdigest() + "\n"


def _write_atomic(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def is_static_elf(path: Path) -> bool:
    """Whether `path` is an ELF executable without a program interpreter (no dynamic loader)."""
    with path.open("rb") as binary:
        header = binary.read(64)
        if header[:4] != b"\x7fELF":
            return False
        is64, endian = header[4] == 2, "<" if header[5] == 1 else ">"
        if is64:
            phoff, phentsize, phnum = struct.unpack_from(endian + "Q14xHH", header, 32)
        else:
            phoff, phentsize, phnum = struct.unpack_from(endian + "I10xHH", header, 28)
        binary.seek(phoff)
        table = binary.read(phentsize * phnum)
    pt_interp = 3
    return all(struct.unpack_from(endian + "I", table, i * phentsize)[0] != pt_interp for i in range(phnum))


def _require_static(path: Path, what: str) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"{what}: {path} does not exist")
    if not is_static_elf(path):
        raise ValueError(f"{what}: {path} is not a statically linked executable")


# --- command line -------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m testbed.cluster.images",
        description=f"Writes the test-bed images {PAUSE_IMAGE} and {BUSYBOX_IMAGE} as OCI archives.",
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--pause", type=Path, help="the pause binary (default: build it with go into OUT_DIR)")
    args = parser.parse_args(argv)
    pause = args.pause or build_pause_binary(args.out_dir)
    print(pause_image(pause, args.out_dir))
    print(userland_image(args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
