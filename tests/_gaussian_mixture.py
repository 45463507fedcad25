"""Test helpers for the EDM sampler tests: a Gaussian-mixture data distribution whose denoiser is known in closed form.

For data ``x0 ~ sum_k w_k N(mu_k, s_k^2 I)`` the noisy marginal at level sigma is
``sum_k w_k N(mu_k, (s_k^2 + sigma^2) I)`` and the ideal denoiser is
``D(x; sigma) = sum_k r_k(x) (mu_k + s_k^2 / (s_k^2 + sigma^2) (x - mu_k))`` with responsibilities
``r_k ∝ w_k N(x; mu_k, (s_k^2 + sigma^2) I)``.
"""

from __future__ import annotations

import math

import torch


class GaussianMixture:
    def __init__(self, means: torch.Tensor, stds: torch.Tensor, weights: torch.Tensor):
        self.means = means.double()  # [K, d]
        self.stds = stds.double()  # [K]
        self.weights = weights.double() / weights.sum()  # [K]

    @classmethod
    def default(cls, dim: int = 2) -> GaussianMixture:
        g = torch.Generator().manual_seed(123)
        means = torch.randn(3, dim, generator=g, dtype=torch.float64) * 0.6
        return cls(means, torch.tensor([0.15, 0.3, 0.2]), torch.tensor([0.5, 0.3, 0.2]))

    def denoise(self, x: torch.Tensor, sigma: float | torch.Tensor) -> torch.Tensor:
        """Closed-form ``E[x0 | x0 + sigma n = x]`` for a batch ``x`` of shape [B, d] (float64)."""
        x = x.double()
        sigma = torch.as_tensor(sigma, dtype=torch.float64)
        var = self.stds**2 + sigma**2  # [K]
        d = x.shape[-1]
        sq = ((x[:, None, :] - self.means[None]) ** 2).sum(-1)  # [B, K]
        log_r = torch.log(self.weights) - 0.5 * sq / var - 0.5 * d * torch.log(2 * math.pi * var)
        r = torch.softmax(log_r, dim=-1)
        shrink = (self.stds**2 / var)[None, :, None]
        per_component = self.means[None] + shrink * (x[:, None, :] - self.means[None])
        return (r[..., None] * per_component).sum(1)


class MixtureNetwork(torch.nn.Module):
    """The raw network F whose EDM-preconditioned denoiser is the mixture's exact denoiser.

    It receives what a diffusers EDM scheduler gives a model: ``c_in x`` and ``c_noise = ln(sigma)/4``, and returns
    ``F = (D(x; sigma) - c_skip x) / c_out`` (``prediction_type="epsilon"`` in diffusers' EDM schedulers).
    """

    def __init__(self, mixture: GaussianMixture, sigma_data: float = 0.5):
        super().__init__()
        self.mixture = mixture
        self.sigma_data = sigma_data
        self.calls = 0

    def forward(self, scaled_x: torch.Tensor, c_noise: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        sigma = torch.exp(4 * torch.as_tensor(c_noise, dtype=torch.float64)).reshape(())
        sd = self.sigma_data
        x = scaled_x.double() * torch.sqrt(sigma**2 + sd**2)
        c_skip = sd**2 / (sigma**2 + sd**2)
        c_out = sigma * sd / torch.sqrt(sigma**2 + sd**2)
        return ((self.mixture.denoise(x, sigma) - c_skip * x) / c_out).to(scaled_x.dtype)


def run_scheduler(scheduler, network, x_start: torch.Tensor, num_steps: int, generator=None) -> torch.Tensor:
    """The standard diffusers denoising loop, starting from the given sample."""
    scheduler.set_timesteps(num_steps)
    x = x_start
    for t in scheduler.timesteps:
        out = network(scheduler.scale_model_input(x, t), t)
        x = scheduler.step(out, t, x, generator=generator).prev_sample
    return x


def tiny_unet(num_class_embeds: int | None = None, in_channels: int = 1, sample_size: int = 8, seed: int = 0):
    """A small diffusers UNet2DModel used as the raw F network (positional embedding of the c_noise timestep)."""
    from diffusers import UNet2DModel

    torch.manual_seed(seed)
    return UNet2DModel(
        sample_size=sample_size,
        in_channels=in_channels,
        out_channels=in_channels,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        layers_per_block=1,
        norm_num_groups=4,
        time_embedding_type="positional",
        num_class_embeds=num_class_embeds,
    ).eval()
