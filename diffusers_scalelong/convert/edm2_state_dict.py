"""Convert a state dict in the official EDM2 parameter naming to :class:`EDM2UNet2DModel` + :class:`LearnedUncertainty`.

Official names (the preconditioned network; the UNet sits under ``unet.``)::

    unet.emb_fourier.{freqs,phases}  unet.emb_noise.weight  unet.emb_label.weight  unet.out_gain  unet.out_conv.weight
    unet.enc.{R}x{R}_conv.weight     unet.enc.{R}x{R}_down.*  unet.enc.{R}x{R}_block{i}.*
    unet.dec.{R}x{R}_in0.*  unet.dec.{R}x{R}_in1.*  unet.dec.{R}x{R}_up.*  unet.dec.{R}x{R}_block{i}.*
    block: emb_gain, conv_res0, emb_linear, conv_res1, conv_skip, attn_qkv, attn_proj (``.weight``)
    logvar_fourier.{freqs,phases}  logvar_linear.weight

The architecture (widths, depth, attention resolutions, classes) is read from the tensor shapes; what the weights
do not record (``channels_per_head``, ``dropout``, balances, ``clip_act``) defaults to config G and can be passed
as keyword overrides. Only tensors are handled here: load the weights with ``safetensors``, never by unpickling.
"""

import math
import re
from functools import reduce

import torch

from ..edm2 import EDMPreconditioner, LearnedUncertainty
from ..models import EDM2UNet2DModel

__all__ = ["convert_edm2_state_dict", "preconditioner_from_edm2_state_dict"]

_BLOCK_PARAMS = {
    "emb_gain": "emb_gain",
    "conv_res0.weight": "conv1.weight",
    "emb_linear.weight": "emb_proj.weight",
    "conv_res1.weight": "conv2.weight",
    "conv_skip.weight": "conv_shortcut.weight",
    "attn_qkv.weight": "to_qkv.weight",
    "attn_proj.weight": "to_out.weight",
}
_TOP_PARAMS = {
    "emb_fourier.freqs": "noise_fourier.freqs",
    "emb_fourier.phases": "noise_fourier.phases",
    "emb_noise.weight": "noise_embedding.weight",
    "emb_label.weight": "class_embedding.weight",
    "out_conv.weight": "conv_out.weight",
    "out_gain": "out_gain",
}
_LOGVAR_PARAMS = {
    "logvar_fourier.freqs": "fourier.freqs",
    "logvar_fourier.phases": "fourier.phases",
    "logvar_linear.weight": "linear.weight",
}
_BLOCK_KEY = re.compile(r"^(enc|dec)\.(\d+)x\2_(conv|down|up|in0|in1|block\d+)\.(.+)$")


def _official_block_names(config: dict) -> tuple[list[str], list[str]]:
    """Official names of the encoder and decoder blocks, in the order of ``encoder_blocks`` / ``decoder_blocks``."""
    num_levels, layers = len(config["channel_mult"]), config["layers_per_block"]
    encoder, decoder = [], []
    for level in range(num_levels):
        res = config["sample_size"] >> level
        if level > 0:
            encoder.append(f"enc.{res}x{res}_down")
        encoder += [f"enc.{res}x{res}_block{i}" for i in range(layers)]
    for level in reversed(range(num_levels)):
        res = config["sample_size"] >> level
        decoder += (
            [f"dec.{res}x{res}_in0", f"dec.{res}x{res}_in1"] if level == num_levels - 1 else [f"dec.{res}x{res}_up"]
        )
        decoder += [f"dec.{res}x{res}_block{i}" for i in range(layers + 1)]
    return encoder, decoder


def _infer_config(unet: dict[str, torch.Tensor]) -> dict:
    """Architecture of config G from the tensor shapes."""
    conv_keys = [k for k in unet if re.fullmatch(r"enc\.\d+x\d+_conv\.weight", k)]
    if len(conv_keys) != 1 or "out_conv.weight" not in unet or "emb_noise.weight" not in unet:
        raise ValueError("state_dict is not in the official EDM2 naming (need enc.RxR_conv, emb_noise, out_conv)")
    sample_size = int(re.match(r"enc\.(\d+)x", conv_keys[0]).group(1))
    resolutions = sorted({int(m.group(2)) for k in unet if (m := _BLOCK_KEY.match(k))}, reverse=True)
    widths = []
    for res in resolutions:
        block = f"enc.{res}x{res}_block0.conv_res1.weight"
        if block not in unet:
            raise ValueError(f"state_dict has no {block}")
        widths.append(unet[block].shape[0])
    if resolutions != [sample_size >> level for level in range(len(resolutions))]:
        raise ValueError(f"state_dict resolutions {resolutions} do not halve level by level from {sample_size}")
    model_channels = reduce(math.gcd, widths)
    noise_channels, emb_channels = unet["emb_fourier.freqs"].numel(), unet["emb_noise.weight"].shape[0]
    for name, channels in [("noise", noise_channels), ("embedding", emb_channels)]:
        if channels % model_channels:
            raise ValueError(f"{name} width {channels} is not a multiple of the model width {model_channels}")
    layers = len({k.split(".")[1] for k in unet if re.match(rf"enc\.{sample_size}x{sample_size}_block\d+\.", k)})
    attention = {
        int(m.group(2))
        for k in unet
        if (m := _BLOCK_KEY.match(k)) and m.group(4) == "attn_qkv.weight" and m.group(3) != "in0"
    }
    return dict(
        sample_size=sample_size,
        in_channels=unet[conv_keys[0]].shape[1] - 1,
        out_channels=unet["out_conv.weight"].shape[0],
        model_channels=model_channels,
        channel_mult=[w // model_channels for w in widths],
        channel_mult_noise=None if noise_channels == widths[0] else noise_channels // model_channels,
        channel_mult_emb=None if emb_channels == max(widths) else emb_channels // model_channels,
        layers_per_block=layers,
        attention_resolutions=sorted(attention, reverse=True),
        num_class_embeds=unet["emb_label.weight"].shape[1] if "emb_label.weight" in unet else None,
    )


def convert_edm2_state_dict(
    state_dict: dict[str, torch.Tensor], **config_overrides
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """Map official EDM2 tensors to ``(unet_state_dict, logvar_state_dict, unet_config)``.

    ``unet_state_dict`` loads into ``EDM2UNet2DModel(**unet_config)`` (strict), ``logvar_state_dict`` into
    ``LearnedUncertainty(num_channels=...)`` (empty when the state dict has no uncertainty head). Keys may carry the
    ``unet.`` prefix (the preconditioned network) or not (the bare UNet). Unknown or missing keys raise ValueError.
    """
    unet, logvar = {}, {}
    for key, value in state_dict.items():
        if key in _LOGVAR_PARAMS:
            logvar[_LOGVAR_PARAMS[key]] = value
        else:
            unet[key.removeprefix("unet.")] = value
    config = {**_infer_config(unet), **config_overrides}

    encoder, decoder = _official_block_names(config)
    renames = dict(_TOP_PARAMS)
    renames[f"enc.{config['sample_size']}x{config['sample_size']}_conv.weight"] = "conv_in.weight"
    for kind, names in [("encoder_blocks", encoder), ("decoder_blocks", decoder)]:
        for index, name in enumerate(names):
            for official, ours in _BLOCK_PARAMS.items():
                renames[f"{name}.{official}"] = f"{kind}.{index}.{ours}"
    unknown = sorted(set(unet) - set(renames))
    if unknown:
        raise ValueError(f"state_dict has keys that are not part of the EDM2 UNet: {unknown[:5]}")
    converted = {renames[key]: value for key, value in unet.items()}

    with torch.device("meta"):
        expected = EDM2UNet2DModel(**config).state_dict()
    missing = sorted(set(expected) - set(converted))
    if missing:
        raise ValueError(f"state_dict lacks tensors the EDM2 UNet needs, e.g. {missing[:5]}")
    for key, value in converted.items():
        if value.shape != expected[key].shape:
            raise ValueError(f"{key}: shape {tuple(value.shape)} does not fit {tuple(expected[key].shape)}")
    return converted, logvar, config


def preconditioner_from_edm2_state_dict(
    state_dict: dict[str, torch.Tensor], sigma_data: float = 0.5, **config_overrides
) -> EDMPreconditioner:
    """An :class:`EDMPreconditioner` (UNet + uncertainty head, when present) holding the converted official weights."""
    unet_state, logvar_state, config = convert_edm2_state_dict(state_dict, **config_overrides)
    unet = EDM2UNet2DModel(**config)
    unet.load_state_dict(unet_state)
    uncertainty = None
    if logvar_state:
        uncertainty = LearnedUncertainty(num_channels=logvar_state["linear.weight"].shape[1])
        uncertainty.load_state_dict(logvar_state)
    return EDMPreconditioner(unet, uncertainty, sigma_data=sigma_data)
