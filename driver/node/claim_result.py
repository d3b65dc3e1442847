"""One claim's outcome of a prepare or unprepare: what kubelet is answered for it, what the
operator's log line says, and where an error came from (for the metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field

from driver.claims.refs import ErrorReason
from driver.node.state import PreparedDevice


@dataclass(frozen=True)
class ClaimResult:
    """One claim's outcome of prepare or unprepare (unprepare's has no devices)."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""
    # What was created or destroyed, for the operator's log line; not part of kubelet's answer.
    summary: str = field(default="", compare=False)
    reason: ErrorReason | None = None  # where the error came from, for the metrics
