"""The OCI archives of testbed/cluster/images.py, read back the way containerd's importer reads them.

No test is skipped: the pause binary is built here with `go build`, and a missing /bin/busybox
(Debian's busybox-static, which the test bed installs) fails with the command that installs it.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import signal
import struct
import subprocess
import tarfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from testbed.cluster import images
from testbed.cluster.images import ImageConfig, Layer, build_image

pytestmark = pytest.mark.go  # helm, or go for the pause image: see tests/conftest.py


@dataclass(frozen=True)
class Archive:
    """An image archive's regular files, and its index, manifest and config decoded."""

    files: dict[str, bytes]
    index: dict
    manifest: dict
    config: dict

    def blob(self, digest: str) -> bytes:
        algorithm, _, encoded = digest.partition(":")
        assert algorithm == "sha256"
        return self.files[f"blobs/sha256/{encoded}"]

    def layer_members(self, number: int = 0) -> dict[str, tuple[tarfile.TarInfo, bytes]]:
        layer = gzip.decompress(self.blob(self.manifest["layers"][number]["digest"]))
        with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
            return {
                info.name: (info, tar.extractfile(info).read() if info.isfile() else b"")  # type: ignore[union-attr]
                for info in tar.getmembers()
            }


def read_archive(path: Path) -> Archive:
    with tarfile.open(path) as tar:
        files = {info.name: tar.extractfile(info).read() for info in tar.getmembers() if info.isfile()}  # type: ignore[union-attr]
    index = json.loads(files["index.json"])
    partial = Archive(files, index, {}, {})
    manifest = json.loads(partial.blob(index["manifests"][0]["digest"]))
    return Archive(files, index, manifest, json.loads(partial.blob(manifest["config"]["digest"])))


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def containerd_name(annotations: Mapping[str, str], base_name: str = "") -> str:
    """The name `ctr images import [--base-name B]` stores a manifest under (containerd v2.4, transfer API).

    A port of imageName() in core/transfer/image/imagestore.go with AddRefPrefix/FilterRefPrefix from
    core/images/archive/reference.go; without --base-name ctr uses the prefix import-<date>, overridable.
    """
    prefix, check_prefix = (base_name, True) if base_name else ("import-2026-01-01", False)

    def translate(ref: str) -> str:
        if any(char in ref for char in "/:@"):
            matches = ref.startswith(prefix) and (len(ref) == len(prefix) or ref[len(prefix)] in "/:@")
            return "" if check_prefix and not matches else ref
        return f"{prefix}:{ref}"

    if name := annotations.get("io.containerd.image.name", ""):
        return name if translate(name) == name else ""
    ref = annotations.get("org.opencontainers.image.ref.name", "")
    return translate(ref) if ref else ""


@pytest.fixture(scope="module")
def pause_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert shutil.which("go"), "go is needed to build testbed/cluster/cmd/pause"
    return images.build_pause_binary(tmp_path_factory.mktemp("pause-bin"))


@pytest.fixture(scope="module")
def pause_tar(pause_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return images.pause_image(pause_binary, tmp_path_factory.mktemp("pause-image"))


@pytest.fixture(scope="module")
def busybox_tar(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert images.BUSYBOX.is_file(), f"{images.BUSYBOX} is missing: apt-get install -y busybox-static"
    return images.userland_image(tmp_path_factory.mktemp("busybox-image"))


@pytest.fixture(params=["pause", "busybox"])
def named_tar(request: pytest.FixtureRequest) -> tuple[str, Path]:
    name = {"pause": images.PAUSE_IMAGE, "busybox": images.BUSYBOX_IMAGE}[request.param]
    return name, request.getfixturevalue(f"{request.param}_tar")


def test_oci_layout_and_index(named_tar: tuple[str, Path]) -> None:
    archive = read_archive(named_tar[1])
    assert json.loads(archive.files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    assert archive.index["schemaVersion"] == 2
    assert archive.index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    assert len(archive.index["manifests"]) == 1
    assert archive.index["manifests"][0]["platform"] == {"architecture": images.host_arch(), "os": "linux"}


def test_digests_and_sizes_chain_from_index_to_layers(named_tar: tuple[str, Path]) -> None:
    archive = read_archive(named_tar[1])
    descriptors = [archive.index["manifests"][0], archive.manifest["config"], *archive.manifest["layers"]]
    for descriptor in descriptors:
        content = archive.blob(descriptor["digest"])
        assert sha256(content) == descriptor["digest"]
        assert len(content) == descriptor["size"]
    blobs = {path: data for path, data in archive.files.items() if path.startswith("blobs/")}
    assert all(sha256(data) == "sha256:" + path.rsplit("/", 1)[1] for path, data in blobs.items())
    assert len(blobs) == len(descriptors)
    assert archive.index["manifests"][0]["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert archive.manifest["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    assert {layer["mediaType"] for layer in archive.manifest["layers"]} == {
        "application/vnd.oci.image.layer.v1.tar+gzip"
    }


def test_diff_ids_are_digests_of_the_uncompressed_layers(named_tar: tuple[str, Path]) -> None:
    archive = read_archive(named_tar[1])
    uncompressed = [gzip.decompress(archive.blob(layer["digest"])) for layer in archive.manifest["layers"]]
    assert archive.config["rootfs"] == {"type": "layers", "diff_ids": [sha256(layer) for layer in uncompressed]}
    assert archive.config["architecture"] == images.host_arch()
    assert archive.config["os"] == "linux"


def test_ctr_import_names_the_image_exactly(named_tar: tuple[str, Path]) -> None:
    name, path = named_tar
    annotations = read_archive(path).index["manifests"][0]["annotations"]
    assert annotations == {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": "1"}
    assert containerd_name(annotations) == name
    assert containerd_name(annotations, base_name=name.rsplit(":", 1)[0]) == name
    # The OCI tag alone would have been joined to the prefix:
    assert containerd_name({"org.opencontainers.image.ref.name": "1"}) == "import-2026-01-01:1"


def test_busybox_image_contents(busybox_tar: Path) -> None:
    archive = read_archive(busybox_tar)
    members = archive.layer_members()
    busybox, content = members["bin/busybox"]
    assert busybox.isfile() and busybox.mode == 0o755
    assert content == images.BUSYBOX.read_bytes()
    assert images.is_static_elf(images.BUSYBOX)
    for applet in images.BUSYBOX_APPLETS:
        link = members[f"bin/{applet}"][0]
        assert link.issym() and link.linkname == "busybox", applet
    tmp = members["tmp"][0]
    assert tmp.isdir() and tmp.mode == 0o1777
    passwd, group = members["etc/passwd"][1].decode(), members["etc/group"][1].decode()
    assert passwd.startswith("root:x:0:0:") and "\nnobody:x:65534:65534:" in passwd
    assert group.startswith("root:x:0:") and "\nnobody:x:65534:" in group
    assert members["etc/passwd"][0].mode == 0o644
    assert {(info.uid, info.gid, info.uname, info.mtime) for info, _ in members.values()} == {(0, 0, "root", 0)}
    assert archive.config["config"] == {"Cmd": ["sh"], "Env": ["PATH=/bin:/usr/bin"]}


def test_pause_image_contents(pause_tar: Path, pause_binary: Path) -> None:
    archive = read_archive(pause_tar)
    members = archive.layer_members()
    assert list(members) == ["pause"]
    info, content = members["pause"]
    assert info.isfile() and info.mode == 0o755 and (info.uid, info.gid) == (0, 0)
    assert content == pause_binary.read_bytes()
    assert archive.config["config"] == {"Entrypoint": ["/pause"]}


def _handles(pid: int, signum: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    caught = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught, 16) & (1 << (signum - 1)))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_pause_sleeps_until_told_to_stop_then_exits_0(pause_tar: Path, tmp_path: Path, signum: int) -> None:
    binary = tmp_path / "pause"
    binary.write_bytes(read_archive(pause_tar).layer_members()["pause"][1])
    binary.chmod(0o755)
    process = subprocess.Popen([binary], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while not _handles(process.pid, signum):
            assert time.monotonic() < deadline, "pause never installed its signal handlers"
            time.sleep(0.01)
        time.sleep(0.2)
        assert process.poll() is None, "pause exited on its own"
        process.send_signal(signum)
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        assert process.stderr is not None
        process.stderr.close()


def test_builds_are_reproducible(tmp_path: Path) -> None:
    first = images.userland_image(tmp_path / "a")
    second = images.userland_image(tmp_path / "b")
    assert read_archive(first).index == read_archive(second).index
    assert first.read_bytes() == second.read_bytes()


def _tiny(out: Path, content: bytes = b"hello\n") -> Path:
    layer = Layer(files={"/etc/greeting": content})
    return build_image("fgpu.test/tiny:1", [layer], ImageConfig(cmd=["cat", "/etc/greeting"]), out)


def test_cache_skips_an_unchanged_build_and_redoes_a_changed_one(tmp_path: Path) -> None:
    out = tmp_path / "tiny.tar"
    built = os.stat(_tiny(out))
    digest = read_archive(out).index["manifests"][0]["digest"]
    time.sleep(0.01)
    assert _tiny(out) == out
    again = os.stat(out)
    assert (again.st_ino, again.st_mtime_ns) == (built.st_ino, built.st_mtime_ns)

    _tiny(out, b"changed\n")
    assert read_archive(out).index["manifests"][0]["digest"] != digest
    _tiny(out)
    assert read_archive(out).index["manifests"][0]["digest"] == digest

    before = os.stat(out).st_mtime_ns
    time.sleep(0.01)
    (tmp_path / "tiny.tar.stamp").unlink()
    _tiny(out)
    assert os.stat(out).st_mtime_ns != before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["tiny.tar", "tiny.tar.stamp"]


def test_cache_sees_a_changed_host_file(tmp_path: Path) -> None:
    source = tmp_path / "tool"
    source.write_bytes(b"#!/bin/sh\n")
    source.chmod(0o755)
    out = tmp_path / "out" / "tool.tar"
    build = lambda: build_image("fgpu.test/tool:1", [Layer(files={"/tool": source})], ImageConfig(), out)  # noqa: E731
    first = read_archive(build()).manifest["layers"][0]["digest"]
    source.write_bytes(b"#!/bin/sh\nexit 1\n")
    assert read_archive(build()).manifest["layers"][0]["digest"] != first
    source.chmod(0o700)
    assert read_archive(build()).layer_members()["tool"][0].mode == 0o700


def test_several_layers_with_implicit_parents(tmp_path: Path) -> None:
    base = Layer(files={"/etc/os-release": b"ID=test\n"}, dirs={"/var/empty": 0o555})
    app = Layer(
        files={"/opt/app/bin/run": b"#!/bin/sh\n", "opt/app/README": b"readme\n"},
        modes={"/opt/app/bin/run": 0o750},
        symlinks={"/usr/local/bin/run": "/opt/app/bin/run"},
    )
    config = ImageConfig(
        entrypoint=["/usr/local/bin/run"], env={"A": "1", "B": "x=y"}, workdir="/opt/app", user="65534"
    )
    archive = read_archive(build_image("fgpu.test/app:2", [base, app], config, tmp_path / "app.tar"))
    assert len(archive.manifest["layers"]) == len(archive.config["rootfs"]["diff_ids"]) == 2
    assert list(archive.layer_members(0)) == ["etc", "etc/os-release", "var", "var/empty"]
    members = archive.layer_members(1)
    assert list(members) == [
        "opt", "opt/app", "opt/app/README", "opt/app/bin", "opt/app/bin/run", "usr", "usr/local", "usr/local/bin",
        "usr/local/bin/run",
    ]  # fmt: skip
    assert {name: info.mode for name, (info, _) in members.items() if info.isdir()} == dict.fromkeys(
        ["opt", "opt/app", "opt/app/bin", "usr", "usr/local", "usr/local/bin"], 0o755
    )
    assert members["opt/app/bin/run"][0].mode == 0o750
    assert members["opt/app/README"][0].mode == 0o644
    assert archive.layer_members(0)["var/empty"][0].mode == 0o555
    assert archive.config["config"] == {
        "Entrypoint": ["/usr/local/bin/run"],
        "Env": ["A=1", "B=x=y"],
        "WorkingDir": "/opt/app",
        "User": "65534",
    }
    assert archive.index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"] == "2"


@pytest.mark.parametrize("name", ["pause:1", "fgpu.test/pause", "busybox", "library/busybox:1", "fgpu.test/x:a/b"])
def test_names_a_runtime_would_rewrite_are_refused(name: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="image name"):
        build_image(name, [Layer(files={"/f": b""})], ImageConfig(), tmp_path / "x.tar")


@pytest.mark.parametrize("path", ["", "/", "..", "/a/.."])
def test_the_root_is_no_file(path: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="bad path"):
        build_image("fgpu.test/x:1", [Layer(files={path: b""})], ImageConfig(), tmp_path / "x.tar")


def test_paths_stay_inside_the_image(tmp_path: Path) -> None:
    layer = Layer(files={"/a/../../b": b"", "c/./d": b""})
    archive = read_archive(build_image("fgpu.test/x:1", [layer], ImageConfig(), tmp_path / "x.tar"))
    assert list(archive.layer_members()) == ["b", "c", "c/d"]


def _elf(program_header_type: int) -> bytes:
    header = b"\x7fELF\x02\x01\x01" + bytes(9)
    header += struct.pack("<HHIQQQIHHHHHH", 2, 62, 1, 0, 64, 0, 0, 64, 56, 1, 0, 0, 0)
    return header + struct.pack("<I", program_header_type) + bytes(52)


def test_a_dynamically_linked_busybox_is_refused(tmp_path: Path) -> None:
    dynamic, static = tmp_path / "dynamic", tmp_path / "static"
    dynamic.write_bytes(_elf(3))  # PT_INTERP: needs a loader the image lacks
    static.write_bytes(_elf(1))
    assert not images.is_static_elf(dynamic)
    assert images.is_static_elf(static)
    with pytest.raises(ValueError, match="busybox-static"):
        images.userland_image(tmp_path / "out", busybox=dynamic)


def test_a_missing_busybox_says_what_to_install(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"apt-get install -y busybox-static"):
        images.userland_image(tmp_path, busybox=tmp_path / "busybox")


def test_command_line_writes_both_archives(
    pause_binary: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert images.main([str(tmp_path), "--pause", str(pause_binary)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / "pause.tar"), str(tmp_path / "busybox.tar")]
    names = [read_archive(Path(path)).index["manifests"][0]["annotations"] for path in printed]
    assert [containerd_name(annotations) for annotations in names] == [images.PAUSE_IMAGE, images.BUSYBOX_IMAGE]
