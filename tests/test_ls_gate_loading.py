"""LS gates missing from a saved folder are initialised on load, by one mechanism for every model family.

``from_pretrained`` builds the model on ``meta`` (diffusers' default ``low_cpu_mem_usage=True``) and loads the
folder's weights; gates the folder lacks (it was saved without LS) must come out as freshly initialised gates on the
device of the other weights, as they would after ``Model(**config)``.
"""

import pytest
import torch

from diffusers_scalelong.models import EDM2UNet2DModel, ScaleLongUNet2DModel, UViT2DModel
from diffusers_scalelong.scalelong.loading import LongSkipScalingLoaderMixin

EDM2_TINY = dict(
    sample_size=16, in_channels=3, model_channels=16, channel_mult=(1, 2), layers_per_block=1,
    attention_resolutions=(8,), channels_per_head=8,
)  # fmt: skip
UNET_TINY = dict(
    sample_size=16, in_channels=3, out_channels=3, block_out_channels=(32, 64), layers_per_block=1,
    down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=8,
)  # fmt: skip
UVIT_TINY = dict(sample_size=8, patch_size=2, in_channels=3, embed_dim=16, num_heads=2, mlp_ratio=2.0, depth=4)
FAMILIES = {
    "edm2": (EDM2UNet2DModel, EDM2_TINY, lambda x: 0.25 * torch.log(torch.tensor([0.5, 2.0]))),
    "scalelong_unet": (ScaleLongUNet2DModel, UNET_TINY, lambda x: torch.tensor([10, 500])),
    "uvit": (UViT2DModel, UVIT_TINY, lambda x: torch.tensor([10.0, 500.0])),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_shares_the_gate_loader(family):
    assert issubclass(FAMILIES[family][0], LongSkipScalingLoaderMixin)


@pytest.mark.parametrize("method", ["ls", "ls_nonshared"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_folder_without_gates_loads_with_initialised_gates(tmp_path, family, method):
    cls, config, timesteps = FAMILIES[family]
    cls(**config).save_pretrained(tmp_path)  # lsc_method="none": no gates in the folder
    model, info = cls.from_pretrained(tmp_path, lsc_method=method, output_loading_info=True)
    gate_params = [name for name, _ in model.named_parameters() if name.startswith("lsc.gates.")]
    assert gate_params and sorted(info["missing_keys"]) == sorted(gate_params)
    meta = [name for name, param in model.named_parameters() if param.is_meta]
    assert meta == []
    fresh = cls(**config, lsc_method=method)
    for gate, reference in zip(model.lsc.gates, fresh.lsc.gates, strict=True):
        # nn.Linear's default init: weights in [-1/sqrt(fan_in), 1/sqrt(fan_in)], not zeros, not left uninitialised
        bound = gate.fc1.in_features**-0.5
        assert 0 < gate.fc1.weight.abs().max() <= bound and gate.fc1.weight.std() > 0
        assert gate.fc1.weight.shape == reference.fc1.weight.shape
    sample = torch.randn(2, config["in_channels"], config["sample_size"], config["sample_size"])
    with torch.no_grad():
        assert torch.isfinite(model(sample, timesteps(sample)).sample).all()
