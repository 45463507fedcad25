"""Config checks of the networks, run before any layer is built: every size a positive integer in range, the
widths compatible with what divides them, and the parameter count (a lower bound computed from the config) under
``MAX_PARAMETERS``. Errors are ``ValueError`` naming the config field."""

from __future__ import annotations

from collections.abc import Sequence

from ..validation import (
    MAX_PARAMETERS,
    MAX_SAMPLE_SIZE,
    check_count,
    check_counts,
    check_number,
    check_optional_count,
    check_parameter_count,
    check_sample_size,
    conv_unet_parameter_floor,
)

__all__ = ["check_conv_unet_config", "check_edm2_unet_config", "check_uvit_config"]


def _per_level(name: str, value: int | Sequence[int], num_levels: int) -> tuple[int, ...]:
    """An integer for every level, or one per level."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        values = check_counts(name, value, 1, MAX_PARAMETERS)
        if len(values) != num_levels:
            raise ValueError(f"{name} has {len(values)} entries for {num_levels} levels (block_out_channels)")
        return values
    return (check_count(name, value, 1, MAX_PARAMETERS),) * num_levels


def check_conv_unet_config(
    owner: str,
    *,
    sample_size: object,
    in_channels: object,
    out_channels: object,
    block_out_channels: object,
    layers_per_block: object,
    norm_num_groups: object,
    norm_eps: object,
    dropout: object,
    num_class_embeds: object,
    attention_head_dim: object = None,
    time_embedding_dim: object = None,
    cross_attention_dim: object = None,
    down_block_types: Sequence[str] = (),
) -> None:
    """The sizes of a diffusers conv UNet (``UNet2DModel``, ``UNet2DConditionModel``) that diffusers leaves to fail
    with a ZeroDivisionError, a negative-size tensor or an allocation error; the rest is diffusers' to check."""
    check_sample_size("sample_size", sample_size, allow_none=True)
    check_count("in_channels", in_channels, 1, MAX_PARAMETERS)
    check_count("out_channels", out_channels, 1, MAX_PARAMETERS)
    widths = check_counts("block_out_channels", block_out_channels, 1, MAX_PARAMETERS)
    layers = _per_level("layers_per_block", layers_per_block, len(widths))
    if norm_num_groups is not None:
        groups = check_count("norm_num_groups", norm_num_groups, 1, MAX_PARAMETERS)
        for i, width in enumerate(widths):
            if width % groups:
                raise ValueError(f"block_out_channels[{i}]={width} is not divisible by norm_num_groups={groups}")
    check_number("norm_eps", norm_eps, 0.0, low_inclusive=False)
    check_number("dropout", dropout, 0.0, 1.0, high_inclusive=False)
    classes = check_optional_count("num_class_embeds", num_class_embeds) or 0
    if attention_head_dim is not None:
        _per_level("attention_head_dim", attention_head_dim, len(widths))
    time_width = check_optional_count("time_embedding_dim", time_embedding_dim) or 4 * widths[0]
    check_count("time_embedding_dim", time_width, 1, MAX_PARAMETERS)
    # 3x3 conv_in / conv_out, the time embedding's second linear layer, a class embedding of the time width
    ends = 9 * widths[0] * (in_channels + out_channels) + time_width * (time_width + classes)
    if cross_attention_dim is not None:
        cross = max(_per_level("cross_attention_dim", cross_attention_dim, len(widths)))
        if any("CrossAttn" in block for block in down_block_types):  # to_k and to_v: cross -> width, at least once
            ends += 2 * cross * min(widths)
    check_parameter_count(owner, conv_unet_parameter_floor(widths, layers) + ends)


def check_edm2_unet_config(
    *,
    sample_size: object,
    in_channels: object,
    out_channels: object,
    model_channels: object,
    channel_mult: object,
    channel_mult_noise: object,
    channel_mult_emb: object,
    layers_per_block: object,
    attention_resolutions: object,
    channels_per_head: object,
    clip_act: object,
    num_class_embeds: object,
) -> None:
    """The sizes of an ``EDM2UNet2DModel`` config; the balances and ``dropout`` are checked where they are used."""
    size = check_count("sample_size", sample_size, 1, MAX_SAMPLE_SIZE)
    check_count("in_channels", in_channels, 1, MAX_PARAMETERS)
    out_channels = check_optional_count("out_channels", out_channels) or in_channels
    base = check_count("model_channels", model_channels, 1, MAX_PARAMETERS)
    mult = check_counts("channel_mult", channel_mult, 1, MAX_PARAMETERS)
    noise_mult = check_optional_count("channel_mult_noise", channel_mult_noise)
    emb_mult = check_optional_count("channel_mult_emb", channel_mult_emb)
    layers = check_count("layers_per_block", layers_per_block, 1, MAX_PARAMETERS)
    if isinstance(attention_resolutions, str) or not isinstance(attention_resolutions, Sequence):
        raise ValueError(f"attention_resolutions must be a sequence of resolutions, got {attention_resolutions!r}")
    for i, resolution in enumerate(attention_resolutions):
        check_count(f"attention_resolutions[{i}]", resolution, 1)
    head = check_count("channels_per_head", channels_per_head, 1, MAX_PARAMETERS)
    if clip_act is not None:
        check_number("clip_act", clip_act, 0.0, low_inclusive=False)
    classes = check_optional_count("num_class_embeds", num_class_embeds) or 0
    if size % 2 ** (len(mult) - 1):
        raise ValueError(
            f"sample_size={size} is not divisible by 2**{len(mult) - 1} (the number of down-samplings of "
            f"channel_mult={list(mult)})"
        )
    widths = [base * m for m in mult]
    for level, width in enumerate(widths):
        # the innermost level always has attention (its first decoder block)
        attention = level == len(widths) - 1 or (size >> level) in attention_resolutions
        if attention and width % head:
            raise ValueError(
                f"model_channels * channel_mult[{level}] = {width} (a level with attention) is not divisible by "
                f"channels_per_head={head}"
            )
    emb = base * emb_mult if emb_mult else max(widths)
    noise = base * noise_mult if noise_mult else widths[0]
    # noise and class embeddings, 3x3 conv_in (with the constant channel) and conv_out
    ends = emb * (noise + classes) + 9 * widths[0] * (in_channels + 1 + out_channels)
    check_parameter_count("EDM2UNet2DModel", conv_unet_parameter_floor(widths, [layers] * len(widths)) + ends)


def check_uvit_config(
    *,
    sample_size: object,
    patch_size: object,
    in_channels: object,
    out_channels: object,
    embed_dim: object,
    depth: object,
    num_heads: object,
    mlp_ratio: object,
    num_class_embeds: object,
) -> None:
    """The sizes of a ``UViT2DModel`` config; its parameter count is exact up to biases and norms:
    ``(depth + 1) (4 + 2 mlp_ratio) D^2`` in the blocks, ``depth / 2 * 2 D^2`` in the skip fusions, and
    ``tokens * D`` in the position embedding, ``classes * D`` in the class embedding and ``D patch^2 out`` in the
    output projection."""
    size = check_count("sample_size", sample_size, 1, MAX_SAMPLE_SIZE)
    patch = check_count("patch_size", patch_size, 1, MAX_SAMPLE_SIZE)
    check_count("in_channels", in_channels, 1, MAX_PARAMETERS)
    out_channels = check_optional_count("out_channels", out_channels) or in_channels
    dim = check_count("embed_dim", embed_dim, 1, MAX_PARAMETERS)
    blocks = check_count("depth", depth, 2, MAX_PARAMETERS)
    heads = check_count("num_heads", num_heads, 1, MAX_PARAMETERS)
    ratio = check_number("mlp_ratio", mlp_ratio, 0.0, MAX_PARAMETERS, low_inclusive=False)
    classes = check_optional_count("num_class_embeds", num_class_embeds) or 0
    if blocks % 2:
        raise ValueError(f"depth must be an even number >= 2 (in/out block pairs), got {blocks}")
    if size % patch:
        raise ValueError(f"sample_size={size} must be divisible by patch_size={patch}")
    if dim % heads:
        raise ValueError(f"embed_dim={dim} must be divisible by num_heads={heads}")
    if int(dim * ratio) < 1:
        raise ValueError(f"embed_dim * mlp_ratio = {dim * ratio:g} leaves the MLP without hidden units")
    tokens = 2 + (size // patch) ** 2
    count = (
        (blocks + 1) * (4 + 2 * ratio) * dim**2 + blocks * dim**2 + (tokens + classes + patch**2 * out_channels) * dim
    )
    check_parameter_count("UViT2DModel", count)
