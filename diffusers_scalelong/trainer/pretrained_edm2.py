"""What a pretrained EDM2 pipeline brings to fine-tuning besides its UNet.

A pipeline folder written by the EDM2 converter (or by ``EDMPreconditioner.save_pretrained`` beside a pipeline)
holds the preconditioner layout (``uncertainty/`` and ``preconditioner_config.json`` with ``sigma_data``) next to
``unet/``, and latent models a ``vae/`` whose pixel range ``model_index.json`` records (``vae_pixel_range``).
Fine-tuning continues from that uncertainty head with that ``sigma_data`` and trains on that VAE's latents.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from diffusers import AutoencoderKL

from ..edm2 import EDMPreconditioner, LearnedUncertainty
from ..edm2.precond import PRECONDITIONER_CONFIG
from ..sources import fetch_folder

__all__ = ["PretrainedEDM2Parts", "load_pretrained_edm2_parts"]


@dataclass
class PretrainedEDM2Parts:
    """The uncertainty head, ``sigma_data``, VAE and VAE pixel range of a pretrained pipeline (None: not there)."""

    uncertainty: LearnedUncertainty | None = None
    sigma_data: float | None = None
    vae: AutoencoderKL | None = None
    vae_pixel_range: str | None = None


def _variant(component: Path, variant: str | None) -> str | None:
    """``variant`` where the component has weights of that variant, else None: as diffusers' pipeline loader, a
    component saved without variants loads its plain weights."""
    if variant is not None and any(component.glob(f"*.{variant}.safetensors")):
        return variant
    return None


def load_pretrained_edm2_parts(
    path: str | os.PathLike, revision: str | None = None, variant: str | None = None
) -> PretrainedEDM2Parts:
    """Read the parts of a local folder or Hub repo (at ``revision``; weight files of ``variant``, e.g. ``fp16``);
    a folder without them gives an empty result."""
    folder = fetch_folder(path, ["model_index.json", PRECONDITIONER_CONFIG, "uncertainty/*", "vae/*"], revision)
    parts = PretrainedEDM2Parts()
    if (folder / PRECONDITIONER_CONFIG).is_file() and (folder / "uncertainty").is_dir():
        parts.sigma_data = float(EDMPreconditioner.read_config(folder)["sigma_data"])
        parts.uncertainty = LearnedUncertainty.from_pretrained(
            folder / "uncertainty", variant=_variant(folder / "uncertainty", variant)
        )
    index_path = folder / "model_index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text(encoding="utf-8"))
        entry = index.get("vae")
        if isinstance(entry, list) and entry[0] is not None and (folder / "vae").is_dir():
            parts.vae = AutoencoderKL.from_pretrained(folder / "vae", variant=_variant(folder / "vae", variant))
            parts.vae_pixel_range = index.get("vae_pixel_range", "[-1, 1]")
    return parts
