"""Latent-space training data: a VAE with EDM2's latent normalisation, and a disk cache of the VAE's moments.

EDM2 draws ``z ~ N(mu, s^2)`` from the VAE's posterior of the image each time the image is used and trains on the
normalised latents (:mod:`diffusers_scalelong.pipelines.latent_scaling`, which also decodes them); its dataset tool
computes ``(mu, s)`` of every image once. :class:`LatentCodec` holds the VAE and the pixel range it works in;
:func:`cache_latent_moments` writes the moments of a dataset once, to a safetensors file named by a key of everything
that determines them, and :class:`CachedLatents` serves them to the training loop.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ..atomic import atomic_path
from ..pipelines.latent_scaling import VAE_PIXEL_RANGES, has_channel_statistics, normalize_latents, to_vae_range

__all__ = ["VAE_PIXEL_RANGES", "CachedLatents", "LatentCodec", "cache_latent_moments"]


class LatentCodec:
    """A frozen VAE with EDM2's latent normalisation: pixels in [-1, 1] -> moments ``[mu, s]`` -> normalised latents."""

    def __init__(self, vae: AutoencoderKL, pixel_range: str = "[-1, 1]"):
        if not has_channel_statistics(vae.config):
            raise ValueError(
                "vae: the VAE's config has no latents_mean / latents_std; use the VAE of an EDM2 pipeline or set "
                "them with set_edm2_latent_scaling"
            )
        if pixel_range not in VAE_PIXEL_RANGES:
            raise ValueError(f"VAE pixel range must be one of {list(VAE_PIXEL_RANGES)}, got {pixel_range!r}")
        self.vae = vae.eval().requires_grad_(False)
        self.pixel_range = pixel_range

    @property
    def downsampling(self) -> int:
        """Pixels per latent along each side."""
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @torch.no_grad()
    def moments(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[mu, s]`` (2C channels, float32) of the VAE's posterior for images in [-1, 1]."""
        pixels = to_vae_range(pixels.float(), self.pixel_range)
        posterior = self.vae.encode(pixels.to(self.vae.dtype)).latent_dist
        return torch.cat([posterior.mean, posterior.std], dim=1).float()

    def sample(self, moments: torch.Tensor) -> torch.Tensor:
        """Normalised latents of ``z = mu + s n`` (``normalize_latents``) with ``n`` from torch's generator."""
        mu, s = moments.float().chunk(2, dim=1)
        return normalize_latents(mu + torch.randn_like(mu) * s, self.vae.config)

    def describe(self) -> dict[str, Any]:
        """What determines the moments: the VAE's config, its weights' checksum and the pixel range."""
        digest = hashlib.sha256()
        for name, tensor in sorted(self.vae.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().float().numpy().tobytes())
        config = {k: v for k, v in self.vae.config.items() if not k.startswith("_")}
        return {"vae_config": config, "vae_weights_sha256": digest.hexdigest(), "pixel_range": self.pixel_range}


def cache_latent_moments(
    images: torch.utils.data.Dataset,
    codec: LatentCodec,
    cache_dir: str | os.PathLike,
    key_fields: dict[str, Any],
    batch_size: int = 16,
) -> Path:
    """The moments of every item of ``images`` (``{"pixel_values", ["class_labels"]}``, deterministic transform),
    computed once into ``cache_dir/latents-<key>.safetensors`` with a progress bar; later calls with the same key
    (the data description ``key_fields`` and the codec) return the existing file."""
    fields = {**key_fields, **codec.describe()}
    key = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"latents-{key}.safetensors"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    loader = torch.utils.data.DataLoader(images, batch_size=batch_size, shuffle=False)
    moments, labels = [], []
    for batch in tqdm(loader, desc="encoding latents", unit="batch"):
        moments.append(codec.moments(batch["pixel_values"]))
        if "class_labels" in batch:
            labels.append(batch["class_labels"])
    tensors = {"moments": torch.cat(moments).contiguous()}
    if labels:
        tensors["class_labels"] = torch.cat(labels).contiguous()
    with atomic_path(path) as temporary:
        save_file(tensors, str(temporary), metadata={"cache_key": json.dumps(fields, sort_keys=True, default=str)})
    return path


class CachedLatents(torch.utils.data.Dataset):
    """Items ``{"latent_moments": [2C, h, w]}`` (plus ``"class_labels"``) from a :func:`cache_latent_moments` file.

    The file is computed (or found) by :meth:`prepare`, which the trainer calls once it holds the output folder:
    until then nothing is written, and the dataset already knows its length (that of ``images``).
    """

    def __init__(
        self,
        images: torch.utils.data.Dataset,
        codec: LatentCodec,
        cache_dir: str | os.PathLike,
        key_fields: dict[str, Any],
        with_labels: bool = False,
    ):
        self._source = (images, codec, cache_dir, key_fields)
        self._length = len(images)
        self.with_labels = with_labels
        self.moments = self.labels = None

    def prepare(self) -> Path:
        """Compute the cache file if it is missing, then load it; returns its path."""
        path = cache_latent_moments(*self._source)
        tensors = load_file(str(path))
        if len(tensors["moments"]) != self._length:
            raise ValueError(f"{path} holds {len(tensors['moments'])} items, the dataset {self._length}")
        self.moments = tensors["moments"]
        self.labels = tensors.get("class_labels") if self.with_labels else None
        if self.with_labels and self.labels is None:
            raise ValueError(f"{path} holds no class labels: it was cached without class_conditional")
        return path

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict:
        if self.moments is None:
            raise RuntimeError("CachedLatents.prepare() has not run: the trainer calls it once it holds the folder")
        item = {"latent_moments": self.moments[int(index)]}
        if self.labels is not None:
            item["class_labels"] = self.labels[int(index)]
        return item
