"""Usage profiles: how a mock GPU process's memory and SM use move over time (steady, bursty,
growing), and the profile of each bundled example workload (examples/*.yaml).

The NVML mock reports a profiled process's use at the time since it started (driver/nvml/mock.py),
and bench/rightsize_week.py simulates a week of the examples with the same profiles, so that CI
exercises the code the benchmark measures. A profile's value is a pure function of the time and a
seed (the process's pid): the mock evaluates it on each NVML call, in whichever process makes it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import NamedTuple

SHAPES = ("steady", "bursty", "growing")
WANDER = 0.02  # use wanders +-2% around its level
BURST_EVERY_S = 6 * 3600
BURST_S = 600
DAY_S = 86_400


class Use(NamedTuple):
    memory_mib: int
    compute: float  # percent of the whole GPU's SMs


@dataclass(frozen=True)
class UsageProfile:
    """A workload's true use: `steady` at its level, `bursty` at its level with a spike to
    `burst_mib` / `burst_compute` for BURST_S every BURST_EVERY_S (from its start), `growing` by
    `growth_mib_per_day`; each wandering +-WANDER."""

    shape: str
    memory_mib: int
    compute: float
    burst_mib: int = 0
    burst_compute: float = 0.0
    growth_mib_per_day: int = 0

    def at(self, t: float, seed: int | str) -> Use:
        """The use `t` seconds after the start; the wander changes once a second of `t`."""
        wander = 1 + WANDER * _unit(seed, math.floor(t))
        if self.shape == "bursty" and t % BURST_EVERY_S < BURST_S:
            return Use(int(self.burst_mib * wander), self.burst_compute * wander)
        memory = self.memory_mib + self.growth_mib_per_day * t / DAY_S
        return Use(int(memory * wander), self.compute * wander)

    def valid(self) -> bool:
        """A known shape, no negative memory or growth, compute within 0-100%."""
        return (
            self.shape in SHAPES
            and min(self.memory_mib, self.burst_mib, self.growth_mib_per_day) >= 0
            and all(0 <= percent <= 100 for percent in (self.compute, self.burst_compute))
        )


def _unit(seed: int | str, second: int) -> float:
    """A value in [-1, 1) fixed by (seed, second): a hash, the same in every process (Python's
    hash() of a str is salted per process, a shared random generator depends on call order)."""
    digest = hashlib.blake2b(f"{seed}/{second}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**63 - 1


# Which example workload behaves how ("Kind/name" of its pod owner, or the bare pod): levels in MiB
# and percent of an H100's SMs. An assumption, not a measurement: see docs/benchmarks/rightsizing.md.
WORKLOAD_PROFILES = {
    "Deployment/inference": UsageProfile("steady", 2048, 4.0),
    "Job/trainer": UsageProfile("bursty", 20_480, 25.0, burst_mib=30_720, burst_compute=35.0),
    "Pod/mig-mps-a": UsageProfile("steady", 3072, 8.0),
    "Pod/mig-mps-b": UsageProfile("bursty", 2048, 5.0, burst_mib=5120, burst_compute=12.0),
    "Pod/mig-pair": UsageProfile("steady", 6144, 10.0),
    "Pod/mig-1g": UsageProfile("steady", 4096, 5.0),
    "Pod/mig-3g": UsageProfile("growing", 10_240, 20.0, growth_mib_per_day=1536),
    "Pod/mps-share": UsageProfile("steady", 2048, 8.0),
    "Pod/cuda-job": UsageProfile("bursty", 15_360, 20.0, burst_mib=25_600, burst_compute=30.0),
    "Pod/inference-small": UsageProfile("bursty", 3072, 6.0, burst_mib=6144, burst_compute=15.0),
    "Pod/inference-large": UsageProfile("steady", 12_288, 20.0),
    "Pod/training-mig": UsageProfile("steady", 25_600, 38.0),
    "Pod/timeslice-a": UsageProfile("steady", 512, 10.0),
    "Pod/timeslice-b": UsageProfile("steady", 512, 10.0),
    "Pod/whole-gpu": UsageProfile("steady", 10_240, 15.0),
    "Pod/h100-or-3g": UsageProfile("steady", 8192, 12.0),
}
