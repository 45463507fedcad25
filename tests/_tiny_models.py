"""Tiny model configurations shared by the tests: each builds and runs in well under a second on one CPU thread."""

from __future__ import annotations

# diffusers UNet2DModel: two levels, one resnet per block, 1 channel at 8x8.
TINY_UNET = dict(
    sample_size=8,
    in_channels=1,
    out_channels=1,
    block_out_channels=(8, 16),
    layers_per_block=1,
    down_block_types=("DownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "UpBlock2D"),
    norm_num_groups=4,
)
# The same with self-attention on the inner level (the skip layout then passes through attention blocks).
TINY_ATTENTION_UNET = {
    **TINY_UNET,
    "down_block_types": ("DownBlock2D", "AttnDownBlock2D"),
    "up_block_types": ("AttnUpBlock2D", "UpBlock2D"),
    "attention_head_dim": 4,
}
# diffusers UNet2DConditionModel with cross-attention on one level (add cross_attention_dim, attention_head_dim).
TINY_CONDITION_UNET = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    block_out_channels=(8, 16),
    layers_per_block=1,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    norm_num_groups=4,
)
# EDM2UNet2DModel: two levels of widths 8 and 16, attention at 4x4.
TINY_EDM2_UNET = dict(
    sample_size=8,
    in_channels=1,
    model_channels=8,
    channel_mult=(1, 2),
    layers_per_block=1,
    attention_resolutions=(4,),
    channels_per_head=8,
)
