"""An official EDM2 network pickle -> ``EDM2Pipeline`` (UNet, scheduler, VAE, guide) and ``EDMPreconditioner``.

Official pickles (``network-snapshot-*.pkl``, ``edm2-img512-*.pkl``, ``edm2-img64-*.pkl``) hold a dict with
``ema`` (the preconditioned network ``Precond``: ``unet`` plus the uncertainty head ``logvar_fourier`` /
``logvar_linear``, tensors in float16), ``encoder`` (``StabilityVAEEncoder`` with per-channel ``scale`` and
``bias`` for latent models, ``StandardRGBEncoder`` for pixel models), ``loss_fn`` (``EDM2Loss``) and
``dataset_kwargs``. They are read with :mod:`.safe_pickle`, never unpickled normally.

The UNet's config comes from the tensor shapes and the recorded attributes of the network's blocks (channels per
head, dropout, balances, activation clipping); the constructor arguments the pickle records are cross-checked.
Latent models get the user's VAE (``stabilityai/sd-vae-ft-mse`` for the released models) with the pickle's latent
normalisation ``x = z * scale + bias`` stored as ``latents_mean = -bias / scale``, ``latents_std =
final_std / scale``, ``scaling_factor = final_std``, and the pipeline reads the VAE's images as [0, 1], as the
official encoder does (it encodes pixels / 255 and decodes to [0, 1]). The scheduler is ``EDMHeunScheduler`` with EDM2's sampler
settings (32 steps, sigma in [0.002, 80], rho 7, deterministic).

The released models are licensed CC BY-NC-SA 4.0 by NVIDIA; converted weights stay under that license, and the
written metadata and model card say so.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from diffusers import AutoencoderKL

from ..atomic import atomic_write_text
from ..edm2 import EDMPreconditioner, LearnedUncertainty
from ..hub import model_card, push_pipeline_to_hub
from ..models import EDM2UNet2DModel
from ..pipelines import EDM2Pipeline, set_edm2_latent_scaling
from ..schedulers import EDMHeunScheduler
from .edm2_state_dict import convert_edm2_state_dict
from .output import replaced_folder
from .safe_pickle import PersistentObject, load_restricted_pickle, module_tensors

__all__ = [
    "EDM2_LICENSE",
    "EDM2NetworkPickle",
    "SOURCE_METADATA",
    "convert_edm2_pickle",
    "from_edm2_pickle",
    "kimg_to_images",
    "networks_from_pickle",
    "parse_official_name",
    "preconditioner_from_edm2_pickle",
    "read_edm2_pickle",
]

EDM2_LICENSE = "cc-by-nc-sa-4.0"
EDM2_LICENSE_NAME = "Creative Commons Attribution-NonCommercial-ShareAlike 4.0 International (CC BY-NC-SA 4.0)"
EDM2_LICENSE_URL = "https://creativecommons.org/licenses/by-nc-sa/4.0/"
SOURCE_METADATA = "edm2_source.json"
#: EDM2's sampler (``edm_sampler`` defaults of the official generation script).
EDM2_SAMPLER = dict(num_inference_steps=32, sigma_min=0.002, sigma_max=80.0, rho=7.0)
#: The official latent models feed the VAE pixels / 255 and read its output as [0, 1] (``StabilityVAEEncoder``).
EDM2_VAE_PIXEL_RANGE = "[0, 1]"
_OFFICIAL_NAME = re.compile(r"^(?P<prefix>.+)-(?P<kimg>\d+)-(?P<sigma_rel>\d+\.\d+)\.pkl$")


def parse_official_name(name: str) -> tuple[str, int, float] | None:
    """``(prefix, kimg, sigma_rel)`` of an official file name ``<prefix>-<kimg:07d>-<sigma_rel:.3f>.pkl``."""
    match = _OFFICIAL_NAME.match(Path(name).name)
    if match is None:
        return None
    return match["prefix"], int(match["kimg"]), float(match["sigma_rel"])


def kimg_to_images(kimg: int) -> int:
    """Training images of an official file name's ``kimg`` (= images // 1000; the official runs count images in
    multiples of 1024, so the exact count is the multiple of 1024 that rounds down to ``kimg``)."""
    images = (kimg * 1000 + 999) // 1024 * 1024
    if images // 1000 != kimg:
        raise ValueError(f"kimg={kimg} matches no multiple of 1024 images")
    return images


@dataclass
class EDM2NetworkPickle:
    """The contents of an official network pickle, as plain data (see the module docstring)."""

    path: Path
    sha256: str
    network: PersistentObject
    encoder: PersistentObject | None
    loss: PersistentObject | None
    dataset_kwargs: dict[str, Any] | None

    @property
    def is_latent(self) -> bool:
        return self.encoder is not None and self.encoder.class_name == "StabilityVAEEncoder"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_edm2_pickle(path: str | os.PathLike) -> EDM2NetworkPickle:
    """Read an official network pickle safely; raise ValueError if it holds no ``ema`` network."""
    path = Path(path)
    data = load_restricted_pickle(path)
    if not isinstance(data, dict) or not isinstance(data.get("ema"), PersistentObject):
        raise ValueError(f"{path} is not an EDM2 network pickle: it has no 'ema' network")
    encoder, loss = data.get("encoder"), data.get("loss_fn")
    return EDM2NetworkPickle(
        path=path,
        sha256=_sha256(path),
        network=data["ema"],
        encoder=encoder if isinstance(encoder, PersistentObject) else None,
        loss=loss if isinstance(loss, PersistentObject) else None,
        dataset_kwargs=_jsonable(data.get("dataset_kwargs")),
    )


def _jsonable(value: Any) -> Any:
    """Plain JSON data from pickled values (numpy to Python numbers and lists; anything else is dropped)."""
    if isinstance(value, dict):
        converted = ((str(key), item, _jsonable(item)) for key, item in value.items())
        return {key: plain for key, item, plain in converted if plain is not None or item is None}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return None


def _blocks(unet: PersistentObject) -> list[PersistentObject]:
    modules = unet.get("_modules") or {}
    return [
        block
        for container in (modules.get("enc"), modules.get("dec"))
        if container is not None
        for block in (container.get("_modules") or {}).values()
        if isinstance(block, PersistentObject) and block.class_name == "Block"
    ]


def _block_options(unet: PersistentObject) -> dict[str, Any]:
    """Options every block records as attributes; they must agree across blocks."""
    blocks = _blocks(unet)
    if not blocks:
        raise ValueError("the pickled UNet has no Block modules under enc/dec")
    options: dict[str, Any] = {}
    for name in ("dropout", "res_balance", "attn_balance", "clip_act"):
        values = {block.get(name) for block in blocks}
        if len(values) != 1:
            raise ValueError(f"the pickled blocks disagree on {name}: {sorted(values, key=str)}")
        options[name] = values.pop()
    heads = {block["out_channels"] // block["num_heads"] for block in blocks if block.get("num_heads")}
    if len(heads) != 1:
        raise ValueError(f"the pickled attention blocks disagree on channels per head: {sorted(heads)}")
    options["channels_per_head"] = heads.pop()
    filters = {tuple(block.get("resample_filter") or (1, 1)) for block in blocks}
    if filters != {(1, 1)}:
        raise ValueError(f"only the box resampling filter [1, 1] is supported, the pickle uses {sorted(filters)}")
    for name in ("label_balance", "concat_balance"):
        if unet.get(name) is not None:
            options[name] = unet[name]
    return options


def _check_recorded_arguments(unet: PersistentObject, config: dict[str, Any]) -> None:
    """Compare the constructor arguments the pickle recorded with the config read from the tensors."""
    recorded = unet.get("_init_kwargs") or {}
    pairs = [
        ("img_resolution", "sample_size"),
        ("img_channels", "in_channels"),
        ("model_channels", "model_channels"),
        ("channel_mult", "channel_mult"),
        ("num_blocks", "layers_per_block"),
    ]
    for official, ours in pairs:
        if official in recorded and _jsonable(recorded[official]) != _jsonable(config[ours]):
            raise ValueError(f"the pickle records {official}={recorded[official]!r}, its tensors give {config[ours]!r}")
    if "attn_resolutions" in recorded:
        if sorted(recorded["attn_resolutions"]) != sorted(config["attention_resolutions"]):
            raise ValueError(
                f"the pickle records attn_resolutions={recorded['attn_resolutions']!r}, its tensors give "
                f"{config['attention_resolutions']!r}"
            )


def networks_from_pickle(
    network: PersistentObject,
) -> tuple[EDM2UNet2DModel, LearnedUncertainty | None, float]:
    """``(unet, uncertainty, sigma_data)`` in float32 from a pickled ``Precond`` record.

    Records of the wrong kinds (a list where a number belongs, a missing key) raise ValueError.
    """
    try:
        return _networks(network)
    except (AttributeError, IndexError, KeyError, TypeError, ZeroDivisionError) as error:
        raise ValueError(f"the pickled network is malformed: {type(error).__name__}: {error}") from None


def _networks(network: PersistentObject) -> tuple[EDM2UNet2DModel, LearnedUncertainty | None, float]:
    if network.class_name != "Precond":
        raise ValueError(f"expected the official Precond network, got class {network.class_name!r}")
    unet_record = (network.get("_modules") or {}).get("unet")
    if not isinstance(unet_record, PersistentObject) or unet_record.class_name != "UNet":
        raise ValueError("the pickled Precond has no official UNet under 'unet'")
    tensors = {name: tensor.float() for name, tensor in module_tensors(network).items()}
    unet_state, logvar_state, config = convert_edm2_state_dict(tensors, **_block_options(unet_record))
    _check_recorded_arguments(unet_record, config)
    unet = EDM2UNet2DModel(**config)
    unet.load_state_dict(unet_state, strict=True)
    uncertainty = None
    if logvar_state:
        uncertainty = LearnedUncertainty(num_channels=logvar_state["linear.weight"].shape[1])
        uncertainty.load_state_dict(logvar_state, strict=True)
    return unet.eval(), uncertainty, float(network.get("sigma_data", 0.5))


def preconditioner_from_edm2_pickle(path: str | os.PathLike) -> EDMPreconditioner:
    """The official network as an :class:`EDMPreconditioner` (UNet + uncertainty head), ready for fine-tuning."""
    unet, uncertainty, sigma_data = networks_from_pickle(read_edm2_pickle(path).network)
    return EDMPreconditioner(unet, uncertainty, sigma_data=sigma_data)


def _latent_statistics(encoder: PersistentObject) -> tuple[list[float], list[float], float]:
    """``(latents_mean, latents_std, scaling_factor)`` giving the encoder's ``x = z * scale + bias``."""
    try:
        scale = np.asarray(encoder["scale"], dtype=np.float64).reshape(-1)
        bias = np.asarray(encoder["bias"], dtype=np.float64).reshape(-1)
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"the pickle's encoder has no numeric scale / bias: {type(error).__name__}: {error}") from None
    if scale.shape != bias.shape or not np.all(scale > 0):
        raise ValueError(f"the pickle's encoder has invalid scale {scale.tolist()} / bias {bias.tolist()}")
    final_std = float((encoder.get("_init_kwargs") or {}).get("final_std", 0.5))
    return (-bias / scale).tolist(), (final_std / scale).tolist(), final_std


def _load_vae(vae: str | os.PathLike | AutoencoderKL, encoder: PersistentObject) -> AutoencoderKL:
    if not isinstance(vae, AutoencoderKL):
        vae = AutoencoderKL.from_pretrained(vae)
    mean, std, final_std = _latent_statistics(encoder)
    return set_edm2_latent_scaling(vae.eval(), mean, std, final_std)


def from_edm2_pickle(
    path: str | os.PathLike,
    vae: str | os.PathLike | AutoencoderKL | None = None,
    guide: str | os.PathLike | None = None,
    guidance_scale: float | None = None,
) -> EDM2Pipeline:
    """An :class:`EDM2Pipeline` from an official network pickle.

    Args:
        path: the network pickle (read safely, nothing in it is executed).
        vae: for latent (img512) models: a local folder, Hub id or ``AutoencoderKL`` of the VAE the pickle's
            encoder names (``stabilityai/sd-vae-ft-mse``); must be None for pixel models.
        guide: optional guiding network pickle (the unconditional XS nets for CFG, or the small / less-trained
            nets for autoguidance).
        guidance_scale: the pipeline's default guidance weight w in ``D_g + w (D - D_g)`` (needs ``guide``).
    """
    source = read_edm2_pickle(path)
    return _pipeline(source, vae, read_edm2_pickle(guide) if guide is not None else None, guidance_scale)[0]


def _pipeline(
    source: EDM2NetworkPickle,
    vae: str | os.PathLike | AutoencoderKL | None,
    guide: EDM2NetworkPickle | None,
    guidance_scale: float | None,
) -> tuple[EDM2Pipeline, LearnedUncertainty | None, float]:
    if source.is_latent and vae is None:
        vae_name = source.encoder.get("vae_name") if source.encoder is not None else None
        raise ValueError(
            f"{source.path.name} is a latent model (its encoder uses the VAE {vae_name!r}): pass vae / --vae with "
            "a local folder or Hub id of that VAE"
        )
    if not source.is_latent and vae is not None:
        raise ValueError(f"{source.path.name} is a pixel model: vae / --vae must not be given")
    if guidance_scale is not None and guidance_scale != 1.0 and guide is None:
        raise ValueError(f"guidance_scale / --guidance {guidance_scale} needs a guide network (guide / --guide)")
    unet, uncertainty, sigma_data = networks_from_pickle(source.network)
    guide_unet = None
    if guide is not None:
        guide_unet, _, guide_sigma_data = networks_from_pickle(guide.network)
        if guide_sigma_data != sigma_data:
            raise ValueError(f"the guide's sigma_data {guide_sigma_data} differs from the network's {sigma_data}")
    scheduler = EDMHeunScheduler(
        sigma_min=EDM2_SAMPLER["sigma_min"],
        sigma_max=EDM2_SAMPLER["sigma_max"],
        sigma_data=sigma_data,
        rho=EDM2_SAMPLER["rho"],
    )
    pipeline = EDM2Pipeline(
        unet=unet,
        scheduler=scheduler,
        vae=_load_vae(vae, source.encoder) if vae is not None else None,
        guide_unet=guide_unet,
        default_guidance_scale=1.0 if guidance_scale is None else float(guidance_scale),
        vae_pixel_range=EDM2_VAE_PIXEL_RANGE if vae is not None else "[-1, 1]",
    )
    return pipeline, uncertainty, sigma_data


def _record_summary(record: PersistentObject | None) -> dict[str, Any] | None:
    if record is None:
        return None
    attributes = {k: v for k, v in record.state.items() if not str(k).startswith("_") and k != "training"}
    return {
        "class_name": record.class_name,
        "persistence_version": record.version,
        "module_source_sha256": record.source_sha256,
        "attributes": _jsonable(attributes),
        "init_kwargs": _jsonable(record.get("_init_kwargs")),
    }


def _file_summary(source: EDM2NetworkPickle) -> dict[str, Any]:
    parsed = parse_official_name(source.path.name)
    return {
        "file": source.path.name,
        "sha256": source.sha256,
        "training_kimg": parsed[1] if parsed else None,
        "ema_sigma_rel": parsed[2] if parsed else None,
        "network": _record_summary(source.network),
    }


def source_metadata(
    source: EDM2NetworkPickle, guide: EDM2NetworkPickle | None, guidance_scale: float | None
) -> dict[str, Any]:
    """What the conversion keeps of the official files (written as ``edm2_source.json``)."""
    return {
        "source_model": source.path.name.removesuffix(".pkl"),
        "license": EDM2_LICENSE,
        "license_name": EDM2_LICENSE_NAME,
        "license_url": EDM2_LICENSE_URL,
        "copyright": "NVIDIA CORPORATION & AFFILIATES (EDM2 models)",
        "source": _file_summary(source),
        "encoder": _record_summary(source.encoder),
        "loss": _record_summary(source.loss),
        "dataset_kwargs": source.dataset_kwargs,
        "guide": _file_summary(guide) if guide is not None else None,
        "guidance_scale": guidance_scale,
        "sampler": EDM2_SAMPLER,
    }


def _card_text(metadata: dict[str, Any]) -> str:
    lines = [
        "## Source and license",
        "",
        f"Converted from NVIDIA's EDM2 network `{metadata['source']['file']}` (sha256 "
        f'`{metadata["source"]["sha256"][:16]}...`), from the paper "Analyzing and Improving the Training Dynamics '
        'of Diffusion Models" (Karras et al., 2024).',
    ]
    if metadata["guide"] is not None:
        lines.append(
            f"Guide network: `{metadata['guide']['file']}`, default guidance weight {metadata['guidance_scale']}."
        )
    lines += [
        "",
        f"The weights are licensed under the {EDM2_LICENSE_NAME} license ({EDM2_LICENSE_URL}) by NVIDIA: "
        "non-commercial use only, with attribution, and derivatives under the same license.",
        "`edm2_source.json` in the converted folder lists what was kept of the official files.",
    ]
    return "\n".join(lines)


def card_options(metadata: dict[str, Any]) -> dict[str, Any]:
    """Model-card arguments (of ``model_card`` / ``push_pipeline_to_hub``): source model, license, EDM2 sampler."""
    return dict(
        ema_sigma_rel=metadata["source"]["ema_sigma_rel"],
        sampler_settings={"num_inference_steps": EDM2_SAMPLER["num_inference_steps"]},
        extra_text=_card_text(metadata),
        license=EDM2_LICENSE,
    )


def convert_edm2_pickle(
    path: str | os.PathLike,
    output_dir: str | os.PathLike,
    vae: str | os.PathLike | AutoencoderKL | None = None,
    guide: str | os.PathLike | None = None,
    guidance_scale: float | None = None,
    overwrite: bool = False,
) -> EDM2Pipeline:
    """Write an official network pickle as an ``EDM2Pipeline`` folder that is also an ``EDMPreconditioner`` folder.

    The folder is written whole beside ``output_dir`` and then swapped in: an existing non-empty ``output_dir``
    is refused unless ``overwrite``, and then replaced entirely (nothing of the old folder is kept). It receives the pipeline (``save_pretrained``, safetensors), the uncertainty head and
    ``preconditioner_config.json`` beside ``unet/`` (so ``EDMPreconditioner.from_pretrained(output_dir)`` loads
    the network for fine-tuning with the EDM2 loss), ``edm2_source.json`` and a ``README.md`` model card.
    """
    output_dir = Path(output_dir)
    with replaced_folder(output_dir, overwrite) as folder:
        source = read_edm2_pickle(path)
        guide_source = read_edm2_pickle(guide) if guide is not None else None
        pipeline, uncertainty, sigma_data = _pipeline(source, vae, guide_source, guidance_scale)
        EDMPreconditioner(pipeline.unet, uncertainty, sigma_data=sigma_data).save_pretrained(folder)
        pipeline.save_pretrained(folder, safe_serialization=True)
        metadata = source_metadata(source, guide_source, guidance_scale)
        atomic_write_text(folder / SOURCE_METADATA, json.dumps(metadata, indent=2) + "\n")
        atomic_write_text(folder / "README.md", str(model_card(pipeline, output_dir.name, **card_options(metadata))))
    return pipeline


def push_converted_edm2(
    output_dir: str | os.PathLike, repo_id: str, pipeline: EDM2Pipeline | None = None, **hub_kwargs: Any
) -> str:
    """Push a folder written by `convert_edm2_pickle` with the project's pipeline push (Hub-native layout), its
    model card naming the source model and license; returns the commit URL."""
    output_dir = Path(output_dir)
    metadata = json.loads((output_dir / SOURCE_METADATA).read_text(encoding="utf-8"))
    pipeline = EDM2Pipeline.from_pretrained(output_dir) if pipeline is None else pipeline
    return push_pipeline_to_hub(
        pipeline, repo_id, commit_message=f"Convert {metadata['source_model']}", **card_options(metadata), **hub_kwargs
    )
