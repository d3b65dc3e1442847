"""What each kind of device is on its GPU, as traits, so that code asks what a kind does (is it in
a MIG partition? an MPS share?) instead of testing its name. The kinds themselves, and which kinds
a GPU offers: driver/inventory/sharing.py; what prepare makes for each: driver/node/partition_use.py.

A new kind gets its name in sharing.DeviceKind and its row here; prepare, unprepare and the
start-up sweeps follow its traits.
"""

from __future__ import annotations

from dataclasses import dataclass

from driver.claims.refs import ErrorReason
from driver.inventory.sharing import DeviceKind


@dataclass(frozen=True)
class KindTraits:
    # In a MIG partition (needs MIG mode on): prepare makes the MIG instance at the device's
    # placement. Otherwise the device uses the whole GPU (needs MIG mode off).
    in_partition: bool
    # An MPS share: its clients run under an MPS control daemon, the GPU's or its partition's.
    mps: bool
    # A time-sliced share: the GPU's (or the partition's) time is sliced between its users.
    time_sliced: bool
    # The reason a failing tool (nvidia-cuda-mps-control, nvidia-smi) is counted under in the
    # plugin's metrics (MIG instances and MIG mode are NVML's: "mig").
    tool_error_reason: ErrorReason

    @property
    def shared(self) -> bool:
        """A share: other claims may use the same GPU, or the same partition, at once."""
        return self.mps or self.time_sliced

    @property
    def changes_gpu(self) -> bool:
        """Whether prepare makes or changes something on the GPU (a MIG instance, an MPS daemon, a
        time-slice setting), which it journals first; a whole GPU is used as it is."""
        return self.in_partition or self.shared


KIND_TRAITS: dict[DeviceKind, KindTraits] = {
    "whole": KindTraits(in_partition=False, mps=False, time_sliced=False, tool_error_reason="internal"),
    "mig": KindTraits(in_partition=True, mps=False, time_sliced=False, tool_error_reason="internal"),
    "mps": KindTraits(in_partition=False, mps=True, time_sliced=False, tool_error_reason="mps"),
    "timeslice": KindTraits(in_partition=False, mps=False, time_sliced=True, tool_error_reason="timeslice"),
    # A partition's MPS daemon failing is counted as "internal", as it was before this table.
    "mig-mps": KindTraits(in_partition=True, mps=True, time_sliced=False, tool_error_reason="internal"),
    "mig-timeslice": KindTraits(in_partition=True, mps=False, time_sliced=True, tool_error_reason="internal"),
}
