"""Checks of numbers where they enter the library: finite, in range, the right type; errors name the option."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable


def check_number(
    name: str,
    value: object,
    low: float | None = None,
    high: float | None = None,
    *,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
) -> float:
    """``value`` as a float, or ``ValueError`` naming ``name`` unless it is a finite real number in the range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    too_low = low is not None and (value < low if low_inclusive else value <= low)
    too_high = high is not None and (value > high if high_inclusive else value >= high)
    if too_low or too_high:
        left = "(-inf" if low is None else ("[" if low_inclusive else "(") + f"{low:g}"
        right = "inf)" if high is None else f"{high:g}" + ("]" if high_inclusive else ")")
        raise ValueError(f"{name} must lie in {left}, {right}, got {value!r}")
    return float(value)


def check_optional_count(name: str, value: object, minimum: int = 1) -> int | None:
    """``None`` or an integer >= ``minimum`` (``ValueError`` naming ``name`` otherwise)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be None or an integer >= {minimum}, got {value!r}")
    return value


def check_number_sequence(name: str, values: object) -> tuple[float, ...]:
    """A sequence of numbers as floats; a string (read one character at a time otherwise) is refused."""
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be a sequence of numbers such as (0.05, 0.10), got {values!r}")
    return tuple(check_number(f"{name}[{i}]", v) for i, v in enumerate(values))
