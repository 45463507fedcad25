"""Build the network a training run optimises from scratch: one of ``MODEL_TYPES``, or from a model config file.

(A pretrained UNet with ScaleLong added comes from :func:`diffusers_scalelong.models.load_pretrained_unet`.)
"""

import inspect
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import diffusers
from diffusers.models.modeling_utils import ModelMixin

from .. import models as plugin_models
from ..models.pretrained import SCALELONG_SUBCLASS, load_model_config, model_class_by_name

MODEL_TYPES = ("unet2d", "scalelong_unet2d", "uvit", "edm2")
T = TypeVar("T")


def unet2d_block_types(num_levels: int, attention_levels: tuple[int, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Down and up block type names of a ``UNet2DModel`` with attention at the given level indices (0 = outermost)."""
    for level in attention_levels:
        if not 0 <= level < num_levels:
            raise ValueError(f"attention_levels: level {level} does not exist (the model has {num_levels} levels)")
    down = tuple("AttnDownBlock2D" if i in attention_levels else "DownBlock2D" for i in range(num_levels))
    up = tuple("AttnUpBlock2D" if i in attention_levels else "UpBlock2D" for i in reversed(range(num_levels)))
    return down, up


def build_unet2d(
    scalelong: bool,
    resolution: int,
    channels: int,
    block_out_channels: tuple[int, ...],
    layers_per_block: int,
    attention_levels: tuple[int, ...],
    norm_num_groups: int,
    num_class_embeds: int | None,
    lsc_method: str,
    lsc_kappa: float,
    dropout: float = 0.0,
) -> ModelMixin:
    """A diffusers ``UNet2DModel`` (``scalelong=False``; then ``lsc_method`` must be ``none``) or ``ScaleLongUNet2DModel``."""
    if any(width % norm_num_groups for width in block_out_channels):
        raise ValueError(
            f"block_out_channels {list(block_out_channels)} must be multiples of norm_num_groups {norm_num_groups}"
        )
    if resolution % 2 ** (len(block_out_channels) - 1):
        raise ValueError(
            f"resolution {resolution} must be divisible by 2^{len(block_out_channels) - 1} for {len(block_out_channels)} levels"
        )
    down, up = unet2d_block_types(len(block_out_channels), attention_levels)
    config = dict(
        sample_size=resolution,
        in_channels=channels,
        out_channels=channels,
        block_out_channels=tuple(block_out_channels),
        layers_per_block=layers_per_block,
        down_block_types=down,
        up_block_types=up,
        norm_num_groups=norm_num_groups,
        num_class_embeds=num_class_embeds,
        dropout=dropout,
        attention_head_dim=None,
    )
    if not scalelong:
        if lsc_method != "none":
            raise ValueError("model unet2d is the vanilla diffusers UNet; use model scalelong_unet2d for lsc")
        return diffusers.UNet2DModel(**config)
    return plugin_models.ScaleLongUNet2DModel(**config, lsc_method=lsc_method, lsc_kappa=lsc_kappa)


def build_edm2(
    resolution: int,
    channels: int,
    preset: str | None,
    model_channels: int | None,
    channel_mult: tuple[int, ...] | None,
    layers_per_block: int | None,
    attention_resolutions: tuple[int, ...] | None,
    num_class_embeds: int | None,
    lsc_method: str,
    lsc_kappa: float,
    dropout: float | None = None,
    channels_per_head: int | None = None,
) -> ModelMixin:
    """An ``EDM2UNet2DModel``: a paper preset (``XS``..``XXL``) resized to this data, with explicit sizes overriding it."""
    overrides = dict(sample_size=resolution, in_channels=channels, num_class_embeds=num_class_embeds)
    overrides.update(lsc_method=lsc_method, lsc_kappa=lsc_kappa)
    explicit = dict(
        model_channels=model_channels,
        channel_mult=tuple(channel_mult) if channel_mult else None,
        layers_per_block=layers_per_block,
        attention_resolutions=tuple(attention_resolutions) if attention_resolutions is not None else None,
        dropout=dropout,
        channels_per_head=channels_per_head,
    )
    overrides.update({key: value for key, value in explicit.items() if value is not None})
    cls = plugin_models.EDM2UNet2DModel
    if preset is not None:
        return cls.from_preset(preset, dataset="img64", **overrides)
    return cls(**overrides)


def build_uvit(
    resolution: int,
    channels: int,
    patch_size: int,
    embed_dim: int,
    depth: int,
    num_heads: int,
    num_class_embeds: int | None,
    lsc_method: str,
    lsc_kappa: float,
) -> ModelMixin:
    """A U-ViT (``UViT2DModel``) with ScaleLong scaling of its long skips."""
    return plugin_models.UViT2DModel(
        sample_size=resolution,
        patch_size=patch_size,
        in_channels=channels,
        embed_dim=embed_dim,
        depth=depth,
        num_heads=num_heads,
        num_class_embeds=num_class_embeds,
        lsc_method=lsc_method,
        lsc_kappa=lsc_kappa,
    )


def load_config_source(path: str | os.PathLike) -> dict:
    """The model config of ``model_config_name_or_path``: a JSON file, a model folder (``config.json``), a
    pipeline folder (its ``unet/config.json``) or a Hub repo holding one of these."""
    option = f"model_config_name_or_path {str(path)!r}"
    if Path(path).is_file():
        try:
            config = json.loads(Path(path).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{option} is not a JSON config file: {error}") from error
    else:
        try:
            config, _ = load_model_config(path)
        except ValueError:
            raise ValueError(
                f"{option}: no such config file, and no model or pipeline folder (or Hub repo) with a config.json"
            ) from None
    if not isinstance(config, dict) or "_class_name" not in config:
        raise ValueError(f"{option} is not a diffusers model config (it has no _class_name)")
    return config


def build_from_config(
    path: str | os.PathLike,
    resolution: int,
    channels: int,
    num_class_embeds: int | None,
    lsc_method: str,
    lsc_kappa: float,
) -> ModelMixin:
    """A freshly initialised network from a model config (as diffusers' ``UNet2DModel.from_config``), of the class
    its ``_class_name`` names; a vanilla ``UNet2DModel`` becomes a ``ScaleLongUNet2DModel`` when ``lsc_method`` is
    not ``none`` (the ScaleLong classes, EDM2 UNet and U-ViT take ``lsc_method`` / ``lsc_kappa`` from the options
    then). The config must fit the data: ``sample_size``, ``in_channels`` and ``num_class_embeds`` are checked."""
    config = load_config_source(path)
    class_name = config["_class_name"]
    if lsc_method != "none":
        class_name = SCALELONG_SUBCLASS.get(class_name, class_name)
    cls = model_class_by_name(class_name)
    wanted = dict(sample_size=resolution, in_channels=channels, num_class_embeds=num_class_embeds)
    for key, value in wanted.items():
        found = config.get(key)
        if found != value and not (key == "sample_size" and found in (value, [value, value])):
            raise ValueError(
                f"model_config_name_or_path {str(path)!r}: {key} is {found}, the data needs {value} "
                "(resolution, the images' channels, class_conditional)"
            )
    overrides = {}
    if lsc_method != "none":
        if "lsc_method" not in inspect.signature(cls.__init__).parameters:
            raise ValueError(f"lsc {lsc_method}: {class_name} has no long-skip scaling (lsc_method)")
        overrides = dict(lsc_method=lsc_method, lsc_kappa=lsc_kappa)
    return cls.from_config({**config, **overrides})


def load_pretrained(load: Callable[[], T], source: str, revision: str | None = None, variant: str | None = None) -> T:
    """``load()`` of the pretrained model at ``source``, with a missing weight file (e.g. of ``variant``) or Hub
    ``revision`` reported as one ``ValueError`` naming them."""
    from huggingface_hub.errors import RevisionNotFoundError

    try:
        return load()
    except (OSError, RevisionNotFoundError) as error:
        raise ValueError(
            f"pretrained_model_name_or_path {source!r} (revision {revision}, variant {variant}) could not be loaded: "
            f"{error}"
        ) from error
