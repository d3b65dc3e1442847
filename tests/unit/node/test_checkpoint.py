import json
import multiprocessing
from pathlib import Path

from driver.node.checkpoint import Checkpoint
from driver.node.state import PreparedClaim, PreparedClaims, PreparedDevice


def claim(uid: str) -> PreparedClaim:
    device = PreparedDevice(
        ("gpu",), "n1", "gpu-0", (f"k8s.gpu.fgpu.dev/claim={uid}-gpu-0",), device_nodes=("/dev/nvidia0",)
    )
    return PreparedClaim(uid, "default", f"c-{uid}", (device,))


def test_roundtrip_and_checksum(tmp_path: Path):
    path = tmp_path / "checkpoint.json"
    store = PreparedClaims(Checkpoint(path, boot_id="boot-1"))
    store.commit(prepared=[claim("a"), claim("b")])
    reopened = PreparedClaims(Checkpoint(path, boot_id="boot-1"))
    assert reopened.all() == {"a": claim("a"), "b": claim("b")}
    document = json.loads(path.read_text())
    assert document["version"] == 1
    assert document["bootId"] == "boot-1"
    assert document["checksum"].startswith("sha256:")
    reopened.commit(removed=["a"])
    assert set(PreparedClaims(Checkpoint(path, boot_id="boot-1")).all()) == {"b"}


def test_corrupt_file_is_moved_aside_not_fatal(tmp_path: Path, caplog):
    path = tmp_path / "checkpoint.json"
    PreparedClaims(Checkpoint(path, boot_id="b")).commit(prepared=[claim("a")])
    document = json.loads(path.read_text())
    document["claims"]["a"]["name"] = "tampered"
    path.write_text(json.dumps(document))
    store = PreparedClaims(Checkpoint(path, boot_id="b"))
    assert store.all() == {}
    assert "checksum mismatch" in caplog.text
    assert list(tmp_path.glob("checkpoint.json.bad-*"))


def test_unknown_version_is_reset_with_a_log_line(tmp_path: Path, caplog):
    path = tmp_path / "checkpoint.json"
    path.write_text(json.dumps({"version": 99, "bootId": "b", "claims": {}, "checksum": "x"}))
    assert PreparedClaims(Checkpoint(path, boot_id="b")).all() == {}
    assert "version 99" in caplog.text
    path.write_text("{not json")
    assert PreparedClaims(Checkpoint(path, boot_id="b")).all() == {}
    assert "unreadable" in caplog.text


def test_claims_survive_a_reboot_and_the_boot_id_is_updated(tmp_path: Path, caplog):
    path = tmp_path / "checkpoint.json"
    PreparedClaims(Checkpoint(path, boot_id="boot-1")).commit(prepared=[claim("a")])
    after = PreparedClaims(Checkpoint(path, boot_id="boot-2"))
    assert set(after.all()) == {"a"}
    assert "boot boot-1" in caplog.text
    after.commit(prepared=[claim("b")])
    assert json.loads(path.read_text())["bootId"] == "boot-2"


def _writer(path: str, prefix: str, count: int) -> None:
    store = PreparedClaims(Checkpoint(Path(path), boot_id="b"))
    for i in range(count):
        store.commit(prepared=[claim(f"{prefix}-{i}")])


def test_two_processes_writing_at_once_lose_nothing(tmp_path: Path):
    path = tmp_path / "checkpoint.json"
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_writer, args=(str(path), p, 40)) for p in ("x", "y")]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    assert len(PreparedClaims(Checkpoint(path, boot_id="b")).all()) == 80
