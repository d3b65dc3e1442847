"""When a claim is expected to end, read from what it carries: the annotation
`gpu.fgpu.dev/expected-duration` (a Go duration, `30m`, `2h`, `90s`) counted from its
creationTimestamp. Pure; a missing, malformed or unbounded hint is no hint: it never blocks placement.

The allocator uses it to put shares likely to end together on one GPU (cluster.py, docs/allocator.md
"Shares that end together")."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar

from driver.common.durations import parse_duration

T = TypeVar("T")

EXPECTED_DURATION = "gpu.fgpu.dev/expected-duration"
# Longer is no useful hint (a service, not a job) and a typo such as `3000h` would pull shares
# towards one GPU for months: ignored.
MAX_DURATION_S = 30 * 86400.0


def expected_duration(annotations: Mapping[str, Any]) -> float | None:
    """The annotation's seconds, or None where it is missing, malformed, not above 0 or over
    MAX_DURATION_S."""
    text = annotations.get(EXPECTED_DURATION)
    if not isinstance(text, str):
        return None
    try:
        seconds = parse_duration(text)
    except ValueError:
        return None
    return seconds if seconds <= MAX_DURATION_S else None


def created_at(metadata: Mapping[str, Any]) -> float | None:
    """metadata.creationTimestamp (RFC 3339, as the API server writes it) in seconds since the
    epoch, or None where it is missing or unreadable."""
    text = metadata.get("creationTimestamp")
    if not isinstance(text, str):
        return None
    try:
        stamp = datetime.fromisoformat(text)
    except ValueError:
        return None
    return stamp.timestamp() if stamp.tzinfo is not None else None  # the API server always writes Z


def expected_end(metadata: Mapping[str, Any]) -> float | None:
    """When the object is expected to end (seconds since the epoch), or None: no usable hint."""
    duration = expected_duration(metadata.get("annotations") or {})
    start = created_at(metadata) if duration is not None else None
    return None if start is None or duration is None else start + duration


def distance(end: float, empties_at: float | None) -> float:
    """How far a claim's expected end is from when a GPU is expected to empty (inf: not known,
    which sorts after every known one)."""
    return math.inf if empties_at is None else abs(end - empties_at)


# How far from the policy's best a placement may score and still be taken for ending nearer: in a
# GPU's free share (binpack's best fit: 10 GiB of an 80 GiB GPU) or the rise in fragmentation (the
# same unit, weighed by the mix). Small enough that packing stays the policy's; large enough that
# GPUs whose free share differs by one small share count as equal (BENCHMARKS.md, packing).
TOLERANCE = 0.125


def nearest_first(
    ranked: Sequence[T],
    exact: Callable[[T], Hashable],
    amount: Callable[[T], float],
    how_far: Callable[[T], float],
) -> list[T]:
    """`ranked` (the policy's order, best first: by `exact`, then `amount`) with the items that
    score as its first does (`exact` equal, `amount` within TOLERANCE) sorted by `how_far`
    (distance), ties and unknowns (inf) in the policy's order; the rest as they were. With every
    distance unknown, `ranked` as it is."""
    if not ranked:
        return []
    first_exact, limit = exact(ranked[0]), amount(ranked[0]) + TOLERANCE
    size = 0
    for item in ranked:
        if exact(item) != first_exact or amount(item) > limit:
            break
        size += 1
    return sorted(ranked[:size], key=how_far) + list(ranked[size:])
