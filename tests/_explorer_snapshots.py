"""Tiny post-hoc EMA snapshot sets of an EDM2 UNet for the explorer and sweep tests (built in well under a second)."""

from __future__ import annotations

from pathlib import Path

import torch

from diffusers_scalelong.ema import PowerFunctionEMA
from diffusers_scalelong.models import EDM2UNet2DModel

SIGMA_RELS = (0.05, 0.10)
TIMES = (10, 20, 30, 40)
TINY_EDM2 = dict(
    sample_size=8, in_channels=1, model_channels=8, channel_mult=(1, 2), layers_per_block=1, channels_per_head=8
)


def write_snapshots(folder: Path, seed: int = 1, times=TIMES, **config) -> Path:
    """Snapshots (sigma_rel 0.05 and 0.10 at ``times``) of a tiny EDM2 UNet following a random walk."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    unet = EDM2UNet2DModel(**{**TINY_EDM2, **config})
    ema = PowerFunctionEMA(unet, sigma_rels=SIGMA_RELS)
    for step in range(1, times[-1] + 1):
        with torch.no_grad():
            for parameter in unet.parameters():
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
        ema.update(unet, step)
        if step in times:
            ema.save_snapshots(str(folder), step, is_main_process=True)
    return folder
