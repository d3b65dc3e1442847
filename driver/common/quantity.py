"""Kubernetes resource quantities as exact fractions ("10Gi", "500m", "1e3")."""

from __future__ import annotations

import functools
import re
from fractions import Fraction

from driver.inventory.slices import format_quantity  # the form the node plugin publishes

_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:(Ki|Mi|Gi|Ti|Pi|Ei)|([numkMGTPE]?)|[eE]([+-]?\d+))$")
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


Amount = int | Fraction  # whole numbers stay ints: exact, and far faster than Fraction


class QuantityError(ValueError):
    pass


def parse_quantity(text: str | int) -> Amount:
    """The exact value of a quantity string; raises QuantityError naming the bad text."""
    if isinstance(text, int):
        return text
    if isinstance(text, str):
        return _parse_cached(text)
    return _parse(text)


@functools.lru_cache(maxsize=4096)  # slices repeat a few quantities a million times: one object each
def _parse_cached(text: str) -> Amount:
    return _parse(text)


def _parse(text: object) -> Amount:
    match = _QUANTITY.match(str(text).strip())
    if not match:
        raise QuantityError(f"invalid quantity {text!r}")
    number, binary, decimal, exponent = match.groups()
    value = Fraction(number)
    if binary:
        value *= _BINARY[binary]
    else:
        value *= Fraction(10) ** (int(exponent) if exponent is not None else _DECIMAL[decimal or ""])
    return value.numerator if value.denominator == 1 else value


def format_amount(value: Amount) -> str:
    """The canonical form we write: whole numbers with the largest binary suffix, else rounded up."""
    return format_quantity(ceil_int(value))


def ceil_int(value: Amount) -> int:
    """Quantity.Value(): rounded up to a whole number, as Kubernetes does."""
    return value if isinstance(value, int) else -((-value.numerator) // value.denominator)
