"""What the cluster offers, as sizing tells devices apart: the (GPU product, kind, MIG profile) of
every device the driver's ResourceSlices publish. Automatic sizing converts a claim only to a kind
and partition some node publishes for the product its usage was seen on."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from driver.sizing.sizes import MIG_KINDS, Size

WHOLE_TYPE = "gpu"  # the `type` attribute of a whole GPU (driver/inventory/devices.py); the others name their kind

Offer = tuple[str, str, str | None]  # GPU product, kind, MIG profile (None outside MIG)


@dataclass(frozen=True)
class Offers:
    devices: frozenset[Offer] = frozenset()
    unread: str = ""  # why the offers are not known (then nothing counts as offered)

    def why_not(self, product: str, size: Size) -> str | None:
        """None where some node offers the size's kind and partition of that product, else why not."""
        if self.unread:
            return f"the offers are not known ({self.unread})"
        wanted = offer(product, size)
        if wanted in self.devices:
            return None
        return f"no node publishes {' '.join(filter(None, wanted[1:]))} of {product}"


def offer(product: str, size: Size) -> Offer:
    return product, size.kind, size.profile if size.kind in MIG_KINDS else None


def offers_in(slices: Iterable[dict[str, Any]]) -> Offers:
    """The offers of ResourceSlices (resource.k8s.io/v1 JSON) of one driver."""
    found: set[Offer] = set()
    for item in slices:
        for device in (item.get("spec") or {}).get("devices") or ():
            attributes = device.get("attributes") or {}
            kind = _string(attributes, "type")
            product = _string(attributes, "productName")
            if kind and product:
                found.add((product, "whole" if kind == WHOLE_TYPE else kind, _string(attributes, "profile")))
    return Offers(frozenset(found))


def _string(attributes: dict[str, Any], name: str) -> str | None:
    value = (attributes.get(name) or {}).get("string")
    return None if value is None else str(value)
