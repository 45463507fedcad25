"""Pipelines: EDM2Pipeline (the Hub-native folder layout lives in :mod:`diffusers_scalelong.hub`).

``DiffusionPipeline.from_pretrained(folder)`` looks a pipeline's ``_class_name`` up on the ``diffusers`` module, so
importing this package also makes ``diffusers.EDM2Pipeline`` available (unless diffusers defines one itself).
"""

import diffusers
from diffusers import DiffusionPipeline  # noqa: F401  (base class, for diffusers' loader)

from ..hub.layout import model_card, push_pipeline_to_hub, write_hub_layout
from .edm2_pipeline import EDM2Pipeline
from .latent_scaling import (
    EDM2_SD_VAE_LATENTS_MEAN,
    EDM2_SD_VAE_LATENTS_STD,
    VAE_PIXEL_RANGES,
    denormalize_latents,
    normalize_latents,
    set_edm2_latent_scaling,
)

if not hasattr(diffusers, "EDM2Pipeline"):
    diffusers.EDM2Pipeline = EDM2Pipeline

__all__ = [
    "EDM2Pipeline",
    "EDM2_SD_VAE_LATENTS_MEAN",
    "EDM2_SD_VAE_LATENTS_STD",
    "VAE_PIXEL_RANGES",
    "denormalize_latents",
    "model_card",
    "normalize_latents",
    "push_pipeline_to_hub",
    "set_edm2_latent_scaling",
    "write_hub_layout",
]
