"""Time for the controller. Leases and deadlines are judged on this process's monotonic clock,
which no other machine's clock can move; the wall clock is only written into objects (renewTime,
allocationTimestamp), for people to read. Tests shift the wall clock (driver/common/testhooks.py) and only
it: machines disagree on wall time (NTP off, a VM restored), which is what a skewed replica writes
into the Lease; a monotonic clock is never compared across machines, so an offset to it would
test nothing."""

from __future__ import annotations

import datetime
import time

from driver.common.testhooks import clock_offset_s

_OFFSET = datetime.timedelta(seconds=clock_offset_s())

monotonic = time.monotonic


def wall_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC) + _OFFSET


def timestamp(precise: bool = False) -> str:
    """The wall clock in the API's formats: MicroTime (a Lease's renewTime) or Time."""
    return wall_now().strftime("%Y-%m-%dT%H:%M:%S.%fZ" if precise else "%Y-%m-%dT%H:%M:%SZ")
