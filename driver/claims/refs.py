"""A claim as kubelet names it, and the error that says why it cannot be prepared."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Where a claim's error came from, a small fixed set (the plugin's metrics count errors by it).
ErrorReason = Literal[
    "invalid", "not_found", "not_allocated", "driver", "mig", "mps", "timeslice", "io", "api", "internal"
]


class ClaimError(ValueError):
    """The claim cannot be prepared here; the message names the reason, `reason` its source."""

    def __init__(self, message: str, reason: ErrorReason = "invalid") -> None:
        super().__init__(message)
        self.reason: ErrorReason = reason


@dataclass(frozen=True)
class ClaimRef:
    """A claim as kubelet names it."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} (uid {self.uid})"

    def validate(self) -> None:
        missing = [field for field in ("namespace", "name", "uid") if not getattr(self, field)]
        if missing:
            raise ClaimError(f"malformed request: the claim has no {', '.join(missing)}")
