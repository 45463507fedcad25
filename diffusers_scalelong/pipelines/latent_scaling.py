"""EDM2's latent normalisation, in both directions, and the pixel range a VAE works in: the one home of both.

EDM2 trains latent models on ``x = (z - mean) * scaling_factor / std`` per channel, the statistics stored in the
VAE's config as diffusers' ``AutoencoderKL`` keeps them (``latents_mean``, ``latents_std``, ``scaling_factor``);
decoding inverts it, ``z = x * std / scaling_factor + mean``. A VAE without per-channel statistics uses diffusers'
``z = x / scaling_factor + shift_factor``. A VAE works on images in ``[-1, 1]`` (diffusers' convention) or in
``[0, 1]`` (EDM2's models): :func:`to_vae_range` and :func:`from_vae_range` map from and to ``[-1, 1]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers import AutoencoderKL

from ..validation import check_number, check_number_sequence

# EDM2's per-channel statistics of Stable Diffusion VAE (ft-mse) latents; normalised latents are
# ``(z - mean) * 0.5 / std``, stored as AutoencoderKL's ``latents_mean``, ``latents_std`` and ``scaling_factor``.
EDM2_SD_VAE_LATENTS_MEAN = (5.81, 3.25, 0.12, -2.15)
EDM2_SD_VAE_LATENTS_STD = (4.17, 4.62, 3.71, 3.28)
EDM2_LATENTS_FINAL_STD = 0.5
#: Pixel ranges a VAE may work in (``vae_pixel_range``): name -> (low, high).
VAE_PIXEL_RANGES = {"[-1, 1]": (-1.0, 1.0), "[0, 1]": (0.0, 1.0)}


def set_edm2_latent_scaling(
    vae: AutoencoderKL,
    latents_mean: Sequence[float] = EDM2_SD_VAE_LATENTS_MEAN,
    latents_std: Sequence[float] = EDM2_SD_VAE_LATENTS_STD,
    final_std: float = EDM2_LATENTS_FINAL_STD,
) -> AutoencoderKL:
    """Store EDM2's per-channel latent scaling in the VAE's config (saved with it).

    EDM2 normalises VAE latents channel-wise: ``x = (z - mean) * scale`` with ``scale = final_std / std``, i.e.
    per-channel scale ``final_std / std`` and bias ``-mean * final_std / std``.
    """
    channels = vae.config.latent_channels
    latents_mean = check_number_sequence("latents_mean", latents_mean)
    latents_std = check_number_sequence("latents_std", latents_std)
    for i, value in enumerate(latents_std):
        check_number(f"latents_std[{i}]", value, 0.0, low_inclusive=False)
    check_number("final_std", final_std, 0.0, low_inclusive=False)
    if len(latents_mean) != channels or len(latents_std) != channels:
        raise ValueError(
            f"latents_mean and latents_std need {channels} values (the VAE's latent_channels), "
            f"got {len(latents_mean)} and {len(latents_std)}"
        )
    vae.register_to_config(
        latents_mean=[float(v) for v in latents_mean],
        latents_std=[float(v) for v in latents_std],
        scaling_factor=float(final_std),
    )
    return vae


def has_channel_statistics(config) -> bool:
    """Whether a VAE config holds EDM2's per-channel ``latents_mean`` and ``latents_std``."""
    return getattr(config, "latents_mean", None) is not None and getattr(config, "latents_std", None) is not None


def check_latent_scaling(config) -> None:
    """The scaling of a VAE config must be finite, with a positive ``scaling_factor`` and positive ``latents_std``
    (a zero would decode NaN or inf); ``ValueError`` naming the field otherwise."""
    check_number("vae.config.scaling_factor", config.scaling_factor, 0.0, low_inclusive=False)
    if getattr(config, "shift_factor", None) is not None:
        check_number("vae.config.shift_factor", config.shift_factor)
    for key in ("latents_mean", "latents_std"):
        for i, value in enumerate(getattr(config, key, None) or ()):
            check_number(f"vae.config.{key}[{i}]", value, 0.0 if key == "latents_std" else None, low_inclusive=False)


def _statistics(config, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (1, -1, 1, 1)
    mean = torch.tensor(config.latents_mean, dtype=torch.float32, device=like.device).reshape(shape)
    std = torch.tensor(config.latents_std, dtype=torch.float32, device=like.device).reshape(shape)
    return mean, std


def normalize_latents(z: torch.Tensor, config) -> torch.Tensor:
    """VAE latents -> what the network learns: ``(z - mean) * scaling_factor / std`` per channel."""
    mean, std = _statistics(config, z)
    return (z - mean) * (float(config.scaling_factor) / std)


def denormalize_latents(x: torch.Tensor, config) -> torch.Tensor:
    """The inverse of :func:`normalize_latents`, ``z = x * std / scaling_factor + mean``; for a VAE without per-channel
    statistics diffusers' ``z = x / scaling_factor + shift_factor``."""
    if not has_channel_statistics(config):
        return x / config.scaling_factor + (getattr(config, "shift_factor", None) or 0.0)
    mean, std = _statistics(config, x)
    return x * std / config.scaling_factor + mean


def to_vae_range(pixels: torch.Tensor, pixel_range: str) -> torch.Tensor:
    """Images in [-1, 1] -> the VAE's ``pixel_range``."""
    low, high = VAE_PIXEL_RANGES[pixel_range]
    return pixels if (low, high) == (-1.0, 1.0) else (pixels + 1) * ((high - low) / 2) + low


def from_vae_range(images: torch.Tensor, pixel_range: str) -> torch.Tensor:
    """The VAE's output in ``pixel_range`` -> images in [-1, 1] (the inverse of :func:`to_vae_range`)."""
    low, high = VAE_PIXEL_RANGES[pixel_range]
    return images if (low, high) == (-1.0, 1.0) else (images - low) * (2 / (high - low)) - 1
