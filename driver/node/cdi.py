"""CDI spec files: one per claim, written atomically, removed on unprepare.

Driver libraries and tools are bind-mounted from the driver root: found under `--driver-root` as
the plugin sees it (e.g. /driver-root in its container), mounted from `--host-driver-root` as the
container runtime on the host sees it ("/" on a node whose driver is installed on the host,
/run/nvidia/driver with the GPU operator). We do not
depend on the NVIDIA Container Toolkit's generated CDI specs: a node without the toolkit works,
and the spec says exactly what the container gets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from driver.common.files import atomic_write

CDI_VERSION = "0.6.0"
CDI_CLASS = "claim"
CONTROL_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
LIBRARY_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64", "usr/lib")
LIBRARY_PATTERNS = (
    "libnvidia-ml.so.*",
    "libcuda.so.*",
    "libcudadebugger.so.*",
    "libnvidia-ptxjitcompiler.so.*",
    "libnvidia-nvvm.so.*",
    "libnvidia-gpucomp.so.*",
    "libnvidia-allocator.so.*",
    "libnvidia-cfg.so.*",
)
# Not nvidia-cuda-mps-control: MPS clients need only the pipe directory's sockets, and the tool
# sends a daemon commands (quit, limits) that are the plugin's alone (docs/security.md).
TOOLS = ("usr/bin/nvidia-smi", "usr/bin/nvidia-debugdump")
MOCK_DEVICE_NODE = "/dev/null"  # what mock GPUs' device nodes are on the host (see CdiWriter)


@dataclass(frozen=True)
class CdiDevice:
    """One named CDI device of a claim's spec."""

    name: str
    device_nodes: tuple[str, ...]
    env: tuple[str, ...] = ()
    mounts: tuple[tuple[str, str, str], ...] = ()  # (host path, container path, "ro" or "rw")


@dataclass(frozen=True)
class DriverFiles:
    """Host files every GPU container needs, found once at start-up under the driver root."""

    root: Path  # on the host
    libraries: tuple[str, ...] = field(default_factory=tuple)  # paths relative to the root

    @classmethod
    def discover(cls, root: Path, host_root: Path | None = None) -> DriverFiles:
        """Find the files under `root` (as this process sees the driver root); the specs name them
        under `host_root` (as the host sees it; the same by default)."""
        found: list[str] = []
        for directory in LIBRARY_DIRS:
            for pattern in LIBRARY_PATTERNS:
                found.extend(str(p.relative_to(root)) for p in sorted((root / directory).glob(pattern)))
        found.extend(tool for tool in TOOLS if (root / tool).exists())
        return cls(root=host_root or root, libraries=tuple(found))


def cdi_kind(driver: str) -> str:
    return f"k8s.{driver}/{CDI_CLASS}"


def cdi_device_name(claim_uid: str, device: str) -> str:
    return f"{claim_uid}-{device}"


class CdiWriter:
    def __init__(self, cdi_dir: Path, driver: str, driver_files: DriverFiles, mock_device_nodes: bool = False) -> None:
        """`mock_device_nodes`: the GPUs are mocked, so their /dev entries do not exist on the host.
        A container runtime stats every device node's hostPath and fails the container when it is
        missing; with `hostPath: /dev/null` the container still gets the node at its path (as the
        null device, c 1:3), so pods on mock GPUs run on a real kubelet and containerd."""
        self.cdi_dir = cdi_dir
        self.kind = cdi_kind(driver)
        self._files = driver_files
        self._mock_device_nodes = mock_device_nodes
        self._prefix = f"{self.kind.replace('/', '-')}_"

    def qualified_id(self, claim_uid: str, device: str) -> str:
        return f"{self.kind}={cdi_device_name(claim_uid, device)}"

    def spec_path(self, claim_uid: str) -> Path:
        return self.cdi_dir / f"{self._prefix}{claim_uid}.json"

    def claim_uids_on_disk(self) -> set[str]:
        return {p.name[len(self._prefix) : -len(".json")] for p in self.cdi_dir.glob(f"{self._prefix}*.json")}

    def spec(self, claim_uid: str, devices: list[CdiDevice]) -> dict[str, Any]:
        root = self._files.root
        common: dict[str, Any] = {
            "env": ["NVIDIA_VISIBLE_DEVICES=void"],  # keeps a legacy nvidia runtime hook from adding GPUs
            "deviceNodes": self._device_nodes(CONTROL_DEVICE_NODES),
        }
        if self._files.libraries:
            common["mounts"] = [
                {"hostPath": str(root / rel), "containerPath": f"/{rel}", "options": ["ro", "nosuid", "nodev", "bind"]}
                for rel in self._files.libraries
            ]
        return {
            "cdiVersion": CDI_VERSION,
            "kind": self.kind,
            "devices": [
                {"name": cdi_device_name(claim_uid, d.name), "containerEdits": self._device_edits(d)} for d in devices
            ],
            "containerEdits": common,
        }

    def write(self, claim_uid: str, devices: list[CdiDevice]) -> Path:
        """Write the claim's spec atomically: a reader sees the old file or the new one, never half."""
        self.cdi_dir.mkdir(parents=True, exist_ok=True)
        path = self.spec_path(claim_uid)
        data = json.dumps(self.spec(claim_uid, devices), indent=2).encode()
        # Not durable: after a reboot kubelet prepares the claim again, which rewrites a missing spec.
        # Readable by root only (the container runtime).
        atomic_write(path, data, durable=False, mode=0o600)
        return path

    def remove(self, claim_uid: str) -> None:
        self.spec_path(claim_uid).unlink(missing_ok=True)

    def _device_nodes(self, paths: tuple[str, ...]) -> list[dict[str, str]]:
        # Device nodes are the host's /dev entries; the runtime fills in type, major and minor.
        if self._mock_device_nodes:
            return [{"path": path, "hostPath": MOCK_DEVICE_NODE} for path in paths]
        return [{"path": path} for path in paths]

    def _device_edits(self, device: CdiDevice) -> dict[str, Any]:
        edits: dict[str, Any] = {"deviceNodes": self._device_nodes(device.device_nodes)}
        if device.env:
            edits["env"] = list(device.env)
        if device.mounts:
            edits["mounts"] = [
                {"hostPath": h, "containerPath": c, "options": [access, "nosuid", "nodev", "bind"]}
                for h, c, access in device.mounts
            ]
        return edits
