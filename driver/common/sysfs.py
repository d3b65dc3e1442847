"""A PCI device's place in the machine, read from sysfs the way upstream's deviceattribute package
reads it (k8s.io/dynamic-resource-allocation/deviceattribute: pci_linux.go, numa_linux.go), so that
fgpu's `resource.kubernetes.io/pcieRoot` and `numaNode` match what other drivers (NICs, CPUs)
publish for devices on the same root complex or NUMA node."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
SYSFS_ROOT = Path("/sys")
PCI_DEVICES = PurePosixPath("bus/pci/devices")  # <bus id> -> ../../../devices/pci<domain>:<bus>/.../<bus id>


class SysfsError(RuntimeError):
    """sysfs does not say what we asked; the message names the file."""


@dataclass(frozen=True)
class PciTopology:
    pcie_root: str | None  # the root complex, "pci<domain>:<bus>"
    numa_node: int | None  # None: no NUMA affinity (the kernel's -1), which upstream says not to publish


def pcie_root(bus_id: str, sysfs_root: Path = SYSFS_ROOT) -> str:
    """The root complex above a PCI device: the first directory under devices/ of the device's real
    path, which its bus/pci/devices/<bus id> symlink gives (the path has any bridges in between)."""
    link = sysfs_root / PCI_DEVICES / bus_id
    try:
        target = PurePosixPath(os.readlink(link))
    except OSError as err:
        raise SysfsError(f"cannot read the PCI device link {link}: {err.strerror}") from err
    # The kernel's links are relative; resolved lexically, as upstream does, so a sysfs root other
    # than /sys (a test's, a mock machine's) works the same.
    resolved = PurePosixPath(os.path.normpath(PCI_DEVICES / target))
    parts = resolved.parts
    if len(parts) < 3 or parts[0] != "devices" or not parts[1].startswith("pci") or parts[-1] != bus_id:
        raise SysfsError(f"{link} points to {target}, not to devices/pci<domain>:<bus>/.../{bus_id}")
    return parts[1]


def numa_node(bus_id: str, sysfs_root: Path = SYSFS_ROOT) -> int | None:
    """The device's NUMA node, None where the kernel says it has none (-1)."""
    path = sysfs_root / PCI_DEVICES / bus_id / "numa_node"
    try:
        node = int(path.read_text().strip())
    except OSError as err:
        raise SysfsError(f"cannot read {path}: {err.strerror}") from err
    except ValueError as err:
        raise SysfsError(f"{path} does not hold a number") from err
    return node if node >= 0 else None


def pci_topology(bus_id: str, sysfs_root: Path = SYSFS_ROOT) -> PciTopology:
    """Both, each None (with a warning) where sysfs does not say: the device is still published,
    without the attribute, as upstream's helpers leave it to the driver."""
    return PciTopology(_or_none(pcie_root, bus_id, sysfs_root), _or_none(numa_node, bus_id, sysfs_root))


def _or_none(read: Callable[[str, Path], T], bus_id: str, sysfs_root: Path) -> T | None:
    try:
        return read(bus_id, sysfs_root)
    except SysfsError as err:
        log.warning("PCI device %s: %s; its devices are published without it", bus_id, err)
        return None
