"""Values no scheduler, pipeline, loss or network can use are refused where they enter, with a ValueError naming the
parameter as the Python API spells it; a sampling run that ends in NaN or inf says so instead of returning black
images. diffusers' own schedulers serve as the reference of what goes wrong without these checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, EDMEulerScheduler

from diffusers_scalelong import (
    EDM2Loss,
    EDM2Pipeline,
    EDM2UNet2DModel,
    EDMHeunScheduler,
    ScaleLongUNet2DConditionModel,
    ScaleLongUNet2DModel,
    UViT2DModel,
)
from diffusers_scalelong.edm2 import EDMPreconditioner, LearnedUncertainty
from diffusers_scalelong.models.config_checks import (
    check_conv_unet_config,
    check_edm2_unet_config,
    check_uvit_config,
)
from diffusers_scalelong.pipelines import set_edm2_latent_scaling
from diffusers_scalelong.validation import MAX_PARAMETERS, conv_unet_parameter_floor
from tests._tiny_models import TINY_CONDITION_UNET, TINY_EDM2_UNET, TINY_UNET

TINY_UVIT = dict(sample_size=8, patch_size=2, in_channels=1, embed_dim=16, depth=2, num_heads=2)
CONDITION = {**TINY_CONDITION_UNET, "cross_attention_dim": 8, "attention_head_dim": 4}


def refused(build, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()


# ---------------------------------------------------------------- scheduler
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sigma_max=1e200), r"sigma_max must lie in \[1e-18, 1e\+18\], got 1e\+200"),
        (dict(sigma_min=1e-320), r"sigma_min must lie in \[1e-18, 1e\+18\]"),
        (dict(sigma_min=0.0), "sigma_min must lie in"),
        (dict(sigma_data=0.0), "sigma_data must lie in"),
        (dict(sigma_data=math.nan), "sigma_data must be a finite number"),
        (dict(sigma_min=5.0, sigma_max=1.0), "need sigma_min < sigma_max"),
        (dict(rho=1e-3), "rho=0.001 .* leaves float64's range"),
        (dict(num_train_timesteps=0), r"num_train_timesteps must be an integer in \[1, 100000\]"),
        (dict(num_train_timesteps=2.5), "num_train_timesteps must be an integer"),
    ],
)
def test_scheduler_config_refused(kwargs, match):
    refused(lambda: EDMHeunScheduler(**kwargs), match)


def test_diffusers_scheduler_turns_the_refused_sigmas_into_inf():
    """The reference: diffusers' EDMEulerScheduler takes these sigmas and samples from inf / with timestep -inf."""
    euler = EDMEulerScheduler(sigma_max=1e200)
    euler.set_timesteps(4)
    assert torch.isinf(euler.sigmas[0]) and torch.isinf(euler.timesteps[0])
    euler = EDMEulerScheduler(sigma_min=1e-320)
    euler.set_timesteps(4)
    assert euler.sigmas[-2] == 0 and torch.isinf(euler.timesteps[-1])
    # everything diffusers' EDM schedulers use by default converts and samples
    heun = EDMHeunScheduler.from_config(EDMEulerScheduler().config)
    heun.set_timesteps(4)
    assert torch.isfinite(heun.sigmas).all() and torch.isfinite(heun.timesteps).all()


def test_too_many_steps_for_a_narrow_sigma_range_are_refused():
    # c_noise = ln(sigma) / 4 near 1.0955 spans 3.1e-7, about 2.6 float32 ulps (1.2e-7): 1000 steps must collide
    scheduler = EDMHeunScheduler(sigma_min=80.0, sigma_max=80.0001, num_train_timesteps=2)
    refused(lambda: scheduler.set_timesteps(1000), "num_inference_steps=1000 is too many .* same float32 timestep")
    refused(lambda: scheduler.set_timesteps(10**6), r"num_inference_steps must be an integer in \[1, 100000\]")
    scheduler.set_timesteps(2)  # two steps stay distinct


def heun(steps: int = 3) -> EDMHeunScheduler:
    scheduler = EDMHeunScheduler()
    scheduler.set_timesteps(steps)
    return scheduler


def test_step_refuses_a_model_output_of_another_shape():
    scheduler, sample = heun(), torch.randn(2, 1, 4, 4)
    t = scheduler.timesteps[0]
    refused(lambda: scheduler.step(torch.zeros(3, 1, 4, 4), t, sample), r"model_output has shape \[3, 1, 4, 4\]")
    refused(lambda: scheduler.step(torch.zeros(2, 1, 4, 2), t, sample), r"but sample has shape \[2, 1, 4, 4\]")
    assert scheduler.step_index is None  # nothing advanced
    scheduler.step(torch.zeros_like(sample), t, sample)
    assert scheduler.step_index == 1


def test_step_refuses_timesteps_out_of_order_and_past_the_end():
    scheduler, sample = heun(), torch.randn(1, 1, 4, 4)
    timesteps = scheduler.timesteps
    sample = scheduler.step(torch.zeros_like(sample), timesteps[0], sample).prev_sample
    # without churn timesteps[2] equals timesteps[1] (the correction and the next Euler step share t_1)
    refused(lambda: scheduler.step(torch.zeros_like(sample), timesteps[3], sample), r"not the scheduler's next entry")
    refused(lambda: scheduler.step(torch.zeros_like(sample), timesteps[0], sample), r"timesteps\[1\]")
    for t in timesteps[1:]:
        # a float equal to the entry is accepted as well as the entry itself
        sample = scheduler.step(torch.zeros_like(sample), float(t), sample).prev_sample
    refused(lambda: scheduler.step(torch.zeros_like(sample), timesteps[-1], sample), "have been stepped")


def test_add_noise_refuses_mismatched_shapes():
    scheduler, x = heun(), torch.zeros(2, 1, 4, 4)
    refused(lambda: scheduler.add_noise(x, torch.zeros(2, 1, 4, 3), scheduler.timesteps[:2]), "noise has shape")
    refused(lambda: scheduler.add_noise(x, torch.zeros_like(x), scheduler.timesteps[:3]), "timesteps has 3 values")


# ---------------------------------------------------------------- pipeline
def tiny_edm2(**overrides) -> EDM2UNet2DModel:
    torch.manual_seed(0)
    model = EDM2UNet2DModel(**{**TINY_EDM2_UNET, **overrides}).eval()
    with torch.no_grad():
        model.out_gain.fill_(1.0)
    return model


def tiny_vae() -> AutoencoderKL:
    torch.manual_seed(3)
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), latent_channels=1, norm_num_groups=4,
        sample_size=16,
    ).eval()  # fmt: skip


def pipe(**components) -> EDM2Pipeline:
    pipeline = EDM2Pipeline(unet=tiny_edm2(), scheduler=EDMHeunScheduler(), **components)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def sample(pipeline: EDM2Pipeline, **kwargs):
    kwargs.setdefault("output_type", "np")
    return pipeline(num_inference_steps=2, generator=torch.manual_seed(0), **kwargs).images


def test_pipeline_refuses_diffusers_schedulers_with_unusable_sigmas():
    refused(
        lambda: EDM2Pipeline(unet=tiny_edm2(), scheduler=EDMEulerScheduler(sigma_max=1e200)),
        r"scheduler.config.sigma_max must lie in \[1e-18, 1e\+18\]",
    )
    pipeline = pipe()
    pipeline.scheduler = EDMEulerScheduler(sigma_min=1e-320)  # swapped in after construction: caught by the call
    refused(lambda: sample(pipeline), r"the scheduler's timesteps hold NaN or inf: scheduler.config.sigma_min=1e-320")
    pipeline.scheduler = EDMEulerScheduler()
    assert np.isfinite(sample(pipeline)).all()


@pytest.mark.parametrize("guidance_scale", [math.nan, math.inf])
def test_pipeline_refuses_a_non_finite_guidance_scale(guidance_scale):
    pipeline = pipe(guide_unet=tiny_edm2())
    refused(lambda: sample(pipeline, guidance_scale=guidance_scale), "guidance_scale must be a finite number")


def test_pipeline_refuses_a_non_finite_guidance_scale_set_by_a_callback():
    def set_nan(pipeline, i, t, kwargs):
        pipeline._guidance_scale = math.nan
        return kwargs

    pipeline = pipe(guide_unet=tiny_edm2())
    refused(lambda: sample(pipeline, guidance_scale=2.0, callback_on_step_end=set_nan), "guidance_scale must be")


@pytest.mark.parametrize(
    "config, match",
    [
        (dict(scaling_factor=0.0), r"vae.config.scaling_factor must lie in \(0, inf\), got 0.0"),
        (dict(scaling_factor=math.nan), "vae.config.scaling_factor must be a finite number"),
        (dict(latents_mean=[0.0], latents_std=[0.0]), r"vae.config.latents_std\[0\] must lie in \(0, inf\)"),
        (dict(latents_mean=[math.inf], latents_std=[1.0]), r"vae.config.latents_mean\[0\] must be a finite"),
    ],
)
def test_pipeline_refuses_a_vae_scaling_that_decodes_nan(config, match):
    pipeline = pipe(vae=tiny_vae())
    pipeline.vae.register_to_config(**config)
    refused(lambda: sample(pipeline), match)
    assert sample(pipeline, output_type="latent").shape == (1, 1, 8, 8)  # latents need no VAE scaling


def test_set_edm2_latent_scaling_refuses_zero_std():
    refused(lambda: set_edm2_latent_scaling(tiny_vae(), [0.0], [0.0]), r"latents_std\[0\] must lie in \(0, inf\)")
    refused(lambda: set_edm2_latent_scaling(tiny_vae(), [0.0], [1.0], final_std=math.inf), "final_std must be")


def test_pipeline_refuses_nan_latents():
    latents = torch.randn(1, 1, 8, 8)
    latents[0, 0, 3, 3] = math.nan
    refused(lambda: sample(pipe(), latents=latents), "latents hold NaN or inf")
    refused(lambda: sample(pipe(), latents=torch.zeros(1, 1, 8, 8, dtype=torch.long)), "latents must be a float")


def test_pipeline_names_nan_weights_instead_of_returning_black_images():
    pipeline = pipe()
    with torch.no_grad():
        pipeline.unet.conv_out.weight[0, 0, 1, 1] = math.nan
    refused(lambda: sample(pipeline), r"at step 0 of 3 .* weights hold NaN or inf \(unet.conv_out.weight\)")


def test_pipeline_names_a_callback_that_returns_nan():
    def poison(pipeline, i, t, kwargs):
        return {"latents": torch.full_like(kwargs["latents"], math.nan)} if i == 2 else kwargs

    refused(lambda: sample(pipe(), callback_on_step_end=poison), "a callback_on_step_end returned them")


def test_pipeline_names_a_vae_that_decodes_nan():
    pipeline = pipe(vae=tiny_vae())
    with torch.no_grad():
        pipeline.vae.post_quant_conv.weight.fill_(math.nan)
    refused(lambda: sample(pipeline), "the VAE decoded NaN or inf from finite latents")


def test_pipeline_still_samples_finite_images():
    images = sample(pipe(vae=tiny_vae()), batch_size=2)
    assert images.shape == (2, 16, 16, 3) and np.isfinite(images).all()


# ---------------------------------------------------------------- loss and preconditioner
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(P_mean=50.0), r"P_mean must lie in \[-41.4"),
        (dict(P_std=-1.0), r"P_std must lie in \(0, 6.9"),
        (dict(P_std=math.inf), "P_std must be a finite number"),
        (dict(P_mean=30.0, P_std=2.0), r"P_mean=30.0 and P_std=2.0 draw noise levels"),
        (dict(sigma_data=0.0), "sigma_data must lie in"),
        (dict(sigma_data=math.nan), "sigma_data must be a finite number"),
    ],
)
def test_loss_parameters_refused_by_name(kwargs, match):
    refused(lambda: EDM2Loss(**kwargs), match)


def test_loss_refuses_bad_images_and_sigma():
    denoiser = EDMPreconditioner(tiny_edm2(), LearnedUncertainty(8))
    images = torch.zeros(2, 1, 8, 8)
    loss = EDM2Loss()
    refused(lambda: loss(denoiser, images[0]), r"images must be a float tensor \[B, C, H, W\]")
    refused(lambda: loss(denoiser, images.long()), "images must be a float tensor")
    refused(lambda: loss(denoiser, images, sigma=torch.tensor([1.0, -1.0])), r"sigma must lie in \[1e-18")
    refused(lambda: loss(denoiser, images, sigma=math.nan), "sigma must lie in")
    refused(lambda: loss(denoiser, images, sigma=torch.ones(3)), "sigma must hold 1 or 2")
    assert torch.isfinite(loss(denoiser, images, sigma=torch.tensor([0.5, 2.0])).loss)


def test_preconditioner_refuses_bad_parts():
    refused(lambda: EDMPreconditioner(tiny_edm2(), sigma_data=0.0), "sigma_data must lie in")
    refused(lambda: EDMPreconditioner(tiny_edm2(), sigma_data=1e30), "sigma_data must lie in")
    refused(lambda: EDMPreconditioner("unet"), "unet must be a torch module")
    refused(lambda: EDMPreconditioner(tiny_edm2(), uncertainty=3), "uncertainty must be None or a LearnedUncertainty")


# ---------------------------------------------------------------- network configs
@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: ScaleLongUNet2DModel(**{**TINY_UNET, "sample_size": 0}), r"sample_size must be an integer in \[1, 65536\]"),
        (lambda: ScaleLongUNet2DModel(**{**TINY_UNET, "sample_size": (8, 0)}), r"sample_size\[1\] must be an integer"),
        (lambda: ScaleLongUNet2DModel(**{**TINY_UNET, "block_out_channels": (0, 16)}), r"block_out_channels\[0\] must"),
        (lambda: ScaleLongUNet2DModel(**{**TINY_UNET, "block_out_channels": (8, -16)}), r"block_out_channels\[1\] must"),
        (lambda: ScaleLongUNet2DModel(**{**TINY_UNET, "block_out_channels": (8, 10)}), "not divisible by norm_num_groups"),
        (lambda: ScaleLongUNet2DModel(**{**TINY_UNET, "layers_per_block": 0}), "layers_per_block must be an integer"),
        (lambda: ScaleLongUNet2DModel(**{**TINY_UNET, "in_channels": 2.0}), "in_channels must be an integer"),
        (lambda: ScaleLongUNet2DModel(**{**TINY_UNET, "block_out_channels": (8, 10**6)}), "at least 2.7e\\+13 param"),
        (lambda: ScaleLongUNet2DConditionModel(**{**CONDITION, "sample_size": 0}), "sample_size must be an integer"),
        (lambda: ScaleLongUNet2DConditionModel(**{**CONDITION, "block_out_channels": (0, 16)}), "block_out_channels"),
        (lambda: ScaleLongUNet2DConditionModel(**{**CONDITION, "layers_per_block": (1, 0)}), r"layers_per_block\[1\]"),
        (lambda: ScaleLongUNet2DConditionModel(**{**CONDITION, "cross_attention_dim": 0}), "cross_attention_dim must"),
        (lambda: ScaleLongUNet2DModel(**{**TINY_UNET, "time_embedding_dim": 0}), "time_embedding_dim must be None or"),
        (lambda: ScaleLongUNet2DModel(**{**TINY_UNET, "time_embedding_dim": 10**7}), "at least 1e\\+14 parameters"),
        (lambda: ScaleLongUNet2DModel(**{**TINY_UNET, "num_class_embeds": 10**11}), "at least 3.2e\\+12 parameters"),
        (lambda: EDM2UNet2DModel(**{**TINY_EDM2_UNET, "sample_size": 0}), "sample_size must be an integer in"),
        (lambda: EDM2UNet2DModel(**{**TINY_EDM2_UNET, "sample_size": 10**6}), r"sample_size must be an integer in"),
        (lambda: EDM2UNet2DModel(**{**TINY_EDM2_UNET, "model_channels": 0}), "model_channels must be an integer in"),
        (lambda: EDM2UNet2DModel(**{**TINY_EDM2_UNET, "model_channels": 8.5}), "model_channels must be an integer"),
        (lambda: EDM2UNet2DModel(**{**TINY_EDM2_UNET, "channel_mult": (1, -2)}), r"channel_mult\[1\] must be"),
        (lambda: EDM2UNet2DModel(**{**TINY_EDM2_UNET, "channel_mult": ()}), "channel_mult must not be empty"),
        (lambda: EDM2UNet2DModel(**{**TINY_EDM2_UNET, "channels_per_head": 0}), "channels_per_head must be an"),
        (lambda: EDM2UNet2DModel(**{**TINY_EDM2_UNET, "channels_per_head": 3}), "not divisible by channels_per_head=3"),
        (lambda: EDM2UNet2DModel(**{**TINY_EDM2_UNET, "clip_act": 0.0}), r"clip_act must lie in \(0, inf\)"),
        (lambda: EDM2UNet2DModel(**{**TINY_EDM2_UNET, "model_channels": 10**6}), "EDM2UNet2DModel config describes"),
        (lambda: EDM2UNet2DModel(**{**TINY_EDM2_UNET, "num_class_embeds": 10**12}), "describes at least"),
        (lambda: UViT2DModel(**{**TINY_UVIT, "sample_size": 0}), "sample_size must be an integer in"),
        (lambda: UViT2DModel(**{**TINY_UVIT, "patch_size": 0}), "patch_size must be an integer in"),
        (lambda: UViT2DModel(**{**TINY_UVIT, "embed_dim": 0}), "embed_dim must be an integer in"),
        (lambda: UViT2DModel(**{**TINY_UVIT, "num_heads": 0}), "num_heads must be an integer in"),
        (lambda: UViT2DModel(**{**TINY_UVIT, "num_heads": 3}), "embed_dim=16 must be divisible by num_heads=3"),
        (lambda: UViT2DModel(**{**TINY_UVIT, "depth": 3}), "depth must be an even number"),
        (lambda: UViT2DModel(**{**TINY_UVIT, "mlp_ratio": math.nan}), "mlp_ratio must be a finite number"),
        (lambda: UViT2DModel(**{**TINY_UVIT, "embed_dim": 10**6, "num_heads": 1}), "UViT2DModel config describes"),
        (lambda: LearnedUncertainty(0), r"num_channels must be an integer in \[1, 2e\+10\]"),
        (lambda: LearnedUncertainty(2.5), "num_channels must be an integer"),
    ],
)  # fmt: skip
def test_network_config_refused_naming_the_field(build, match):
    refused(build, match)


def parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_parameter_counts_from_the_config_are_lower_bounds_of_the_built_networks():
    """The cap is applied to a count computed from the config: it must never exceed what the network really has
    (else a buildable config could be refused), and should be near it (else the cap would mean little)."""
    conv = ScaleLongUNet2DModel(**{**TINY_UNET, "block_out_channels": (16, 32)})
    floor = conv_unet_parameter_floor((16, 32), (1, 1)) + 9 * 16 * 2
    floor += 64 * 64  # the time embedding's second layer, 4 * 16 wide
    # the floor counts one of each resnet's two convolutions, one time embedding layer and no resampling: 4.2x measured
    assert floor <= parameters(conv) < 6 * floor
    condition = ScaleLongUNet2DConditionModel(**CONDITION)
    floor = conv_unet_parameter_floor((8, 16), (1, 1)) + 9 * 8 * 8 + 32 * 32 + 2 * 8 * 8  # cross-attention: 8 -> 8
    # one conv per resnet, one time layer, one cross-attention's to_k/to_v (transformers otherwise left out): 5.0x measured
    assert floor <= parameters(condition) < 6 * floor
    edm2 = EDM2UNet2DModel(**{**TINY_EDM2_UNET, "model_channels": 16, "num_class_embeds": 10})
    widths, emb = (16, 32), 32
    floor = conv_unet_parameter_floor(widths, (1, 1)) + emb * (16 + 10) + 9 * 16 * (1 + 1 + 1)
    # one 3x3 convolution w -> w per block, no wider decoder inputs, embedding projections or resampling blocks:
    # 5.1x measured at this size
    assert floor <= parameters(edm2) < 6 * floor
    uvit = UViT2DModel(**TINY_UVIT, num_class_embeds=3)
    dim, tokens = 16, 2 + 16
    exact_weights = 3 * (4 + 2 * 4) * dim**2 + 2 * dim**2 + (tokens + 3 + 4 * 1) * dim
    # the rest is biases, norms, patch embedding and the output conv: a few hundred parameters at this size
    assert exact_weights <= parameters(uvit) < exact_weights + 1000


def test_the_largest_real_configs_pass_the_checks():
    """SDXL's UNet (2.6e9 parameters), EDM2-XXL and a U-ViT-H-like transformer stay well under the cap."""
    check_conv_unet_config(
        "ScaleLongUNet2DConditionModel", sample_size=128, in_channels=4, out_channels=4,
        block_out_channels=(320, 640, 1280), layers_per_block=2, norm_num_groups=32, norm_eps=1e-5, dropout=0.0,
        num_class_embeds=None, attention_head_dim=(5, 10, 20),
    )  # fmt: skip
    preset = EDM2UNet2DModel.get_preset("XXL")
    check_edm2_unet_config(
        sample_size=preset.sample_size, in_channels=preset.in_channels, out_channels=None,
        model_channels=preset.model_channels, channel_mult=(1, 2, 3, 4), channel_mult_noise=None,
        channel_mult_emb=None, layers_per_block=3, attention_resolutions=(16, 8), channels_per_head=64,
        clip_act=256, num_class_embeds=1000,
    )  # fmt: skip
    check_uvit_config(
        sample_size=64, patch_size=2, in_channels=4, out_channels=None, embed_dim=1152, depth=28, num_heads=16,
        mlp_ratio=4.0, num_class_embeds=1000,
    )  # fmt: skip
    assert conv_unet_parameter_floor((1280,), (2,)) * 100 < MAX_PARAMETERS
