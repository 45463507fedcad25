"""Build the network a training run optimises: from scratch (one of ``MODEL_TYPES``) or from a pretrained folder."""

import inspect
import json
import os
from pathlib import Path

import diffusers
from diffusers.models.modeling_utils import ModelMixin

from .. import models as plugin_models
from ..scalelong import validate_lsc_options

MODEL_TYPES = ("unet2d", "scalelong_unet2d", "uvit", "edm2")
# Loading a vanilla diffusers UNet for fine-tuning with ScaleLong swaps in the subclass that records the method.
_SCALELONG_SUBCLASS = {
    "UNet2DModel": "ScaleLongUNet2DModel",
    "ScaleLongUNet2DModel": "ScaleLongUNet2DModel",
    "UNet2DConditionModel": "ScaleLongUNet2DConditionModel",
    "ScaleLongUNet2DConditionModel": "ScaleLongUNet2DConditionModel",
}


def unet2d_block_types(num_levels: int, attention_levels: tuple[int, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Down and up block type names of a ``UNet2DModel`` with attention at the given level indices (0 = outermost)."""
    for level in attention_levels:
        if not 0 <= level < num_levels:
            raise ValueError(f"--attention_levels: level {level} does not exist (the model has {num_levels} levels)")
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
            f"--block_out_channels {list(block_out_channels)} must be multiples of --norm_num_groups {norm_num_groups}"
        )
    if resolution % 2 ** (len(block_out_channels) - 1):
        raise ValueError(
            f"--resolution {resolution} must be divisible by 2^{len(block_out_channels) - 1} for {len(block_out_channels)} levels"
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
            raise ValueError("--model unet2d is the vanilla diffusers UNet; use --model scalelong_unet2d for --lsc")
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


def load_model_config(path: str | os.PathLike, subfolder: str | None = None) -> tuple[dict, str | None]:
    """The ``config.json`` of a pretrained UNet in a local folder or Hub repo, and the subfolder holding it.

    A pipeline folder (``model_index.json``) is searched for its ``unet`` component.
    """
    if subfolder is None and _has_file(path, "model_index.json"):
        subfolder = "unet"
    config_name = "config.json" if subfolder is None else f"{subfolder}/config.json"
    config_path = _fetch_file(path, config_name)
    if config_path is None:
        raise ValueError(
            f"--pretrained_model_name_or_path {str(path)!r} holds neither model_index.json nor a UNet config.json"
        )
    return json.loads(Path(config_path).read_text()), subfolder


def _has_file(path: str | os.PathLike, name: str) -> bool:
    return _fetch_file(path, name) is not None


def _fetch_file(path: str | os.PathLike, name: str) -> str | None:
    local = Path(path)
    if local.is_dir():
        return str(local / name) if (local / name).is_file() else None
    if local.exists() or str(path).count("/") != 1:
        return None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError

    try:
        return hf_hub_download(str(path), name)
    except (EntryNotFoundError, RepositoryNotFoundError):
        return None


def model_class_by_name(name: str) -> type[ModelMixin]:
    """A model class of this package or of diffusers, by its ``_class_name``."""
    cls = getattr(plugin_models, name, None) or getattr(diffusers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, ModelMixin)):
        raise ValueError(f"model class {name!r} is neither a diffusers model nor one of diffusers_scalelong.models")
    return cls


def load_pretrained_unet(
    path: str | os.PathLike, lsc_method: str, lsc_kappa: float, subfolder: str | None = None
) -> ModelMixin:
    """Load a pretrained UNet for fine-tuning, with ScaleLong long-skip scaling ``lsc_method`` added.

    A diffusers ``UNet2DModel`` / ``UNet2DConditionModel`` is loaded into its ``ScaleLong*`` subclass, so the method is
    stored in the saved config; models that carry ``lsc_method`` in their own config (EDM2, U-ViT) get it replaced;
    any other model accepts only ``lsc_method="none"`` (a scaling it cannot record would be lost when saved).
    """
    validate_lsc_options(lsc_method, lsc_kappa)
    config, subfolder = load_model_config(path, subfolder)
    class_name = config.get("_class_name", "")
    kwargs = dict(subfolder=subfolder) if subfolder else {}
    if class_name in _SCALELONG_SUBCLASS:
        cls = model_class_by_name(_SCALELONG_SUBCLASS[class_name])
        return cls.from_pretrained(path, lsc_method=lsc_method, lsc_kappa=float(lsc_kappa), **kwargs)
    cls = model_class_by_name(class_name)
    if "lsc_method" in inspect.signature(cls.__init__).parameters:
        return cls.from_pretrained(
            path, lsc_method=lsc_method, lsc_kappa=float(lsc_kappa), low_cpu_mem_usage=False, **kwargs
        )
    if lsc_method != "none":
        raise ValueError(f"{class_name} has no lsc_method option; --lsc {lsc_method} cannot be saved with it")
    return cls.from_pretrained(path, **kwargs)


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
