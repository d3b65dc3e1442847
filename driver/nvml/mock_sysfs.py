"""The part of /sys a mock machine has: its GPUs' PCI devices, laid out as the kernel lays them out,
so that the sysfs reader (driver/common/sysfs.py) works on mock GPUs exactly as on real ones.

Per GPU, from the machine profile's topology: devices/pci0000:<root>/<root port>/<switch upstream
port>/<switch downstream port>/<GPU bus id> with a numa_node file, and bus/pci/devices/<GPU bus id>,
a relative symlink to it."""

from __future__ import annotations

import os
from pathlib import Path

from driver.nvml.machine import MachineProfile


def gpu_bus_id(machine: MachineProfile, index: int) -> str:
    return f"0000:{machine.pci_bus(index):02x}:00.0"


def gpu_device_path(machine: MachineProfile, index: int) -> Path:
    """Where a GPU's directory is under devices/: behind the PCIe switch of its root complex, on
    the switch's downstream port for its place in the group."""
    root = machine.pcie_root_bus(index)
    port = index % machine.topology.gpus_per_pcie_root
    return (
        Path("devices")
        / f"pci0000:{root:02x}"
        / f"0000:{root:02x}:01.0"
        / f"0000:{root + 1:02x}:00.0"
        / f"0000:{root + 2:02x}:{port:02x}.0"
        / gpu_bus_id(machine, index)
    )


def lay_out(root: Path, machine: MachineProfile) -> None:
    for index in range(machine.gpu_count):
        device = root / gpu_device_path(machine, index)
        device.mkdir(parents=True, exist_ok=True)
        (device / "numa_node").write_text(f"{machine.numa_node(index)}\n")
        link = root / "bus" / "pci" / "devices" / gpu_bus_id(machine, index)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(device, link.parent))
