"""ScaleLong UNets in diffusers' own pipelines (DDPM, DDIM, Stable Diffusion) by plain component swap."""

from __future__ import annotations

import json
import string

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKL,
    DDIMPipeline,
    DDIMScheduler,
    DDPMPipeline,
    DDPMScheduler,
    DiffusionPipeline,
    StableDiffusionPipeline,
    UNet2DConditionModel,
    UNet2DModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from diffusers_scalelong.models import ScaleLongUNet2DConditionModel, ScaleLongUNet2DModel
from tests._exact import realign
from tests._tiny_models import TINY_CONDITION_UNET, TINY_UNET

UNET = TINY_UNET


def swapped_unets(lsc_method: str) -> tuple[UNet2DModel, ScaleLongUNet2DModel]:
    torch.manual_seed(0)
    vanilla = UNet2DModel(**UNET).eval()
    scalelong = ScaleLongUNet2DModel(**UNET, lsc_method=lsc_method).eval()
    scalelong.load_state_dict(vanilla.state_dict(), strict=False)
    return vanilla, scalelong


def run(pipe, **kwargs):
    return pipe(batch_size=2, generator=torch.Generator().manual_seed(0), output_type="np", **kwargs).images


@pytest.mark.parametrize(
    "pipeline_cls, scheduler, kwargs",
    [
        (DDPMPipeline, DDPMScheduler(num_train_timesteps=20), dict(num_inference_steps=20)),
        (DDIMPipeline, DDIMScheduler(num_train_timesteps=50), dict(num_inference_steps=5)),
    ],
)
def test_scalelong_unet_swaps_into_diffusers_unconditional_pipelines(pipeline_cls, scheduler, kwargs, tmp_path):
    vanilla, identity = swapped_unets("none")
    reference = run(pipeline_cls(unet=vanilla, scheduler=scheduler), **kwargs)
    # exact: lsc_method='none' runs the same operations as the diffusers UNet
    np.testing.assert_array_equal(run(pipeline_cls(unet=identity, scheduler=scheduler), **kwargs), reference)

    _, scaled = swapped_unets("cs")
    pipe = pipeline_cls(unet=scaled, scheduler=scheduler)
    images = run(pipe, **kwargs)
    assert images.shape == reference.shape and np.abs(images - reference).max() > 1e-4  # the scaling acts
    pipe.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "model_index.json").read_text())["unet"][1] == "ScaleLongUNet2DModel"
    loaded = DiffusionPipeline.from_pretrained(tmp_path)
    assert isinstance(loaded, pipeline_cls) and isinstance(loaded.unet, ScaleLongUNet2DModel)
    assert loaded.unet.config.lsc_method == "cs"
    np.testing.assert_array_equal(run(realign(loaded), **kwargs), images)  # see tests/_exact.py


def tiny_tokenizer() -> CLIPTokenizer:
    """A CLIP BPE tokenizer over lowercase letters (no merges), built locally."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for letter in string.ascii_lowercase:
        vocab[letter] = len(vocab)
        vocab[letter + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=16)


def tiny_sd_pipeline(unet) -> StableDiffusionPipeline:
    torch.manual_seed(1)
    tokenizer = tiny_tokenizer()
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=16,
            projection_dim=16,
        )
    ).eval()
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(8,),
        latent_channels=4,
        norm_num_groups=4,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
    ).eval()
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=DDIMScheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def tiny_condition_unets(lsc_method: str):
    config = dict(TINY_CONDITION_UNET, cross_attention_dim=16, attention_head_dim=4)
    torch.manual_seed(0)
    vanilla = UNet2DConditionModel(**config).eval()
    scalelong = ScaleLongUNet2DConditionModel(**config, lsc_method=lsc_method).eval()
    scalelong.load_state_dict(vanilla.state_dict(), strict=False)
    return vanilla, scalelong


def test_scalelong_condition_unet_swaps_into_stable_diffusion_pipeline(tmp_path):
    def sample(pipe):
        return pipe(
            ["a shirt", "a shoe"],
            num_inference_steps=3,
            guidance_scale=3.0,
            height=8,
            width=8,
            generator=torch.Generator().manual_seed(0),
            output_type="np",
        ).images

    vanilla, identity = tiny_condition_unets("none")
    reference = sample(tiny_sd_pipeline(vanilla))
    np.testing.assert_array_equal(sample(tiny_sd_pipeline(identity)), reference)  # the same operations
    _, scaled = tiny_condition_unets("cs")
    pipe = tiny_sd_pipeline(scaled)
    images = sample(pipe)
    assert images.shape == (2, 8, 8, 3) and np.abs(images - reference).max() > 1e-5
    pipe.save_pretrained(tmp_path / "sd")
    loaded = DiffusionPipeline.from_pretrained(tmp_path / "sd")
    assert isinstance(loaded, StableDiffusionPipeline) and isinstance(loaded.unet, ScaleLongUNet2DConditionModel)
    np.testing.assert_array_equal(sample(realign(loaded)), images)  # see tests/_exact.py
