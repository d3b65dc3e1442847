"""driver/common/files.py: atomic writes (durable ones fsync the file and its directory) and the side-file lock."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from driver.common import files
from driver.common.files import atomic_write, locked


def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What each os.fsync call synced: "file" or "directory"."""
    synced: list[str] = []
    real = os.fsync

    def record(fd: int) -> None:
        synced.append("directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(files.os, "fsync", record)
    return synced


def test_durable_write_syncs_the_file_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    synced = fsyncs(monkeypatch)
    target = tmp_path / "checkpoint.json"
    target.write_bytes(b"old")
    atomic_write(target, b"new", durable=True)
    assert target.read_bytes() == b"new"
    assert synced == ["file", "directory"]
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.json"]  # no temp file left


def test_a_write_that_need_not_be_durable_syncs_nothing(tmp_path, monkeypatch):
    synced = fsyncs(monkeypatch)
    atomic_write(tmp_path / "spec.json", b"{}", durable=False)
    assert (tmp_path / "spec.json").read_bytes() == b"{}"
    assert synced == []


def test_mode_is_exact_and_the_default_is_a_new_files(tmp_path):
    atomic_write(tmp_path / "tool", b"#!/bin/sh\n", durable=False, mode=0o755)
    atomic_write(tmp_path / "spec", b"{}", durable=False, mode=0o600)
    atomic_write(tmp_path / "plain", b"", durable=False)
    (tmp_path / "reference").write_bytes(b"")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes["tool"] == 0o755 and modes["spec"] == 0o600
    assert modes["plain"] == modes["reference"]  # 0o666 less the umask, as open() makes it


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    target = tmp_path / "health.json"
    target.write_bytes(b"old")

    def broken(src: object, dst: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, b"new", durable=True)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["health.json"]


def test_the_temp_file_is_hidden_and_not_taken_for_a_spec(tmp_path, monkeypatch):
    """A CDI runtime lists *.json: the temp file of a spec must not be one."""
    seen: list[str] = []
    real = os.replace

    def spy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        seen.append(Path(src).name)
        real(src, dst)

    monkeypatch.setattr(files.os, "replace", spy)
    atomic_write(tmp_path / "k8s.gpu.fgpu.dev-claim_uid.json", b"{}", durable=False)
    assert len(seen) == 1 and seen[0].startswith(".") and not seen[0].endswith(".json")


def test_the_lock_is_shared_by_readers_and_exclusive_for_a_writer(tmp_path):
    lock = tmp_path / "state.lock"
    writer_in = threading.Event()
    with locked(lock, exclusive=False), locked(lock, exclusive=False):  # two readers at once
        writer = threading.Thread(target=lambda: _hold(lock, writer_in))
        writer.start()
        assert not writer_in.wait(0.2)  # the writer waits for the readers
    writer.join(5)
    assert writer_in.is_set()


def _hold(lock: Path, entered: threading.Event) -> None:
    with locked(lock, exclusive=True):
        entered.set()
