"""A tiny real training run (diffusers UNet2DModel, DDPM noise-prediction loss) shared by the post-hoc EMA tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DModel

from diffusers_scalelong.ema import PowerFunctionEMA
from tests._tiny_models import TINY_UNET


def tiny_unet() -> UNet2DModel:
    torch.manual_seed(0)
    return UNet2DModel(**TINY_UNET)


def _batch(step: int, batch_size: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deterministic data for a step: smooth 8x8 images, noise and timesteps from a per-step generator."""
    g = torch.Generator().manual_seed(step)
    freq = torch.rand(batch_size, 1, 1, 1, generator=g) * 3
    grid = torch.linspace(0, 1, 8)
    images = torch.sin(freq * (grid[None, None, :, None] + grid[None, None, None, :]) * 3.14)
    noise = torch.randn(images.shape, generator=g)
    timesteps = torch.randint(0, 100, (batch_size,), generator=g)
    return images, noise, timesteps


class TinyTraining:
    """Model + Adam + PowerFunctionEMA; ``run(first, last)`` trains steps first..last, snapshotting every K."""

    def __init__(self, sigma_rels, snapshot_dir=None, snapshot_every=10, dtype=None):
        self.model = tiny_unet()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=2e-3)
        self.scheduler = DDPMScheduler(num_train_timesteps=100)
        self.ema = PowerFunctionEMA(self.model, sigma_rels=sigma_rels)
        self.snapshot_dir, self.snapshot_every, self.dtype = snapshot_dir, snapshot_every, dtype

    def run(self, first: int, last: int) -> None:
        for step in range(first, last + 1):
            images, noise, timesteps = _batch(step)
            noisy = self.scheduler.add_noise(images, noise, timesteps)
            loss = F.mse_loss(self.model(noisy, timesteps).sample, noise)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            self.ema.update(self.model, step)
            if self.snapshot_dir is not None and step % self.snapshot_every == 0:
                self.ema.save_snapshots(self.snapshot_dir, step, dtype=self.dtype)


def flat(state: dict[str, torch.Tensor], keys) -> torch.Tensor:
    return torch.cat([state[k].double().flatten() for k in keys])
