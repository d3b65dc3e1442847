"""Quantities: exact values, the canonical form we publish, and the bounds on what a tenant sends."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from driver.common.quantity import (
    MAX_DIGITS,
    MAX_EXPONENT,
    QuantityError,
    QuantityOutOfRange,
    ceil_int,
    format_quantity,
    parse_quantity,
)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("10Gi", 10 * 2**30),
        ("500m", Fraction(1, 2)),
        ("1e3", 1000),
        ("1.5k", 1500),
        (".5", Fraction(1, 2)),
        ("+2E", 2 * 10**18),
        (f"1e{MAX_EXPONENT}", 10**MAX_EXPONENT),
        ("9" * MAX_DIGITS, int("9" * MAX_DIGITS)),
        (7, 7),
    ],
)
def test_values_are_exact(text: str | int, value: int | Fraction):
    assert parse_quantity(text) == value


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1e999999999", "exponent out of range"),
        (f"1e-{MAX_EXPONENT + 1}", "exponent out of range"),
        ("1" * (MAX_DIGITS + 1), f"more than {MAX_DIGITS} digits"),
        ("1" * 5000, "longer than 64 characters"),
        (10**200, "quantity out of range"),
    ],
)
def test_a_quantity_past_the_bounds_is_refused_before_any_arithmetic(text: str | int, message: str):
    with pytest.raises(QuantityOutOfRange, match=message):
        parse_quantity(text)


@pytest.mark.parametrize("text", ["lots", "1Gb", "", "1e", True, "1.2.3", "Gi"])
def test_malformed_quantities_are_refused(text: object):
    with pytest.raises(QuantityError):
        parse_quantity(text)  # type: ignore[arg-type]


@given(st.integers(min_value=0, max_value=2**62))
def test_the_published_form_reads_back_as_the_same_number(value: int):
    assert parse_quantity(format_quantity(value)) == value


def test_whole_numbers_round_up_as_kubernetes_does():
    assert ceil_int(Fraction(1, 3)) == 1 and ceil_int(Fraction(-1, 3)) == 0 and ceil_int(4) == 4
