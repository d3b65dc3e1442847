"""How long the webhook's certificates live and how early they are renewed, and the duration flags
that say so. No cryptography here: `fgpu`'s parser imports it for every command."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from driver.common.durations import parse_duration


def duration(value: str) -> float:
    """A duration as Go writes one (`8760h`, `30s`, `1h30m`, also `d` for days) or plain seconds,
    for argparse: seconds, more than 0."""
    try:
        return parse_duration(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


@dataclass(frozen=True)
class Lifetimes:
    """How long certificates live and how early they are renewed, in seconds."""

    validity_s: float  # the serving certificate
    renew_before_s: float  # renewed when it has less than this left
    ca_validity_s: float  # the CA: renewed when a new serving certificate would outlive it

    def check(self) -> None:
        """Raises ValueError where they do not fit together."""
        if self.renew_before_s >= self.validity_s:
            raise ValueError(f"the renewal margin ({self.renew_before_s:g}s) must be shorter than the validity "
                             f"({self.validity_s:g}s)")  # fmt: skip
        needed = self.validity_s + self.renew_before_s
        if self.ca_validity_s <= needed:
            raise ValueError(f"the CA's validity ({self.ca_validity_s:g}s) must be longer than the serving "
                             f"certificate's and its renewal margin together ({needed:g}s)")  # fmt: skip


DEFAULT_LIFETIMES = Lifetimes(365 * 86400, 30 * 86400, 3650 * 86400)  # 8760h, 720h, 87600h
