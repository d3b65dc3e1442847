"""The placement policies' names (driver/allocator/scoring.py says what each does), apart from the
scoring itself: command-line flags offer them without importing the allocator and CEL (16 MiB,
which the node plugin, whose `fgpu` parser lists every command's flags, would otherwise hold)."""

from __future__ import annotations

from typing import Literal

Policy = Literal["binpack", "fragmentation", "spread", "first-fit"]
POLICIES: tuple[Policy, ...] = ("binpack", "fragmentation", "spread", "first-fit")
# It leaves the fewest GPUs unused on the public Alibaba trace (BENCHMARKS.md, openb).
DEFAULT_POLICY: Policy = "fragmentation"
