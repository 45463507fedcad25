"""An official U-ViT / ScaleLong state dict (``nnet.pth``, ``nnet_ema.pth``) -> :class:`UViT2DModel`.

Official key names (``libs/uvit.py`` of U-ViT and of ScaleLong) and ours::

    patch_embed.proj.{weight,bias}         -> patch_embed.{weight,bias}
    label_emb.weight                       -> class_embedding.weight
    {in_blocks.i,mid_block,out_blocks.i}.mlp.fc1 / .mlp.fc2 -> ....mlp.0 / ....mlp.2
    se.layer1 / se.layer2                  -> lsc.gates.0.fc1 / lsc.gates.0.fc2          (LS, one shared gate)
    se.k.layer1 / se.k.layer2              -> lsc.gates.{N-1-k}.fc1 / .fc2                (LS non-shared)
    everything else (pos_embed, time_embed.{0,2}, norm1, attn.qkv, attn.proj, norm2, skip_linear, norm,
    decoder_pred, final_layer)            -> the same name

The official out blocks count ``layer_cnt`` from the innermost skip (``se[layer_cnt]`` gates the skip of
out block ``layer_cnt``), ours index skips from the outermost, hence ``N - 1 - k``. ScaleLong's
``scalelong`` switch maps to ``lsc_method``: 0 ``none``, 1 ``inv_sqrt2``, 2 ``cs`` (``kappa ** (N - 1 -
layer_cnt)``, i.e. ``kappa ** (i - 1)`` from the outermost skip), 3 ``ls``, 4 ``ls_nonshared``.

Timestep convention: the official pixel models (``train.py``, ``sde.py``) are noise predictors of the VP SDE
``beta(t) = 0.1 + 19.9 t`` on ``t in [0, 1]``, called as ``nnet(x_t, 999 t)`` with
``x_t = sqrt(abar(t)) x_0 + sqrt(1 - abar(t)) eps`` and ``abar(t) = exp(-(0.1 t + 9.95 t^2))``. The converted
model keeps that input: ``timestep = 999 t``. :func:`official_vpsde_scheduler` is a ``DDPMScheduler`` whose
integer timestep ``i`` has ``alphas_cumprod[i] = abar(i / 999)``, so every network call of that scheduler sees a
``(x_t, 999 t)`` pair of the official process (``i = 0`` uses the official sampler's smallest time
``t = 1e-3`` instead of 0, where ``abar = 1`` would make the step singular).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from diffusers import DDPMPipeline, DDPMScheduler

from ..atomic import atomic_write_text
from ..models import UViT2DModel
from .output import replaced_folder
from .safe_pickle import load_torch_checkpoint

__all__ = [
    "OFFICIAL_LSC_METHODS",
    "convert_uvit_checkpoint",
    "convert_uvit_state_dict",
    "official_vpsde_scheduler",
    "uvit_from_official",
]

#: ScaleLong's ``scalelong`` switch (index) -> ``lsc_method``.
OFFICIAL_LSC_METHODS = ("none", "inv_sqrt2", "cs", "ls", "ls_nonshared")
SOURCE_METADATA = "uvit_source.json"
VPSDE_BETA_MIN, VPSDE_BETA_MAX, VPSDE_EPS, TIMESTEP_SCALE = 0.1, 20.0, 1e-3, 999
_RENAMES = [
    (re.compile(r"^patch_embed\.proj\."), "patch_embed."),
    (re.compile(r"^label_emb\."), "class_embedding."),
    (re.compile(r"\.mlp\.fc1\."), ".mlp.0."),
    (re.compile(r"\.mlp\.fc2\."), ".mlp.2."),
]


def lsc_method_name(method: str | int) -> str:
    """``lsc_method`` from a name or ScaleLong's ``scalelong`` index (0-4)."""
    text = str(method)
    if text.isdigit():
        if int(text) >= len(OFFICIAL_LSC_METHODS):
            raise ValueError(f"lsc / --lsc index must lie in [0, {len(OFFICIAL_LSC_METHODS) - 1}], got {text}")
        return OFFICIAL_LSC_METHODS[int(text)]
    if text not in OFFICIAL_LSC_METHODS:
        raise ValueError(f"lsc / --lsc must be one of {', '.join(OFFICIAL_LSC_METHODS)} or 0-4, got {text!r}")
    return text


def _gate_reduction(num_tokens: int, hidden: int) -> int:
    """The ``lsc_reduction`` r with ``max(num_tokens // r, 1) == hidden`` (16, the official value, if it fits)."""
    for reduction in (16, *range(1, num_tokens + 1)):
        if max(num_tokens // reduction, 1) == hidden:
            return reduction
    raise ValueError(f"no gate reduction maps {num_tokens} tokens to a hidden width of {hidden}")


def _infer_config(state: dict[str, torch.Tensor], num_heads: int) -> dict[str, Any]:
    for key in ("patch_embed.proj.weight", "pos_embed", "decoder_pred.weight", "in_blocks.0.mlp.fc1.weight"):
        if key not in state:
            raise ValueError(f"state dict is not in the official U-ViT naming: it lacks {key}")
    embed_dim, in_channels, patch, _ = state["patch_embed.proj.weight"].shape
    num_classes = state["label_emb.weight"].shape[0] if "label_emb.weight" in state else None
    extras = 2 if num_classes else 1
    grid = round((state["pos_embed"].shape[1] - extras) ** 0.5)
    if grid * grid != state["pos_embed"].shape[1] - extras:
        raise ValueError(f"pos_embed has {state['pos_embed'].shape[1]} tokens: not {extras} extra + a square grid")
    depth = 2 * len({key.split(".")[1] for key in state if key.startswith("in_blocks.")})
    if num_heads < 1 or embed_dim % num_heads:
        raise ValueError(f"num_heads / --num_heads must divide embed_dim={embed_dim}, got {num_heads}")
    return dict(
        sample_size=grid * patch,
        patch_size=patch,
        in_channels=in_channels,
        out_channels=state["decoder_pred.weight"].shape[0] // patch**2,
        embed_dim=embed_dim,
        depth=depth,
        num_heads=num_heads,
        mlp_ratio=state["in_blocks.0.mlp.fc1.weight"].shape[0] / embed_dim,
        qkv_bias="in_blocks.0.attn.qkv.bias" in state,
        mlp_time_embed="time_embed.0.weight" in state,
        num_class_embeds=num_classes,
        conv_out="final_layer.weight" in state,
    )


def _gate_method(state: dict[str, torch.Tensor]) -> str | None:
    if "se.layer1.weight" in state:
        return "ls"
    if "se.0.layer1.weight" in state:
        return "ls_nonshared"
    return None


def convert_uvit_state_dict(
    state_dict: dict[str, torch.Tensor], num_heads: int, lsc_method: str | int | None = None, lsc_kappa: float = 0.5
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(state_dict, config)`` for ``UViT2DModel(**config)`` from official tensors.

    ``num_heads`` is not recorded by the tensors; ``lsc_method`` (a name or ScaleLong's 0-4) defaults to the LS
    variant the ``se`` keys show, else ``none``; ``lsc_kappa`` only matters for ``cs``.
    """
    state = {key.removeprefix("module."): value for key, value in state_dict.items()}
    config = _infer_config(state, num_heads)
    found = _gate_method(state)
    method = lsc_method_name(lsc_method) if lsc_method is not None else (found or "none")
    if method in ("ls", "ls_nonshared") and found != method:
        raise ValueError(f"lsc / --lsc {method} needs the official se gate weights of {method}; found {found}")
    if found is not None and method != found:
        raise ValueError(f"the state dict carries {found} gates (se.*) but lsc / --lsc is {method}")
    num_skips = config["depth"] // 2
    converted: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.startswith("se."):
            parts = key.split(".")
            gate = 0 if method == "ls" else num_skips - 1 - int(parts[1])
            layer = {"layer1": "fc1", "layer2": "fc2"}[parts[-2]]
            key = f"lsc.gates.{gate}.{layer}.{parts[-1]}"
        for pattern, ours in _RENAMES:
            key = pattern.sub(ours, key)
        converted[key] = value
    config.update(lsc_method=method, lsc_kappa=float(lsc_kappa))
    if found is not None:
        hidden, tokens = converted["lsc.gates.0.fc1.weight"].shape
        config["lsc_reduction"] = _gate_reduction(tokens, hidden)
    with torch.device("meta"):
        expected = UViT2DModel(**config).state_dict()
    unknown, missing = sorted(set(converted) - set(expected)), sorted(set(expected) - set(converted))
    if unknown or missing:
        raise ValueError(f"state dict does not fit UViT2DModel: unknown keys {unknown[:5]}, missing keys {missing[:5]}")
    for key, value in converted.items():
        if value.shape != expected[key].shape:
            raise ValueError(f"{key}: shape {tuple(value.shape)} does not fit {tuple(expected[key].shape)}")
    return converted, config


def uvit_from_official(
    path: str | os.PathLike, num_heads: int, lsc_method: str | int | None = None, lsc_kappa: float = 0.5
) -> UViT2DModel:
    """A :class:`UViT2DModel` from an official ``torch.save`` checkpoint file, read as plain data and dense tensors
    (:func:`~.safe_pickle.load_torch_checkpoint`: nothing in the file runs, sizes are bounded)."""
    state_dict = load_torch_checkpoint(path)
    if not isinstance(state_dict, dict) or not all(
        type(key) is str and isinstance(value, torch.Tensor) for key, value in state_dict.items()
    ):
        raise ValueError(f"{path} holds a {type(state_dict).__name__}, not a state dict of named tensors")
    try:
        converted, config = convert_uvit_state_dict(state_dict, num_heads, lsc_method, lsc_kappa)
    except (IndexError, KeyError, TypeError, ZeroDivisionError) as error:
        raise ValueError(f"{path} is not an official U-ViT state dict: {type(error).__name__}: {error}") from None
    model = UViT2DModel(**config)
    model.load_state_dict(converted, strict=True)
    return model.eval()


def vpsde_alphas_cumprod(t: torch.Tensor) -> torch.Tensor:
    """``abar(t) = exp(-(beta_min t + (beta_max - beta_min) t^2 / 2))`` of the official VP SDE."""
    return torch.exp(-(VPSDE_BETA_MIN * t + (VPSDE_BETA_MAX - VPSDE_BETA_MIN) * t**2 / 2))


def official_vpsde_scheduler() -> DDPMScheduler:
    """``DDPMScheduler`` with ``alphas_cumprod[i] = abar(i / 999)`` (``i = 0``: ``abar(1e-3)``), see the module doc."""
    t = torch.arange(TIMESTEP_SCALE + 1, dtype=torch.float64) / TIMESTEP_SCALE
    t[0] = VPSDE_EPS
    abar = vpsde_alphas_cumprod(t)
    betas = 1 - abar / torch.cat([abar.new_ones(1), abar[:-1]])
    return DDPMScheduler(num_train_timesteps=TIMESTEP_SCALE + 1, trained_betas=betas.tolist(), clip_sample=False)


def convert_uvit_checkpoint(
    path: str | os.PathLike,
    output_dir: str | os.PathLike,
    num_heads: int,
    lsc_method: str | int | None = None,
    lsc_kappa: float = 0.5,
    overwrite: bool = False,
) -> UViT2DModel:
    """Write an official checkpoint as a diffusers folder (built beside ``output_dir``, then swapped in whole; an
    existing non-empty ``output_dir`` is refused unless ``overwrite``).

    Unconditional models become a ``DDPMPipeline`` (``unet/`` + ``scheduler/`` = `official_vpsde_scheduler`);
    class-conditional ones get the same two folders without a pipeline index (``DDPMPipeline`` passes no labels).
    ``uvit_source.json`` records the source file, the config, the ScaleLong method and the timestep convention.
    """
    with replaced_folder(output_dir, overwrite) as folder:
        model = uvit_from_official(path, num_heads, lsc_method, lsc_kappa)
        scheduler = official_vpsde_scheduler()
        if model.config.num_class_embeds is None:
            DDPMPipeline(unet=model, scheduler=scheduler).save_pretrained(folder, safe_serialization=True)
        else:
            model.save_pretrained(folder / "unet", safe_serialization=True)
            scheduler.save_pretrained(folder / "scheduler")
        _write_metadata(folder, path, model, num_heads)
    return model


def _write_metadata(folder: Path, path: str | os.PathLike, model: UViT2DModel, num_heads: int) -> None:
    metadata = {
        "source_file": Path(path).name,
        "lsc_method": model.config.lsc_method,
        "lsc_kappa": model.config.lsc_kappa,
        "official_scalelong_index": OFFICIAL_LSC_METHODS.index(model.config.lsc_method),
        "num_heads": num_heads,
        "timestep_convention": "timestep = 999 t, t in [0, 1] of the VP SDE beta(t) = 0.1 + 19.9 t; noise prediction",
        "scheduler": "DDPMScheduler with alphas_cumprod[i] = abar(i / 999) (i = 0: abar(1e-3))",
    }
    atomic_write_text(folder / SOURCE_METADATA, json.dumps(metadata, indent=2) + "\n")
