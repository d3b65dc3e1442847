"""Time for the controller. Leases and deadlines are judged on this process's monotonic clock,
which no other machine's clock can move; the wall clock is only written into objects (renewTime,
allocationTimestamp), for people to read.

Test hook: FGPU_TEST_CLOCK_OFFSET_S shifts this process's wall clock by that many seconds, to
play a replica whose clock is wrong. It is read by the end-to-end tests only; never set it in a
deployment."""

from __future__ import annotations

import datetime
import os
import time

OFFSET_ENV = "FGPU_TEST_CLOCK_OFFSET_S"
_OFFSET = datetime.timedelta(seconds=float(os.environ.get(OFFSET_ENV) or 0))

monotonic = time.monotonic


def wall_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC) + _OFFSET


def timestamp(precise: bool = False) -> str:
    """The wall clock in the API's formats: MicroTime (a Lease's renewTime) or Time."""
    return wall_now().strftime("%Y-%m-%dT%H:%M:%S.%fZ" if precise else "%Y-%m-%dT%H:%M:%SZ")
