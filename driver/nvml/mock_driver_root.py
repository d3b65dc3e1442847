"""The mock driver root: what mock GPUs get in place of the NVIDIA driver's files on the host.

On a real node the driver root holds the driver's libraries and tools; the CDI specs bind-mount
them into containers and the partitioners run the tools. Mock GPUs have no driver, so
`fgpu kubelet-plugin --nvml mock:...` lays out this tree itself (under its state dir unless
`--driver-root` says where): the fake `nvidia-smi` and `nvidia-cuda-mps-control` (fakebin/,
faithful to the real CLIs) in usr/bin, and placeholder libraries named like the driver's in
usr/lib/<arch>-linux-gnu, so that every bind mount of a spec points at a file that exists (a real
container runtime fails the container otherwise) and a container sees what a GPU container would.
"""

from __future__ import annotations

import json
import platform
from importlib import resources
from pathlib import Path

from driver.common.files import atomic_write

MARKER = ".fgpu-mock-driver-root"  # says the tree is ours to rewrite
FAKE_TOOLS = ("nvidia-smi", "nvidia-cuda-mps-control")
PLACEHOLDER_LIBRARIES = ("libnvidia-ml.so", "libcuda.so")
SMI_STATE_ENV = "FGPU_FAKE_SMI_STATE"
TOOLS_LOG_ENV = "FGPU_FAKE_TOOLS_LOG"


class MockDriverRootError(RuntimeError):
    pass


def library_dir() -> str:
    """Where the driver's libraries are on a Debian-style host of this architecture."""
    return f"usr/lib/{platform.machine()}-linux-gnu"


def lay_out(root: Path, driver_version: str) -> None:
    """Create or refresh the mock driver root. Refuses a directory that has other files (e.g. `/`
    given as --driver-root by mistake): it would overwrite a real driver's tools."""
    if root.is_dir() and any(root.iterdir()) and not (root / MARKER).exists():
        raise MockDriverRootError(
            f"--driver-root {root} is not empty and not a mock driver root; with mock NVML, give an "
            "empty directory or leave --driver-root unset"
        )
    _install(root / MARKER, b"fgpu mock driver root: fake NVIDIA tools and placeholder libraries\n", 0o644)
    fakebin = resources.files("driver.nvml").joinpath("fakebin")
    for tool in FAKE_TOOLS:
        _install(root / "usr" / "bin" / tool, fakebin.joinpath(tool).read_bytes(), 0o755)
    for library in PLACEHOLDER_LIBRARIES:
        name = f"{library}.{driver_version}"
        text = f"fgpu mock driver root: placeholder for {name}; mock GPUs have no NVIDIA driver\n"
        _install(root / library_dir() / name, text.encode(), 0o644)


def fake_tools_env(state_dir: Path) -> dict[str, str]:
    """Where the fake tools keep their state and log, under the plugin's state dir."""
    directory = state_dir / "mock-tools"
    return {SMI_STATE_ENV: str(directory / "nvidia-smi.json"), TOOLS_LOG_ENV: str(directory / "tools.log")}


def _install(path: Path, content: bytes, mode: int) -> None:
    """Write the file unless it already has this content. Atomically (temp file, rename): a running
    container that bind-mounts the old file keeps it whole."""
    if path.is_file() and path.read_bytes() == content and (path.stat().st_mode & 0o777) == mode:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, content, durable=False, mode=mode)


def forget_timeslices(smi_state: Path, gpu_uuids: set[str] | None = None) -> None:
    """What a GPU reset (those GPUs) or a reboot (None: all) does to the fake nvidia-smi's compute
    policies: the time-slice interval is the driver's volatile setting, Default again."""
    if not smi_state.exists():
        return
    state = json.loads(smi_state.read_text() or "{}")
    kept = {uuid: policy for uuid, policy in state.items() if gpu_uuids is not None and uuid not in gpu_uuids}
    atomic_write(smi_state, json.dumps(kept).encode(), durable=False, mode=0o644)
