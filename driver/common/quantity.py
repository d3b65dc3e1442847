"""Kubernetes resource quantities as exact numbers ("10Gi", "500m", "1e3"), bounded.

Quantities come from tenants (claims' capacity requests and opaque configs, CEL selectors, pods'
requests), so parsing is bounded before any arithmetic: a quantity is at most MAX_LENGTH
characters, its mantissa at most MAX_DIGITS digits and its decimal exponent within
+-MAX_EXPONENT, so the largest value is about 10^60 and every parse takes microseconds. Kubernetes
itself keeps quantities to 63-bit values times a scale, far inside these bounds, so nothing a real
object carries is refused; "1e999999999" is refused at once instead of becoming a 10^999999999
integer (seconds to minutes with the interpreter lock held)."""

from __future__ import annotations

import functools
import re
from fractions import Fraction

MAX_LENGTH = 64
MAX_DIGITS = 40
MAX_EXPONENT = 20  # decimal; the suffixes reach 10^18 (E) and 2^60 (Ei)

_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:(Ki|Mi|Gi|Ti|Pi|Ei)|([numkMGTPE]?)|[eE]([+-]?\d+))$")
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
BINARY_SUFFIXES = tuple(sorted(_BINARY.items(), key=lambda item: -item[1]))
_LARGEST = 10 ** (MAX_DIGITS + MAX_EXPONENT)

Amount = int | Fraction  # whole numbers stay ints: exact, and far faster than Fraction


class QuantityError(ValueError):
    pass


class QuantityOutOfRange(QuantityError):
    """Well-formed, but past the bounds above."""


def parse_quantity(text: str | int) -> Amount:
    """The exact value of a quantity string (or a whole number); raises QuantityError naming the
    bad text, or saying which bound it passes."""
    if isinstance(text, bool):  # JSON true is not a number
        raise QuantityError(f"invalid quantity {text!r}: a boolean, not a number")
    if isinstance(text, int):
        if abs(text) >= _LARGEST:
            raise QuantityOutOfRange(f"quantity out of range: more than {MAX_DIGITS + MAX_EXPONENT} digits")
        return text
    if isinstance(text, str):
        return _parse_cached(text)
    return _parse(text)


@functools.lru_cache(maxsize=4096)  # slices repeat a few quantities a million times: one object each
def _parse_cached(text: str) -> Amount:
    return _parse(text)


def _parse(text: object) -> Amount:
    raw = str(text).strip()
    if len(raw) > MAX_LENGTH:
        raise QuantityOutOfRange(f"invalid quantity {raw[:16]!r}...: longer than {MAX_LENGTH} characters")
    match = _QUANTITY.match(raw)
    if not match:
        raise QuantityError(f"invalid quantity {text!r}")
    number, binary, decimal, exponent = match.groups()
    if sum(c.isdigit() for c in number) > MAX_DIGITS:
        raise QuantityOutOfRange(f"invalid quantity {text!r}: more than {MAX_DIGITS} digits")
    if exponent is not None and abs(int(exponent)) > MAX_EXPONENT:
        raise QuantityOutOfRange(f"invalid quantity {text!r}: exponent out of range (at most {MAX_EXPONENT})")
    value = Fraction(number)
    if binary:
        value *= _BINARY[binary]
    else:
        value *= Fraction(10) ** (int(exponent) if exponent is not None else _DECIMAL[decimal or ""])
    return value.numerator if value.denominator == 1 else value


def format_quantity(value: int) -> str:
    """The canonical Kubernetes form of a whole number: the largest binary suffix that divides it
    (the form the node plugin publishes)."""
    for suffix, factor in BINARY_SUFFIXES:
        if value and value % factor == 0:
            return f"{value // factor}{suffix}"
    return str(value)


def format_amount(value: Amount) -> str:
    """The canonical form we write: whole numbers with the largest binary suffix, else rounded up."""
    return format_quantity(ceil_int(value))


def ceil_int(value: Amount) -> int:
    """Quantity.Value(): rounded up to a whole number, as Kubernetes does."""
    return value if isinstance(value, int) else -((-value.numerator) // value.denominator)
