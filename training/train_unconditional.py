#!/usr/bin/env python
"""Train or fine-tune an unconditional (or class-conditional) diffusion UNet with Accelerate.

Models: diffusers' ``UNet2DModel``, ``ScaleLongUNet2DModel``, the U-ViT, the EDM2 UNet, or a pretrained UNet
(``--pretrained_model_name_or_path``) with ScaleLong long-skip scaling added. Recipes: ``ddpm`` (epsilon, v or sample
prediction with a diffusers noise scheduler) or ``edm2`` (log-normal sigma, EDM preconditioning, learned
uncertainty, Adam (0.9, 0.99), inverse-square-root lr). Post-hoc EMA snapshots (``--ema_sigma_rels
--snapshot_every``), exact resume (``--resume_from_checkpoint latest``) and several processes (``accelerate launch
--num_processes N``).

Latent training (``--recipe edm2``): with ``--vae`` (or the VAE of a pretrained EDM2 pipeline, e.g. one converted
from NVIDIA's pickles by ``scalelong-convert-edm2``) the model learns EDM2-normalised VAE latents; the VAE's moments
of every image are computed once into ``--latent_cache_dir`` (``--no-cache_latents``: each batch is encoded). A
pretrained EDM2 pipeline (or this script's own output) also hands over its learned-uncertainty head and
``sigma_data``.

The script reads top to bottom: the options (:class:`UnconditionalConfig`), then :func:`build_job` (recipe, data,
network: every check, nothing written), then the shared :class:`~diffusers_scalelong.trainer.Trainer`.

Example (the embedded Fashion-MNIST, EDM2 recipe with ScaleLong and post-hoc EMA)::

    scalelong-train --output_dir out --model edm2 --recipe edm2 --lsc cs --kappa 0.7 \
        --ema_sigma_rels 0.05 0.10 --snapshot_every 500 --max_train_steps 2000
"""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

import torch
from accelerate.utils import set_seed
from diffusers import AutoencoderKL

from diffusers_scalelong.data import ImageTransform
from diffusers_scalelong.models.edm2_presets import get_edm2_preset
from diffusers_scalelong.trainer import (
    MODEL_TYPES,
    RECIPES,
    VAE_PIXEL_RANGES,
    CachedLatents,
    DDPMLossOptions,
    DDPMRecipe,
    EDM2Recipe,
    LatentCodec,
    PretrainedEDM2Parts,
    PretrainedModelOptions,
    Trainer,
    TrainingConfig,
    TrainingImages,
    TrainingJob,
    build_edm2,
    build_from_config,
    build_unet2d,
    build_uvit,
    infer_channels,
    load_pretrained,
    load_pretrained_edm2_parts,
    load_pretrained_unet,
    load_training_dataset,
    make_noise_scheduler,
    num_classes,
    option,
    run_and_exit,
    script_main,
)
from diffusers_scalelong.trainer.config import positive_int

MODEL, RECIPE, DATA, LATENT = "model", "recipe", "data", "latent training (edm2 recipe)"
EDM2_PRESET_DATASET = "img64"  # the presets' pixel-space recipe (these scripts train on pixels)
RECIPE_DEFAULTS = {
    # learning_rate, warm-up steps, adam betas, weight decay, gradient clipping, grid sampler steps
    "ddpm": dict(
        learning_rate=1e-4,
        lr_warmup_steps=500,
        adam_beta1=0.95,
        adam_beta2=0.999,
        adam_weight_decay=1e-6,
        max_grad_norm=1.0,
        num_inference_steps=50,
    ),
    "edm2": dict(
        learning_rate=1e-2,
        lr_warmup_steps=200,
        adam_beta1=0.9,
        adam_beta2=0.99,
        adam_weight_decay=0.0,
        max_grad_norm=0.0,
        num_inference_steps=16,
        P_mean=-0.8,
        P_std=1.6,
        lr_ref_steps=35_000,
    ),
}


@dataclass(frozen=True, kw_only=True)
class UnconditionalConfig(DDPMLossOptions, PretrainedModelOptions, TrainingConfig):
    """The options of this script: the shared ones of :class:`TrainingConfig`, then model, recipe and data."""

    train_batch_size: int = option(
        32, help="images per device and micro-step", group="output and steps", type=positive_int
    )

    # ---------------------------------------------------------------------------------------- model
    model: str = option(
        "scalelong_unet2d", help="network family trained from scratch", group=MODEL, choices=MODEL_TYPES
    )
    pretrained_model_name_or_path: str | None = option(
        None, help="fine-tune the UNet of this local folder or Hub repo (pipeline or model)", group=MODEL
    )
    model_config_name_or_path: str | None = option(
        None,
        help="build the network from this model config (a JSON file, a model or pipeline folder, or a Hub repo) "
        "instead of the architecture options; its _class_name picks the class (diffusers' UNet2DModel, the "
        "ScaleLong UNet, the EDM2 UNet, the U-ViT); lsc / kappa still apply",
        group=MODEL,
    )
    block_out_channels: tuple[int, ...] = option(
        (32, 64, 64), help="unet2d: width of each level", group=MODEL, type=positive_int, nargs="+"
    )
    layers_per_block: int | None = option(
        None, help="blocks per level (default: 2 for unet2d, the preset's for edm2)", group=MODEL, type=positive_int
    )
    attention_levels: tuple[int, ...] = option(
        (2,),
        help="unet2d: levels (0 = outermost) with self-attention (none: pass the flag alone)",
        group=MODEL,
        type=int,
    )
    norm_num_groups: int = option(16, help="unet2d: GroupNorm groups", group=MODEL, type=positive_int)
    dropout: float | None = option(
        None,
        help="probability of dropping activations in residual blocks (default: the model's)",
        group=MODEL,
        parameter="dropout",
    )
    edm2_preset: str | None = option(
        None,
        help="edm2: the paper's preset (ImageNet-64 pixel recipe): its widths and dropout, and with --recipe edm2 "
        "its learning rate, P_mean, P_std and lr decay steps as defaults",
        group=MODEL,
        choices=("XS", "S", "M", "L", "XL", "XXL"),
    )
    model_channels: int | None = option(
        None, help="edm2: base width (overrides the preset; default 32 without preset)", group=MODEL, type=positive_int
    )
    channel_mult: tuple[int, ...] | None = option(
        None, help="edm2: width multiplier of each level (default 1 2 2)", group=MODEL, type=positive_int, nargs="+"
    )
    attention_resolutions: tuple[int, ...] | None = option(
        None, help="edm2: resolutions with attention (default: the lowest)", group=MODEL, type=positive_int
    )
    channels_per_head: int | None = option(
        None, help="edm2: attention head width (default: 64)", group=MODEL, type=positive_int
    )
    uvit_depth: int = option(
        6, help="uvit: number of transformer blocks (even: in/out pairs)", group=MODEL, type=positive_int
    )
    uvit_num_heads: int = option(4, help="uvit: attention heads", group=MODEL, type=positive_int)
    uvit_embed_dim: int = option(128, help="uvit: token width", group=MODEL, type=positive_int)
    uvit_patch_size: int = option(2, help="uvit: patch size", group=MODEL, type=positive_int)

    # ---------------------------------------------------------------------------------------- recipe
    recipe: str = option(
        "ddpm",
        help="ddpm: noise prediction; edm2: EDM2 loss, Adam(0.9, 0.99), inverse-sqrt lr",
        group=RECIPE,
        choices=RECIPES,
    )
    noise_scheduler: str = option("DDPMScheduler", help="ddpm: diffusers noise scheduler class", group=RECIPE)
    ddpm_num_steps: int = option(1000, help="ddpm: training timesteps", group=RECIPE, type=positive_int)
    ddpm_beta_schedule: str = option(
        "linear", help="ddpm: beta schedule (linear, squaredcos_cap_v2, ...)", group=RECIPE
    )
    prediction_type: str = option(
        "epsilon",
        help="ddpm: network target (the noise, v, or the clean image)",
        group=RECIPE,
        choices=("epsilon", "v_prediction", "sample"),
    )
    P_mean: float | None = option(
        None, help="edm2: mean of ln(sigma) during training (default: -0.8 or the preset's)", group=RECIPE
    )
    P_std: float | None = option(None, help="edm2: std of ln(sigma) (default: 1.6 or the preset's)", group=RECIPE)
    lr_ref_steps: int | None = option(
        None,
        help="edm2: steps after which the lr decays as 1/sqrt(t) (default: 35000 or the preset's t_ref)",
        group=RECIPE,
        type=positive_int,
    )
    lr_scheduler: str = option(
        "cosine", help="ddpm: diffusers lr schedule (constant, linear, cosine, ...)", group=RECIPE
    )

    # ---------------------------------------------------------------------------------------- data
    dataset_name: str | None = option(
        None, help="a `datasets` name or local path (default: the embedded Fashion-MNIST)", group=DATA
    )
    train_data_dir: str | None = option(
        None, help="a folder of images (imagefolder; sub-folders are classes)", group=DATA
    )
    dataset_split: str = option("train", help="split of dataset_name / train_data_dir", group=DATA)
    dataset_config_name: str | None = option(None, help="configuration of dataset_name (if it has several)", group=DATA)
    cache_dir: str | None = option(None, help="`datasets` cache folder (default: the datasets library's)", group=DATA)
    image_column: str | None = option(None, help="image column (default: the first image column)", group=DATA)
    label_column: str | None = option(None, help="label column for class_conditional (default: label)", group=DATA)
    resolution: int = option(
        32,
        help="image size in pixels the model trains at (images are resized, then cropped)",
        group=DATA,
        type=positive_int,
        parameter="resolution",
    )
    center_crop: bool = option(False, help="crop the centre instead of a random square", group=DATA)
    random_flip: bool = option(False, help="mirror half of the images left-right", group=DATA)
    allow_upscaling: bool = option(False, help="accept images smaller than resolution (they are upscaled)", group=DATA)
    class_conditional: bool = option(False, help="condition on the dataset's class labels (edm2 recipe)", group=DATA)
    max_train_samples: int | None = option(None, help="use only the first N images", group=DATA, type=positive_int)

    # ---------------------------------------------------------------------------------------- latent training
    vae: str | None = option(
        None,
        help="train on the latents of this AutoencoderKL (local folder or Hub id; its config needs latents_mean / "
        "latents_std); default: the VAE of an EDM2 pretrained_model_name_or_path that has one. resolution stays "
        "the size in pixels",
        group=LATENT,
        parameter="vae",
    )
    vae_pixel_range: str | None = option(
        None,
        help="pixel range the VAE works in (default: the pretrained pipeline's, else [-1, 1]; EDM2's models: [0, 1])",
        group=LATENT,
        choices=tuple(VAE_PIXEL_RANGES),
    )
    cache_latents: bool = option(
        True,
        help="encode every image once (needs center_crop, no random_flip) into latent_cache_dir; --no-cache_latents "
        "encodes every batch",
        group=LATENT,
        negatable=True,
    )
    latent_cache_dir: str | None = option(None, help="latent cache folder (default: OUTPUT_DIR/latents)", group=LATENT)

    def derived_defaults(self) -> dict:
        """The recipe's values, and with ``edm2_preset`` the paper's recipe of that preset (``EDM2Preset``: reference
        lr, P_mean, P_std and t_ref as the lr decay steps)."""
        defaults = dict(RECIPE_DEFAULTS[self.recipe])
        if self.recipe == "edm2" and self.edm2_preset is not None:
            preset = get_edm2_preset(self.edm2_preset, dataset=EDM2_PRESET_DATASET)
            defaults.update(
                learning_rate=preset.ref_lr, P_mean=preset.P_mean, P_std=preset.P_std, lr_ref_steps=preset.t_ref
            )
        return defaults

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dataset_name and self.train_data_dir:
            raise ValueError("pass either dataset_name or train_data_dir, not both")
        if self.dataset_config_name and not self.dataset_name:
            raise ValueError("dataset_config_name needs dataset_name (the dataset it configures)")
        self._check_model_source()
        if self.class_conditional and self.recipe == "ddpm":
            raise ValueError("class_conditional needs recipe edm2 (DDPMPipeline samples unconditionally)")
        if self.recipe == "edm2" and self.prediction_type != "epsilon":
            raise ValueError("prediction_type applies to recipe ddpm only")
        if self.recipe == "edm2" and (self.snr_gamma is not None or self.noise_offset):
            raise ValueError("snr_gamma and noise_offset apply to recipe ddpm only (EDM2 weights its loss itself)")

    def _check_model_source(self) -> None:
        """One source of the network: a pretrained model, a model config, or the architecture options."""
        pretrained, from_config = self.pretrained_model_name_or_path, self.model_config_name_or_path
        if (self.revision or self.variant) and not pretrained:
            raise ValueError("revision / variant need pretrained_model_name_or_path (the model they select)")
        if from_config is None:
            return
        if pretrained:
            raise ValueError(
                "pass either model_config_name_or_path (a new network from a config) or pretrained_model_name_or_path "
                "(a pretrained network), not both"
            )
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        given = [f"--{name}" for name in ARCHITECTURE_OPTIONS if getattr(self, name) != defaults[name]]
        if given:
            raise ValueError(f"model_config_name_or_path sets the architecture; drop {', '.join(given)}")


ARCHITECTURE_OPTIONS = (
    "model", "block_out_channels", "layers_per_block", "attention_levels", "norm_num_groups", "dropout",
    "edm2_preset", "model_channels", "channel_mult", "attention_resolutions", "channels_per_head",
    "uvit_depth", "uvit_num_heads", "uvit_embed_dim", "uvit_patch_size",
)  # fmt: skip


def build_model(config: UnconditionalConfig, channels: int, classes: int | None, resolution: int) -> torch.nn.Module:
    """The UNet to train (from scratch or pretrained) at ``resolution`` (pixels, or latents of a VAE), before any
    wrapping by the recipe."""
    c = config
    if c.pretrained_model_name_or_path:
        return load_pretrained(
            lambda: load_pretrained_unet(
                c.pretrained_model_name_or_path, c.lsc, c.kappa, revision=c.revision, variant=c.variant
            ),
            c.pretrained_model_name_or_path,
            c.revision,
            c.variant,
        )
    if c.model_config_name_or_path:
        return build_from_config(c.model_config_name_or_path, resolution, channels, classes, c.lsc, c.kappa)
    common = dict(
        resolution=resolution, channels=channels, num_class_embeds=classes, lsc_method=c.lsc, lsc_kappa=c.kappa
    )
    if c.model in ("unet2d", "scalelong_unet2d"):
        return build_unet2d(
            scalelong=c.model == "scalelong_unet2d",
            block_out_channels=c.block_out_channels,
            layers_per_block=c.layers_per_block or 2,
            attention_levels=c.attention_levels,
            norm_num_groups=c.norm_num_groups,
            dropout=c.dropout or 0.0,
            **common,
        )
    if c.model == "edm2":
        preset = c.edm2_preset
        return build_edm2(
            preset=preset,
            model_channels=c.model_channels or (None if preset else 32),
            channel_mult=c.channel_mult or (None if preset else (1, 2, 2)),
            layers_per_block=c.layers_per_block or (None if preset else 2),
            attention_resolutions=c.attention_resolutions,
            dropout=c.dropout,
            channels_per_head=c.channels_per_head,
            **common,
        )
    return build_uvit(
        patch_size=c.uvit_patch_size,
        embed_dim=c.uvit_embed_dim,
        depth=c.uvit_depth,
        num_heads=c.uvit_num_heads,
        **common,
    )


def latent_codec(config: UnconditionalConfig, parts: PretrainedEDM2Parts) -> LatentCodec | None:
    """The VAE to train on (``vae``, else a pretrained EDM2 pipeline's) with its normalisation; None for pixels."""
    if config.vae is None and parts.vae is None:
        if config.vae_pixel_range is not None:
            raise ValueError("vae_pixel_range needs a VAE (vae, or a pretrained EDM2 pipeline with one)")
        return None
    if config.recipe != "edm2":
        raise ValueError("vae (latent training) needs recipe edm2: EDM2Pipeline decodes the latents")
    try:
        vae = AutoencoderKL.from_pretrained(config.vae) if config.vae is not None else parts.vae
    except (OSError, ValueError) as error:
        raise ValueError(f"vae {config.vae!r} could not be loaded as an AutoencoderKL: {error}") from error
    codec = LatentCodec(vae, config.vae_pixel_range or parts.vae_pixel_range or "[-1, 1]")
    if config.resolution % codec.downsampling:
        raise ValueError(f"resolution {config.resolution} must be a multiple of the VAE's {codec.downsampling}x scale")
    if config.cache_latents and (config.random_flip or not config.center_crop):
        raise ValueError(
            "cache_latents encodes each image once: it needs center_crop and no random_flip "
            "(or pass --no-cache_latents to encode every batch)"
        )
    return codec


def build_recipe(config: UnconditionalConfig, parts: PretrainedEDM2Parts, codec: LatentCodec | None):
    """The loss, pipeline and grid sampler of ``recipe`` (which check their own parameters)."""
    if config.recipe == "edm2":
        return EDM2Recipe(
            P_mean=config.P_mean,
            P_std=config.P_std,
            sigma_data=parts.sigma_data or 0.5,
            uncertainty=parts.uncertainty,
            vae=codec.vae if codec else None,
            vae_pixel_range=codec.pixel_range if codec else "[-1, 1]",
            lr_ref_steps=config.lr_ref_steps,
            lr_warmup_steps=config.lr_warmup_steps,
        )
    scheduler = make_noise_scheduler(
        config.noise_scheduler, config.ddpm_num_steps, config.ddpm_beta_schedule, config.prediction_type
    )
    return DDPMRecipe(
        scheduler,
        snr_gamma=config.snr_gamma,
        noise_offset=config.noise_offset,
        lr_scheduler=config.lr_scheduler,
        lr_warmup_steps=config.lr_warmup_steps,
    )


def training_data(config: UnconditionalConfig, dataset, codec: LatentCodec | None):
    """``(dataset for the loader, batch -> model input)``: images, cached latent moments, or images encoded per batch."""
    channels = codec.vae.config.in_channels if codec else infer_channels(dataset)
    transform = ImageTransform(
        config.resolution, center_crop=config.center_crop, random_flip=config.random_flip, channels=channels
    )
    images = TrainingImages(dataset, transform, with_labels=config.class_conditional, seed=config.seed)
    if codec is None:
        return images, lambda batch: batch["pixel_values"]
    if not config.cache_latents:
        return images, lambda batch: codec.sample(codec.moments(batch["pixel_values"]))
    key = dict(dataset=dataset._fingerprint, rows=len(dataset), resolution=config.resolution, channels=channels)
    cache_dir = config.latent_cache_dir or f"{config.output_dir}/latents"
    latents = CachedLatents(images, codec, cache_dir, key, config.class_conditional)  # filled by the trainer
    return latents, lambda batch: codec.sample(batch["latent_moments"])


def build_job(config: UnconditionalConfig) -> TrainingJob:
    """Recipe, data and network, in the order that fails fastest; nothing is written (a latent cache is filled by the
    trainer once it holds the output folder)."""
    parts = PretrainedEDM2Parts()
    if config.pretrained_model_name_or_path and config.recipe == "edm2":
        parts = load_pretrained(
            lambda: load_pretrained_edm2_parts(
                config.pretrained_model_name_or_path, revision=config.revision, variant=config.variant
            ),
            config.pretrained_model_name_or_path,
            config.revision,
            config.variant,
        )
    codec = latent_codec(config, parts)
    recipe = build_recipe(config, parts, codec)
    dataset = load_training_dataset(
        dataset_name=config.dataset_name,
        train_data_dir=config.train_data_dir,
        split=config.dataset_split,
        image_column=config.image_column,
        label_column=config.label_column,
        resolution=config.resolution,
        class_conditional=config.class_conditional,
        allow_upscaling=config.allow_upscaling,
        max_train_samples=config.max_train_samples,
        dataset_config_name=config.dataset_config_name,
        cache_dir=config.cache_dir,
    )
    channels = codec.vae.config.latent_channels if codec else infer_channels(dataset)
    classes = num_classes(dataset) if config.class_conditional else None
    set_seed(config.seed)  # identical initial weights on every process
    resolution = config.resolution // codec.downsampling if codec else config.resolution
    unet = build_model(config, channels, classes, resolution)
    takes = getattr(unet.config, "in_channels", channels)
    if takes != channels:
        raise ValueError(
            f"the network takes {takes}-channel input but the {'latents' if codec else 'images'} have {channels} "
            "channels (pretrained_model_name_or_path / model_config_name_or_path vs the data)"
        )
    data, model_input = training_data(config, dataset, codec)
    return recipe.job(
        unet,
        data,
        model_input,
        class_names=class_names(dataset, num_classes(dataset)) if config.class_conditional else None,
        frozen=[codec.vae] if codec else [],
        tracker_name="train_unconditional",
        base_model=config.pretrained_model_name_or_path,
        dataset_name=config.dataset_name,
        prepare_data=data.prepare if isinstance(data, CachedLatents) else None,
    )


def class_names(dataset, count: int) -> list[str]:
    """The dataset's class names (``ClassLabel``), else ``class <i>``."""
    names = getattr(dataset.features["label"], "names", None)
    return list(names) if names and len(names) == count else [f"class {i}" for i in range(count)]


def train(config: UnconditionalConfig):
    return Trainer(config, build_job(config)).train()


main = script_main(UnconditionalConfig, train, __doc__.split("\n\n")[0])


def console_main(argv: Sequence[str] | None = None) -> NoReturn:
    """The ``scalelong-train`` command: ``main(argv)``, its process ended as :func:`run_and_exit` ends a launched one."""
    run_and_exit(lambda: main(argv))


if __name__ == "__main__":
    console_main()
