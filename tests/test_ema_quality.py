"""Slow: samples of a reconstructed EMA score like samples of the same EMA tracked directly (foundation metric)."""

import pytest
import torch
import torch.nn.functional as F
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

from diffusers_scalelong.ema import PowerFunctionEMA, reconstruct_ema
from diffusers_scalelong.metrics import compute_fd_kid
from diffusers_scalelong.metrics.fd_kid import load_reference_images

STEPS, EVERY, SAMPLES = 800, 40, 256


def _sample(state, seed):
    unet = UNet2DModel(**_unet_config())
    unet.load_state_dict(state)
    pipeline = DDPMPipeline(unet=unet.eval(), scheduler=DDPMScheduler(num_train_timesteps=100))
    pipeline.set_progress_bar_config(disable=True)
    images = pipeline(
        batch_size=SAMPLES, generator=torch.Generator().manual_seed(seed), num_inference_steps=50, output_type="np"
    ).images
    return torch.from_numpy(images).permute(0, 3, 1, 2).mul(2).sub(1)


def _unet_config():
    return dict(
        sample_size=16,
        in_channels=1,
        out_channels=1,
        layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
    )


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_reconstructed_ema_samples_score_like_tracked(tmp_path):
    torch.manual_seed(0)
    data = load_reference_images("fashion-mnist-test", num_images=4096, resolution=16)
    model = UNet2DModel(**_unet_config())
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    scheduler = DDPMScheduler(num_train_timesteps=100)
    ema = PowerFunctionEMA(model, sigma_rels=(0.05, 0.10, 0.075))
    generator = torch.Generator().manual_seed(0)
    for step in range(1, STEPS + 1):
        images = data[torch.randint(0, len(data), (32,), generator=generator)]
        noise = torch.randn(images.shape, generator=generator)
        timesteps = torch.randint(0, 100, (32,), generator=generator)
        loss = F.mse_loss(model(scheduler.add_noise(images, noise, timesteps), timesteps).sample, noise)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ema.update(model, step)
        if step % EVERY == 0:
            ema.save_snapshots(tmp_path, step)
    for path in tmp_path.glob("*-0.075.safetensors"):
        path.unlink()  # reconstruct 0.075 from the 0.05 and 0.10 snapshots only
    (reconstructed,) = reconstruct_ema(tmp_path, [0.075])
    tracked = ema.averaged_state_dict(0.075)

    def fd(images):
        return compute_fd_kid(images)["FD-FMNISTNet"]

    fd_tracked, fd_reconstructed = fd(_sample(tracked, 1)), fd(_sample(reconstructed, 1))
    fd_tracked_other_seed = fd(_sample(tracked, 2))
    noise = abs(fd_tracked - fd_tracked_other_seed)
    print(
        f"FD-FMNISTNet tracked {fd_tracked:.3f} (seed 2: {fd_tracked_other_seed:.3f}), reconstructed {fd_reconstructed:.3f}"
    )
    assert abs(fd_reconstructed - fd_tracked) <= max(noise, 0.02 * fd_tracked)
