"""Time-slicing: the GPU's timeslice interval while time-sliced shares run, Default after the last.
No memory or fault isolation at all."""

from __future__ import annotations

from partitioner.runner import ToolRunner

INTERVALS = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}


class TimeSlicer:
    def __init__(self, runner: ToolRunner) -> None:
        self._runner = runner

    def set_interval(self, gpu_uuid: str, interval: str) -> None:
        self._runner.run("nvidia-smi", "compute-policy", "-i", gpu_uuid, "--set-timeslice", str(INTERVALS[interval]))

    def reset(self, gpu_uuid: str) -> None:
        self.set_interval(gpu_uuid, "Default")
