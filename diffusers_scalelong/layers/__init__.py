"""Magnitude-preserving layers (EDM2) usable in any torch / diffusers model."""

from .mp import (
    Block,
    MPConv,
    MPFourier,
    cached_weight_normalization,
    mp_cat,
    mp_silu,
    mp_sum,
    normalize,
    pixel_norm,
    register_sharded_weight_projection,
    resample,
)

__all__ = [
    "Block",
    "MPConv",
    "MPFourier",
    "cached_weight_normalization",
    "mp_cat",
    "mp_silu",
    "mp_sum",
    "normalize",
    "pixel_norm",
    "register_sharded_weight_projection",
    "resample",
]
