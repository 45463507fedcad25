"""--snr_gamma (Min-SNR loss weighting) and --noise_offset of the DDPM recipe, against diffusers' formulas."""

import pytest
import torch
import torch.nn.functional as F
from _tiny_models import TINY_UNET
from _training_scripts import TRAIN_UNCONDITIONAL, load_script_module
from diffusers import DDPMScheduler, UNet2DModel

from diffusers_scalelong.trainer import DDPMRecipe


def snr_from_alphas(scheduler: DDPMScheduler, timesteps: torch.Tensor) -> torch.Tensor:
    """SNR_t = a_t / (1 - a_t) with a_t the cumulative product of alphas (computed in float64 here)."""
    alpha_bar = scheduler.alphas_cumprod.double()[timesteps]
    return alpha_bar / (1 - alpha_bar)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_min_snr_weights_follow_the_formula(prediction_type):
    scheduler = DDPMScheduler(num_train_timesteps=1000, prediction_type=prediction_type)
    recipe = DDPMRecipe(scheduler, snr_gamma=5.0)
    timesteps = torch.tensor([0, 10, 100, 300, 500, 999])
    snr = snr_from_alphas(scheduler, timesteps)
    expected = snr.clamp(max=5.0) / (snr + 1 if prediction_type == "v_prediction" else snr)
    # float32 SNR (as diffusers' compute_snr) against float64: a few float32 ulps of relative error
    torch.testing.assert_close(recipe.loss_weights(timesteps).double(), expected, rtol=1e-6, atol=0)
    assert (expected[:3] < 1).all() and expected[-1] == pytest.approx(
        1.0 if prediction_type == "epsilon" else 0, abs=1e-4
    )


def test_min_snr_loss_equals_diffusers_example_formula():
    """The weighted loss of one batch equals the expression of diffusers' train_text_to_image.py --snr_gamma."""
    scheduler = DDPMScheduler(num_train_timesteps=1000)
    unet = UNet2DModel(**TINY_UNET)
    images = torch.rand(16, 1, 8, 8) * 2 - 1
    torch.manual_seed(0)  # draws t = 7 among others: SNR > 5 there, so its weight is below 1
    loss = DDPMRecipe(scheduler, snr_gamma=5.0).loss(unet, images)

    torch.manual_seed(0)  # the same noise and timesteps, drawn in the recipe's order
    noise = torch.randn_like(images)
    timesteps = torch.randint(0, 1000, (16,))
    prediction = unet(scheduler.add_noise(images, noise, timesteps), timesteps).sample
    snr = snr_from_alphas(scheduler, timesteps).float()
    weights = torch.stack([snr, 5.0 * torch.ones_like(timesteps)], dim=1).min(dim=1)[0] / snr
    assert weights.min() < 0.1
    per_image = F.mse_loss(prediction, noise, reduction="none").mean(dim=[1, 2, 3])
    # different float32 reduction order (flatten-then-mean vs mean over dims) and float64 SNR: 1e-6 relative
    torch.testing.assert_close(loss, (per_image * weights).mean(), rtol=1e-6, atol=0)

    torch.manual_seed(0)
    plain = DDPMRecipe(scheduler).loss(unet, images)
    assert plain == F.mse_loss(prediction, noise) and plain != loss  # the weighting acts


def test_noise_offset_shifts_the_noise_mean_per_image_and_channel():
    images = torch.zeros(64, 4, 32, 32)
    recipe = DDPMRecipe(DDPMScheduler(), noise_offset=0.5)
    torch.manual_seed(0)
    noise = recipe.draw_noise(images)
    torch.manual_seed(0)
    expected = torch.randn_like(images) + 0.5 * torch.randn(64, 4, 1, 1)
    assert torch.equal(noise, expected)
    # spatial means: variance 0.5^2 + 1/1024; over 256 (image, channel) pairs their std is within 15% of it
    means = noise.mean(dim=(2, 3)).flatten()
    assert means.std().item() == pytest.approx((0.25 + 1 / 1024) ** 0.5, rel=0.15)
    torch.manual_seed(0)
    plain = DDPMRecipe(DDPMScheduler()).draw_noise(images)
    assert plain.mean(dim=(2, 3)).std() < 0.1  # without the offset: 1/32 per mean


def test_recipe_options_reach_the_recipe_and_are_checked():
    script = load_script_module(TRAIN_UNCONDITIONAL)
    config = script.UnconditionalConfig.from_command_line(
        ["--output_dir", "x", "--snr_gamma", "5", "--noise_offset", "0.1"]
    )
    recipe = script.build_recipe(config, script.PretrainedEDM2Parts(), None)
    assert (recipe.snr_gamma, recipe.noise_offset) == (5.0, 0.1)
    with pytest.raises(SystemExit):
        script.UnconditionalConfig.from_command_line(["--output_dir", "x", "--noise_offset", "-1"])
    with pytest.raises(ValueError, match="snr_gamma and noise_offset apply to recipe ddpm only"):
        script.UnconditionalConfig.from_command_line(["--output_dir", "x", "--recipe", "edm2", "--snr_gamma", "5"])
    with pytest.raises(ValueError, match="snr_gamma must be positive"):
        DDPMRecipe(DDPMScheduler(), snr_gamma=0.0)
