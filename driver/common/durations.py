"""Durations as Go writes them (`8760h`, `30s`, `1h30m`, also `d` for days) or plain seconds, read
into seconds: one parser for flags (driver/admission/lifetimes.py) and annotations
(driver/allocator/lifetimes.py)."""

from __future__ import annotations

import math
import re

_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h|d)")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: str) -> float:
    """Seconds, more than 0 and finite; ValueError naming the text otherwise."""
    text = value.strip()
    total = None
    try:
        total = float(text)
    except ValueError:
        if text and _PART.sub("", text) == "":
            total = sum(float(number) * _UNIT_S[unit] for number, unit in _PART.findall(text))
    if total is None or not (total > 0 and math.isfinite(total)):
        raise ValueError(f"{value!r} is not a duration (e.g. 8760h, 720h, 30s; more than 0)")
    return total
