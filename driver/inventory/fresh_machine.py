"""The GPUs of a machine profile as a node of that type has them when it starts: the mock without
a state file (no MIG instance, whatever FGPU_NVML_MOCK_STATE a shell holds), for what a node type
promises (`fgpu slice-template`) and publishes without a plugin (`fgpu simulate-fleet`)."""

from __future__ import annotations

import pynvml

from driver.common.flags import SettingsError
from driver.inventory.discovery import GpuInfo, discover_gpus
from driver.nvml.machine import MachineProfile
from driver.nvml.mock import MockNvml
from driver.nvml.session import NvmlSession


def fresh_gpus(machine: MachineProfile, mig_on: bool = False) -> list[GpuInfo]:
    """With `mig_on`, every GPU switched to MIG mode and reset, as an admin readies an Ampere node
    for MIG (Hopper and newer switch at once)."""
    if mig_on and not machine.gpu.mig_capable:
        raise SettingsError(f"--mig-mode on: {machine.gpu.product_name} ({machine.name}) has no MIG")
    mock = MockNvml(machine)
    session = NvmlSession(mock)
    try:
        for index in range(machine.gpu_count) if mig_on else ():
            mock.nvmlDeviceSetMigMode(session.handle(index), pynvml.NVML_DEVICE_MIG_ENABLE)
            mock.reset_gpu(index)
        return discover_gpus(session)
    finally:
        session.close()
