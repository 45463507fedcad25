"""Checks of numbers where they enter the library: finite, in range, the right type; errors name the option."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence


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


#: Largest parameter count a model config may describe: 20e9 is 8x SDXL's UNet (2.6e9) and 13x EDM2-XXL (1.5e9), and
#: its float32 weights (80 GB) alone fill the largest single accelerator; a larger config is a typo (an extra digit).
MAX_PARAMETERS = 20e9
#: Largest sample height / width: 65536 = 2**16, 64x the largest sample of any diffusers UNet in use (1024 pixels);
#: one float32 channel of such a sample is 16 GiB, beyond what a network can take as a single activation.
MAX_SAMPLE_SIZE = 2**16
#: Noise levels a sampler or the EDM preconditioning may use: both square sigma in float32, and
#: (1e18)^2 = 1e36 < 3.4e38 (float32's largest) while (1e-18)^2 = 1e-36 > 1.2e-38 (its smallest normal number).
SIGMA_RANGE = (1e-18, 1e18)


def check_count(name: str, value: object, minimum: int = 1, maximum: float | None = None) -> int:
    """An integer in ``[minimum, maximum]`` (``ValueError`` naming ``name`` otherwise); numpy integers pass."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum:g}]"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
    return int(value)


def check_counts(name: str, values: object, minimum: int = 1, maximum: float | None = None) -> tuple[int, ...]:
    """A non-empty sequence of integers in ``[minimum, maximum]``; a string is refused."""
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be a sequence of integers, got {values!r}")
    values = tuple(values)
    if not values:
        raise ValueError(f"{name} must not be empty")
    return tuple(check_count(f"{name}[{i}]", v, minimum, maximum) for i, v in enumerate(values))


def check_sample_size(name: str, value: object, allow_none: bool = False) -> tuple[int, int] | None:
    """``sample_size`` as ``(height, width)``: an integer or a pair, each in ``[1, MAX_SAMPLE_SIZE]``."""
    if value is None and allow_none:
        return None
    if isinstance(value, list | tuple):
        if len(value) != 2:
            raise ValueError(f"{name} must be an integer or a (height, width) pair, got {value!r}")
        return check_count(f"{name}[0]", value[0], 1, MAX_SAMPLE_SIZE), check_count(
            f"{name}[1]", value[1], 1, MAX_SAMPLE_SIZE
        )
    size = check_count(name, value, 1, MAX_SAMPLE_SIZE)
    return size, size


def check_parameter_count(owner: str, count: float) -> None:
    """Refuse a config whose parameter count (computed from the config, before any allocation) exceeds
    ``MAX_PARAMETERS``."""
    if count > MAX_PARAMETERS:
        raise ValueError(
            f"this {owner} config describes at least {count:.3g} parameters, more than the {MAX_PARAMETERS:.0e} "
            "this library builds; check the widths and depths"
        )


def conv_unet_parameter_floor(widths: Sequence[int], layers_per_block: Sequence[int]) -> int:
    """A lower bound of a conv UNet's parameters: level ``l`` of width ``w_l`` has ``n_l`` encoder and ``n_l + 1``
    decoder residual blocks, each ending in a 3x3 convolution ``w_l -> w_l``: ``sum_l (2 n_l + 1) 9 w_l^2``."""
    return sum((2 * n + 1) * 9 * w * w for w, n in zip(widths, layers_per_block, strict=True))


def check_sigma(name: str, value: object, low: float = SIGMA_RANGE[0]) -> float:
    """A noise level (or ``sigma_data``) in ``[low, 1e18]`` (see ``SIGMA_RANGE``)."""
    return check_number(name, value, low, SIGMA_RANGE[1])
