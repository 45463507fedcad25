"""Post-hoc EMA snapshot sets of tiny models following a random walk, for the EMA, Hub, explorer and sweep tests
(each built in well under a second)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from diffusers_scalelong.ema import PowerFunctionEMA
from diffusers_scalelong.models import EDM2UNet2DModel

SIGMA_RELS = (0.05, 0.10)
TIMES = (10, 20, 30, 40)
TINY_EDM2 = dict(
    sample_size=8, in_channels=1, model_channels=8, channel_mult=(1, 2), layers_per_block=1, channels_per_head=8
)


def random_walk_snapshots(
    model: nn.Module,
    folder: Path,
    times: Sequence[int] = TIMES,
    *,
    sigma_rels: Sequence[float] = SIGMA_RELS,
    step_size: float = 0.05,
    seed: int = 1,
) -> Path:
    """Snapshots of ``model`` (moved in place) at each of ``times``: every step adds ``step_size`` times standard
    normal noise (from a generator seeded with ``seed``) to every parameter, then updates the post-hoc EMA."""
    generator = torch.Generator().manual_seed(seed)
    ema = PowerFunctionEMA(model, sigma_rels=sigma_rels)
    for step in range(1, times[-1] + 1):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(step_size * torch.randn(parameter.shape, generator=generator))
        ema.update(model, step)
        if step in times:
            ema.save_snapshots(str(folder), step, is_main_process=True)
    return folder


def write_snapshots(folder: Path, seed: int = 1, times: Sequence[int] = TIMES, **config) -> Path:
    """Snapshots (sigma_rel 0.05 and 0.10 at ``times``) of a tiny EDM2 UNet (``config`` overrides ``TINY_EDM2``),
    initialised and moved with ``seed``."""
    torch.manual_seed(seed)
    return random_walk_snapshots(EDM2UNet2DModel(**{**TINY_EDM2, **config}), folder, times, seed=seed)
