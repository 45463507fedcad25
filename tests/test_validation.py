"""Numbers no model can use are refused where they enter, with an error naming the option and the range."""

import math

import numpy as np
import pytest
import torch

from diffusers_scalelong import (
    EDM2Loss,
    EDM2UNet2DModel,
    EDMHeunScheduler,
    PowerFunctionEMA,
    apply_lsc,
    reconstruct_ema,
)
from diffusers_scalelong.validation import check_number

TINY = dict(
    sample_size=8,
    in_channels=1,
    model_channels=8,
    channel_mult=(1,),
    layers_per_block=1,
    attention_resolutions=(),
    channels_per_head=8,
)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: EDM2UNet2DModel(**TINY, lsc_method="cs", lsc_kappa=math.inf), "lsc_kappa must be a finite number"),
        (lambda: EDM2UNet2DModel(**TINY, lsc_method="cs", lsc_kappa=0.0), r"lsc_kappa must lie in \(0, inf\)"),
        (lambda: EDM2UNet2DModel(**TINY, dropout=2.0), r"dropout must lie in \[0, 1\)"),
        (lambda: EDM2UNet2DModel(**TINY, num_class_embeds=-1), "num_class_embeds must be None or an integer >= 1"),
        (lambda: EDM2Loss(P_mean=math.nan), "P_mean must be a finite number"),
        (lambda: EDM2Loss(P_std=0.0), r"P_std must lie in \(0, 6\.9"),
        (lambda: EDMHeunScheduler(rho=0), r"rho must lie in \(0, inf\)"),
        (lambda: EDMHeunScheduler(S_churn=math.nan), "S_churn must be a finite number"),
        (lambda: EDMHeunScheduler(sigma_max=math.inf), "sigma_max must be a finite number"),
        (lambda: PowerFunctionEMA(torch.nn.Linear(2, 2), sigma_rels="0.1"), "sigma_rels must be a sequence of numbers"),
        (lambda: reconstruct_ema("unused-folder", target_sigma_rels="0.1"), "target_sigma_rels must be a sequence"),
    ],
)
def test_unusable_numbers_are_refused_naming_the_option(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_apply_lsc_refuses_an_infinite_kappa():
    from diffusers import UNet2DModel

    unet = UNet2DModel(
        sample_size=8, in_channels=1, out_channels=1, block_out_channels=(8, 16), norm_num_groups=4,
        down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
    )  # fmt: skip
    with pytest.raises(ValueError, match="lsc_kappa must be a finite number"):
        apply_lsc(unet, "cs", kappa=math.inf)


def test_usable_numbers_pass_in_any_numeric_type():
    assert check_number("x", np.float32(0.5), 0.0, 1.0) == 0.5 and check_number("x", 3, 0) == 3.0
    EDMHeunScheduler(S_max=math.inf)  # no upper limit of the churn range, as EDM's own default
    assert PowerFunctionEMA(torch.nn.Linear(2, 2), sigma_rels=np.array([0.05, 0.1])).sigma_rels == (0.05, 0.1)
    with pytest.raises(ValueError, match=r"x must lie in \[0, 1\], got 2"):
        check_number("x", 2, 0.0, 1.0)
    with pytest.raises(ValueError, match="x must be a finite number, got True"):
        check_number("x", True)
