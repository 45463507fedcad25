"""A tiny EDM2 network trained with EDM2Loss on the embedded Fashion-MNIST test split."""

import math

import pytest
import torch
import torch.nn.functional as F

from diffusers_scalelong.data import load_fashion_mnist_arrays
from diffusers_scalelong.edm2 import EDM2Loss, EDMPreconditioner, LearnedUncertainty, inverse_sqrt_lr_lambda
from diffusers_scalelong.models import EDM2UNet2DModel

EVAL_SIGMAS = (0.05, 0.2, 0.5, 1.0, 2.0, 5.0)  # within two P_std of P_mean = -0.8 (log scale)


def fashion_mnist(resolution: int, count: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Images in [-1, 1], padded from 28 to 32 pixels and box-filtered to ``resolution``, with their labels."""
    images, labels = load_fashion_mnist_arrays(split="test", embedded=True)
    x = torch.from_numpy(images[:count].copy()).float().div(127.5).sub(1).unsqueeze(1)
    x = F.pad(x, (2, 2, 2, 2), value=-1.0)
    return F.adaptive_avg_pool2d(x, resolution), torch.from_numpy(labels[:count].copy()).long()


def train_and_evaluate(resolution: int, model_channels: int, steps: int, batch_size: int):
    torch.manual_seed(0)
    images, labels = fashion_mnist(resolution)
    unet = EDM2UNet2DModel(sample_size=resolution, in_channels=1, model_channels=model_channels, channel_mult=(1, 2),
                           layers_per_block=1, attention_resolutions=(), channels_per_head=model_channels,
                           num_class_embeds=10)  # fmt: skip
    denoiser = EDMPreconditioner(unet, LearnedUncertainty()).train()
    loss_fn = EDM2Loss(P_mean=-0.8, P_std=1.6)
    optimizer = torch.optim.Adam(denoiser.parameters(), lr=0.01, betas=(0.9, 0.99), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt_lr_lambda(t_ref=steps // 3, warmup_steps=20))
    generator = torch.Generator().manual_seed(0)
    errors = []
    for _ in range(steps):
        index = torch.randint(0, len(images), (batch_size,), generator=generator)
        result = loss_fn(denoiser, images[index], labels[index], generator=generator)
        optimizer.zero_grad(set_to_none=True)
        result.loss.backward()
        optimizer.step()
        scheduler.step()
        errors.append(result.weighted_error.mean().item())

    denoiser.eval()
    held_out, held_out_labels = images[-256:], labels[-256:]
    eval_generator = torch.Generator().manual_seed(1)
    measured, predicted = [], []
    with torch.no_grad():
        for sigma in EVAL_SIGMAS:
            result = loss_fn(denoiser, held_out, held_out_labels, sigma=torch.tensor(sigma), generator=eval_generator)
            measured.append(result.weighted_error.mean().item())
            predicted.append(result.logvar.exp().mean().item())
    return errors, measured, predicted


def check(errors, measured, predicted, improvement, tolerance):
    start, end = sum(errors[:20]) / 20, sum(errors[-50:]) / 50
    assert end < improvement * start, (start, end)
    # exp(u(sigma)) estimates the expected weighted error at sigma: compare in log space, level by level ...
    for sigma, m, p in zip(EVAL_SIGMAS, measured, predicted, strict=True):
        assert abs(math.log(p / m)) < tolerance, (sigma, m, p)
    # ... and its shape over sigma (the error is far from flat after training).
    log_m, log_p = torch.tensor(measured).log(), torch.tensor(predicted).log()
    assert log_m.max() - log_m.min() > 0.5
    assert torch.corrcoef(torch.stack([log_m, log_p]))[0, 1] > 0.9


def test_short_training_lowers_the_loss_and_uncertainty_tracks_the_error():
    errors, measured, predicted = train_and_evaluate(resolution=16, model_channels=16, steps=250, batch_size=16)
    check(errors, measured, predicted, improvement=0.5, tolerance=0.25)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # about 100 s of CPU time; more wall time on a busy machine
def test_longer_training_lowers_the_loss_and_uncertainty_tracks_the_error_closely():
    errors, measured, predicted = train_and_evaluate(resolution=16, model_channels=24, steps=500, batch_size=32)
    check(errors, measured, predicted, improvement=0.6, tolerance=0.15)
