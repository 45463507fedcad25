"""The long-skip protocol: every model family reports its skips, and the decoder really meets them where it says."""

import pytest
import torch
from diffusers import UNet2DModel

from diffusers_scalelong.models import EDM2UNet2DModel, ScaleLongUNet2DModel, UViT2DModel
from diffusers_scalelong.scalelong import HasLongSkips, long_skip_layout
from tests._tiny_models import TINY_ATTENTION_UNET, TINY_EDM2_UNET

FAMILIES = {
    "conv": lambda: ScaleLongUNet2DModel(**TINY_ATTENTION_UNET, lsc_method="cs", lsc_kappa=0.5),
    "uvit": lambda: UViT2DModel(
        sample_size=8, patch_size=2, in_channels=1, embed_dim=16, depth=4, num_heads=2, lsc_method="cs", lsc_kappa=0.5
    ),
    "edm2": lambda: EDM2UNet2DModel(**TINY_EDM2_UNET, lsc_method="cs", lsc_kappa=0.5),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_layout_matches_the_scaling_and_the_tensors_met_in_the_forward(family):
    model = FAMILIES[family]().eval()
    assert isinstance(model, HasLongSkips)
    layout = model.long_skip_layout()
    assert [skip.index for skip in layout.skips] == list(range(model.lsc.num_skips))
    assert layout.widths == model.lsc.widths and layout.stage_ids == model.lsc.stage_ids
    met = {}
    handles = [
        skip.consumer.register_forward_pre_hook(
            lambda module, args, kwargs, skip=skip: met.__setitem__(skip.index, skip.split(args, kwargs)),
            with_kwargs=True,
        )
        for skip in layout.skips
    ]
    sample = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        model(sample, torch.tensor([0.1, 0.5]))
    for handle in handles:
        handle.remove()
    assert sorted(met) == list(range(model.lsc.num_skips))  # every skip reaches the module the layout names
    for skip in layout.skips:
        decoder, scaled = met[skip.index]
        # the skip part has the reported width: channels of a conv skip, tokens of a U-ViT skip
        assert scaled.shape[1] == skip.width and decoder.shape[0] == scaled.shape[0] == 2


def test_vanilla_diffusers_unet_layout_is_derived_from_its_modules():
    vanilla = UNet2DModel(**TINY_ATTENTION_UNET)
    scalelong = ScaleLongUNet2DModel(**TINY_ATTENTION_UNET)
    assert not isinstance(vanilla, HasLongSkips)
    assert long_skip_layout(vanilla).widths == scalelong.long_skip_layout().widths == (8, 8, 8, 16)
    assert [name for name, _ in long_skip_layout(vanilla).blocks] == ["down0", "down1", "mid", "up0", "up1"]


def test_lsc_reduction_is_a_config_option_of_every_family(tmp_path):
    model = ScaleLongUNet2DModel(**TINY_ATTENTION_UNET, lsc_method="ls", lsc_reduction=4)
    assert [gate.fc1.out_features for gate in model.lsc.gates] == [2, 4]  # widths 8 and 16 divided by 4
    model.save_pretrained(tmp_path)
    assert ScaleLongUNet2DModel.from_pretrained(tmp_path).config.lsc_reduction == 4
    for build in (
        lambda: ScaleLongUNet2DModel(**TINY_ATTENTION_UNET, lsc_method="ls", lsc_reduction=0),
        lambda: EDM2UNet2DModel(**TINY_EDM2_UNET, lsc_method="ls", lsc_reduction=0),
        lambda: UViT2DModel(sample_size=8, embed_dim=16, depth=2, num_heads=2, in_channels=1, lsc_reduction=0),
    ):
        with pytest.raises(ValueError, match="lsc_reduction must be an integer >= 1"):
            build()
