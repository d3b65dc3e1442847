"""The test bed's image build: its cache stamp covers everything the Dockerfile copies, and nothing
that does not go into the image."""

from __future__ import annotations

import shutil
from pathlib import Path

from testbed.cluster.image_build import CONTEXT, ROOT, image_stamp


def dockerfile_copy_sources(dockerfile: Path) -> set[str]:
    """What COPY instructions take from the build context (not from another stage)."""
    sources = set()
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(word.startswith("--from=") for word in words):
            sources.update(word.rstrip("/") for word in words[1:-1] if not word.startswith("--"))
    return sources


def test_stamp_covers_what_the_dockerfile_copies() -> None:
    sources = dockerfile_copy_sources(ROOT / "Dockerfile")
    assert sources == {"pyproject.toml", "README.md", "driver", "partitioner"}
    assert sources <= set(CONTEXT)


def copy_context(destination: Path) -> Path:
    for name in CONTEXT:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, destination / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, destination / name)
    return destination


def test_stamp_changes_with_sources_and_name_only(tmp_path: Path) -> None:
    root = copy_context(tmp_path)
    stamp = image_stamp("fgpu.test/fgpu:dev", root)
    assert image_stamp("fgpu.test/fgpu:dev", root) == stamp
    assert image_stamp("fgpu.test/fgpu:next", root) != stamp
    (root / "driver" / "__pycache__").mkdir(exist_ok=True)
    (root / "driver" / "__pycache__" / "cli.cpython-311.pyc").write_bytes(b"compiled")
    (root / "tests").mkdir()
    (root / "tests" / "anything.py").write_text("not in the image")
    assert image_stamp("fgpu.test/fgpu:dev", root) == stamp
    with (root / "driver" / "cli.py").open("a") as source:
        source.write("\n# changed\n")
    assert image_stamp("fgpu.test/fgpu:dev", root) != stamp
