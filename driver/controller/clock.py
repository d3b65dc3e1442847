"""Time for the controller. Leases and deadlines are judged on this process's monotonic clock,
which no other machine's clock can move; the wall clock is only written into objects (renewTime,
allocationTimestamp), for people to read. Tests shift the wall clock (TestHooks.clock_offset_s,
driver/common/testhooks.py) and only it: machines disagree on wall time (NTP off, a VM
restored), which is what a skewed replica writes into the Lease; a monotonic clock is never
compared across machines, so an offset to it would test nothing."""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

monotonic = time.monotonic


@dataclass(frozen=True)
class WallClock:
    """This process's wall clock, `offset_s` ahead (behind if negative): 0 but in tests."""

    offset_s: float = 0.0

    def now(self) -> datetime.datetime:
        return datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=self.offset_s)

    def timestamp(self, precise: bool = False) -> str:
        """The wall clock in the API's formats: MicroTime (a Lease's renewTime) or Time."""
        return self.now().strftime("%Y-%m-%dT%H:%M:%S.%fZ" if precise else "%Y-%m-%dT%H:%M:%SZ")


WALL_CLOCK = WallClock()
