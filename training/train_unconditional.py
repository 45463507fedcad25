#!/usr/bin/env python
"""Train or fine-tune an unconditional (or class-conditional) diffusion UNet with Accelerate.

Models: diffusers' ``UNet2DModel``, ``ScaleLongUNet2DModel``, the U-ViT, the EDM2 UNet, or a pretrained UNet
(``--pretrained_model_name_or_path``) with ScaleLong long-skip scaling added. Recipes: ``ddpm`` (epsilon/v prediction
with a diffusers noise scheduler) or ``edm2`` (log-normal sigma, EDM preconditioning, learned uncertainty, Adam
(0.9, 0.99), inverse-square-root lr). Post-hoc EMA snapshots (``--ema_sigma_rels --snapshot_every``), exact resume
(``--resume_from_checkpoint latest``) and several processes (``accelerate launch --num_processes N``).

Latent training (``--recipe edm2``): with ``--vae`` (or the VAE of a pretrained EDM2 pipeline, e.g. one converted
from NVIDIA's pickles by ``scalelong-convert-edm2``) the model learns EDM2-normalised VAE latents; the VAE's moments
of every image are computed once into ``--latent_cache_dir`` (``--no-cache_latents``: each batch is encoded). A
pretrained EDM2 pipeline also hands over its learned-uncertainty head and ``sigma_data``.

Example (the embedded Fashion-MNIST, EDM2 recipe with ScaleLong and post-hoc EMA)::

    python training/train_unconditional.py --output_dir out --model edm2 --recipe edm2 --lsc cs --kappa 0.7 \
        --ema_sigma_rels 0.05 0.10 --snapshot_every 500 --max_train_steps 2000
"""

import argparse
import sys
from pathlib import Path

import torch
from accelerate.utils import set_seed
from diffusers import AutoencoderKL

from diffusers_scalelong.data import ImageTransform
from diffusers_scalelong.edm2.presets import get_edm2_preset
from diffusers_scalelong.trainer import (
    MODEL_TYPES,
    RECIPES,
    VAE_PIXEL_RANGES,
    CachedLatents,
    DDPMRecipe,
    EDM2Recipe,
    LatentCodec,
    PretrainedEDM2Parts,
    SampleGrid,
    TrainingImages,
    TrainingJob,
    add_ddpm_loss_args,
    add_lsc_args,
    add_pretrained_source_args,
    add_training_args,
    build_edm2,
    build_from_config,
    build_unet2d,
    build_uvit,
    cache_latent_moments,
    ensure_writable_dir,
    images_from_numpy,
    infer_channels,
    load_pretrained_edm2_parts,
    load_pretrained_unet,
    load_training_dataset,
    make_noise_scheduler,
    num_classes,
    positive_int,
    run_script_main,
    run_training,
    validate_training_args,
)
from diffusers_scalelong.trainer.run_identity import start_run

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


def recipe_defaults(args: argparse.Namespace) -> dict:
    """The defaults of the options left unset: the recipe's, and with ``--edm2_preset`` the paper's recipe of that
    preset (``EDM2Preset``: reference lr, P_mean, P_std and t_ref as the lr decay steps)."""
    defaults = dict(RECIPE_DEFAULTS[args.recipe])
    if args.recipe == "edm2" and args.edm2_preset is not None:
        preset = get_edm2_preset(args.edm2_preset, dataset=EDM2_PRESET_DATASET)
        defaults.update(
            learning_rate=preset.ref_lr, P_mean=preset.P_mean, P_std=preset.P_std, lr_ref_steps=preset.t_ref
        )
    return defaults


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model", choices=MODEL_TYPES, default="scalelong_unet2d", help="network family trained from scratch"
    )
    model.add_argument(
        "--pretrained_model_name_or_path",
        default=None,
        help="fine-tune the UNet of this local folder or Hub repo (pipeline or model)",
    )
    model.add_argument(
        "--model_config_name_or_path",
        default=None,
        help="build the network from this model config (a JSON file, a model or pipeline folder, or a Hub repo) "
        "instead of the architecture options; its _class_name picks the class (diffusers' UNet2DModel, the "
        "ScaleLong UNet, the EDM2 UNet, the U-ViT); --lsc / --kappa still apply",
    )
    add_pretrained_source_args(model)
    model.add_argument(
        "--block_out_channels", type=positive_int, nargs="+", default=[32, 64, 64], help="unet2d: width of each level"
    )
    model.add_argument(
        "--layers_per_block",
        type=positive_int,
        default=None,
        help="blocks per level (default: 2 for unet2d, the preset's for edm2)",
    )
    model.add_argument(
        "--attention_levels",
        type=int,
        nargs="*",
        default=[2],
        help="unet2d: levels (0 = outermost) with self-attention",
    )
    model.add_argument("--norm_num_groups", type=positive_int, default=16, help="unet2d: GroupNorm groups")
    model.add_argument("--dropout", type=float, default=None, help="dropout in residual blocks (default: the model's)")
    model.add_argument(
        "--edm2_preset",
        choices=("XS", "S", "M", "L", "XL", "XXL"),
        default=None,
        help="edm2: the paper's preset (ImageNet-64 pixel recipe): its widths and dropout, and with --recipe edm2 "
        "its learning rate, P_mean, P_std and lr decay steps as defaults",
    )
    model.add_argument(
        "--model_channels",
        type=positive_int,
        default=None,
        help="edm2: base width (overrides the preset; default 32 without preset)",
    )
    model.add_argument(
        "--channel_mult",
        type=positive_int,
        nargs="+",
        default=None,
        help="edm2: width multiplier of each level (default 1 2 2)",
    )
    model.add_argument(
        "--attention_resolutions",
        type=positive_int,
        nargs="*",
        default=None,
        help="edm2: resolutions with attention (default: the lowest)",
    )
    model.add_argument(
        "--channels_per_head", type=positive_int, default=None, help="edm2: attention head width (default: 64)"
    )
    model.add_argument(
        "--uvit_depth", type=positive_int, default=6, help="uvit: number of transformer blocks (even: in/out pairs)"
    )
    model.add_argument("--uvit_num_heads", type=positive_int, default=4, help="uvit: attention heads")
    model.add_argument("--uvit_embed_dim", type=positive_int, default=128, help="uvit: token width")
    model.add_argument("--uvit_patch_size", type=positive_int, default=2, help="uvit: patch size")
    add_lsc_args(parser)

    recipe = parser.add_argument_group("recipe")
    recipe.add_argument(
        "--recipe",
        choices=RECIPES,
        default="ddpm",
        help="ddpm: noise prediction; edm2: EDM2 loss, Adam(0.9, 0.99), inverse-sqrt lr",
    )
    recipe.add_argument("--noise_scheduler", default="DDPMScheduler", help="ddpm: diffusers noise scheduler class")
    recipe.add_argument("--ddpm_num_steps", type=positive_int, default=1000, help="ddpm: training timesteps")
    recipe.add_argument(
        "--ddpm_beta_schedule", default="linear", help="ddpm: beta schedule (linear, squaredcos_cap_v2, ...)"
    )
    recipe.add_argument(
        "--prediction_type", choices=("epsilon", "v_prediction"), default="epsilon", help="ddpm: network target"
    )
    add_ddpm_loss_args(recipe)
    recipe.add_argument(
        "--P_mean",
        type=float,
        default=None,
        help="edm2: mean of ln(sigma) during training (default: -0.8 or the preset's)",
    )
    recipe.add_argument(
        "--P_std", type=float, default=None, help="edm2: std of ln(sigma) (default: 1.6 or the preset's)"
    )
    recipe.add_argument(
        "--lr_ref_steps",
        type=positive_int,
        default=None,
        help="edm2: steps after which the lr decays as 1/sqrt(t) (default: 35000 or the preset's t_ref)",
    )
    recipe.add_argument(
        "--lr_scheduler", default="cosine", help="ddpm: diffusers lr schedule (constant, linear, cosine, ...)"
    )

    data = parser.add_argument_group("data")
    data.add_argument(
        "--dataset_name", default=None, help="a `datasets` name or local path (default: the embedded Fashion-MNIST)"
    )
    data.add_argument(
        "--train_data_dir", default=None, help="a folder of images (imagefolder; sub-folders are classes)"
    )
    data.add_argument("--dataset_split", default="train", help="split of --dataset_name / --train_data_dir")
    data.add_argument("--dataset_config_name", default=None, help="configuration of --dataset_name (if it has several)")
    data.add_argument("--cache_dir", default=None, help="`datasets` cache folder (default: the datasets library's)")
    data.add_argument("--image_column", default=None, help="image column (default: the first image column)")
    data.add_argument("--label_column", default=None, help="label column for --class_conditional (default: label)")
    data.add_argument(
        "--resolution", type=positive_int, default=32, help="training resolution (images are resized, then cropped)"
    )
    data.add_argument("--center_crop", action="store_true", help="crop the centre instead of a random square")
    data.add_argument("--random_flip", action="store_true", help="mirror half of the images left-right")
    data.add_argument(
        "--allow_upscaling", action="store_true", help="accept images smaller than --resolution (they are upscaled)"
    )
    data.add_argument(
        "--class_conditional", action="store_true", help="condition on the dataset's class labels (edm2 recipe)"
    )
    data.add_argument("--max_train_samples", type=positive_int, default=None, help="use only the first N images")

    latent = parser.add_argument_group("latent training (edm2 recipe)")
    latent.add_argument(
        "--vae",
        default=None,
        help="train on the latents of this AutoencoderKL (local folder or Hub id; its config needs latents_mean / "
        "latents_std); default: the VAE of an EDM2 --pretrained_model_name_or_path that has one. --resolution "
        "stays the pixel resolution",
    )
    latent.add_argument(
        "--vae_pixel_range",
        choices=tuple(VAE_PIXEL_RANGES),
        default=None,
        help="pixel range the VAE works in (default: the pretrained pipeline's, else [-1, 1]; EDM2's models: [0, 1])",
    )
    latent.add_argument(
        "--cache_latents",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="encode every image once (needs --center_crop, no --random_flip) into --latent_cache_dir; "
        "--no-cache_latents encodes every batch",
    )
    latent.add_argument("--latent_cache_dir", default=None, help="latent cache folder (default: OUTPUT_DIR/latents)")
    add_training_args(parser, default_batch_size=32)
    return parser


def validate_args(args: argparse.Namespace) -> None:
    """Everything that can be checked from the options alone; raises ``ValueError`` naming the option."""
    validate_training_args(args)
    for key, value in recipe_defaults(args).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.dataset_name and args.train_data_dir:
        raise ValueError("pass either --dataset_name or --train_data_dir, not both")
    check_model_source(args)
    if args.dataset_config_name and not args.dataset_name:
        raise ValueError("--dataset_config_name needs --dataset_name (the dataset it configures)")
    if args.model == "unet2d" and args.lsc != "none" and not args.pretrained_model_name_or_path:
        raise ValueError("--model unet2d is diffusers' vanilla UNet; use --model scalelong_unet2d with --lsc")
    if args.class_conditional and args.recipe == "ddpm":
        raise ValueError("--class_conditional needs --recipe edm2 (DDPMPipeline samples unconditionally)")
    if args.recipe == "edm2" and args.prediction_type != "epsilon":
        raise ValueError("--prediction_type applies to --recipe ddpm only")
    if args.recipe == "edm2" and (args.snr_gamma is not None or args.noise_offset):
        raise ValueError("--snr_gamma and --noise_offset apply to --recipe ddpm only (EDM2 weights its loss itself)")
    if args.recipe == "edm2" and args.P_std <= 0:
        raise ValueError(f"--P_std must be positive, got {args.P_std}")
    if args.dropout is not None and not 0 <= args.dropout < 1:
        raise ValueError(f"--dropout must lie in [0, 1), got {args.dropout}")
    if args.max_grad_norm < 0:
        raise ValueError("--max_grad_norm must be >= 0 (0 disables clipping)")


ARCHITECTURE_OPTIONS = (
    "model", "block_out_channels", "layers_per_block", "attention_levels", "norm_num_groups", "dropout",
    "edm2_preset", "model_channels", "channel_mult", "attention_resolutions", "channels_per_head",
    "uvit_depth", "uvit_num_heads", "uvit_embed_dim", "uvit_patch_size",
)  # fmt: skip


def check_model_source(args: argparse.Namespace) -> None:
    """One source of the network: a pretrained model, a model config, or the architecture options."""
    if args.model_config_name_or_path is None:
        if (args.revision or args.variant) and not args.pretrained_model_name_or_path:
            raise ValueError("--revision / --variant need --pretrained_model_name_or_path (the model they select)")
        return
    if args.pretrained_model_name_or_path:
        raise ValueError(
            "pass either --model_config_name_or_path (a new network from a config) or --pretrained_model_name_or_path "
            "(a pretrained network), not both"
        )
    defaults = build_parser()
    given = [f"--{name}" for name in ARCHITECTURE_OPTIONS if getattr(args, name) != defaults.get_default(name)]
    if given:
        raise ValueError(
            f"--model_config_name_or_path sets the architecture; drop {', '.join(given)} (or the config option)"
        )
    if args.revision or args.variant:
        raise ValueError("--revision / --variant need --pretrained_model_name_or_path (the model they select)")


def build_model(args: argparse.Namespace, channels: int, classes: int | None, resolution: int) -> torch.nn.Module:
    """The UNet to train (from scratch or pretrained) at ``resolution`` (pixels, or latents of a VAE), before any
    wrapping by the recipe."""
    if args.pretrained_model_name_or_path:
        return load_pretrained(
            lambda: load_pretrained_unet(
                args.pretrained_model_name_or_path, args.lsc, args.kappa, revision=args.revision, variant=args.variant
            ),
            args,
        )
    if args.model_config_name_or_path:
        return build_from_config(args.model_config_name_or_path, resolution, channels, classes, args.lsc, args.kappa)
    if args.model in ("unet2d", "scalelong_unet2d"):
        return build_unet2d(
            scalelong=args.model == "scalelong_unet2d",
            resolution=resolution,
            channels=channels,
            block_out_channels=tuple(args.block_out_channels),
            layers_per_block=args.layers_per_block or 2,
            attention_levels=tuple(args.attention_levels),
            norm_num_groups=args.norm_num_groups,
            num_class_embeds=classes,
            lsc_method=args.lsc,
            lsc_kappa=args.kappa,
            dropout=args.dropout or 0.0,
        )
    if args.model == "edm2":
        preset = args.edm2_preset
        return build_edm2(
            resolution=resolution,
            channels=channels,
            preset=preset,
            model_channels=args.model_channels or (None if preset else 32),
            channel_mult=args.channel_mult or (None if preset else (1, 2, 2)),
            layers_per_block=args.layers_per_block or (None if preset else 2),
            attention_resolutions=args.attention_resolutions,
            num_class_embeds=classes,
            lsc_method=args.lsc,
            lsc_kappa=args.kappa,
            dropout=args.dropout,
            channels_per_head=args.channels_per_head,
        )
    return build_uvit(
        resolution=resolution,
        channels=channels,
        patch_size=args.uvit_patch_size,
        embed_dim=args.uvit_embed_dim,
        depth=args.uvit_depth,
        num_heads=args.uvit_num_heads,
        num_class_embeds=classes,
        lsc_method=args.lsc,
        lsc_kappa=args.kappa,
    )


def load_pretrained(load, args: argparse.Namespace):
    """``load()``, with a missing weight file (e.g. of ``--variant``) or Hub revision reported naming the options."""
    from huggingface_hub.errors import RevisionNotFoundError

    try:
        return load()
    except (OSError, RevisionNotFoundError) as error:
        raise ValueError(
            f"--pretrained_model_name_or_path {args.pretrained_model_name_or_path!r} (--revision {args.revision}, "
            f"--variant {args.variant}) could not be loaded: {error}"
        ) from error


def grid_sampler(recipe, classes: list[str] | None):
    """The sample-grid function: one batch from the recipe's sampler, or for a class-conditional run one row per
    class, every row from the same noise (``seed``)."""
    if classes is None:
        return lambda *sample_args: SampleGrid(recipe.sample(*sample_args))

    @torch.no_grad()
    def sample(unet, num_images: int, seed: int, num_inference_steps: int) -> SampleGrid:
        pipeline = recipe.pipeline(unet)
        pipeline.set_progress_bar_config(disable=True)
        rows = []
        for label in range(len(classes)):
            output = pipeline(
                class_labels=[label] * num_images,
                generator=torch.Generator(device="cpu").manual_seed(seed),
                num_inference_steps=num_inference_steps,
                output_type="np",
            )
            rows.append(images_from_numpy(output.images))
        return SampleGrid.from_rows(rows, classes, tag="test_samples")

    return sample


def class_names(dataset, count: int) -> list[str]:
    """The dataset's class names (``ClassLabel``), else ``class <i>``."""
    names = getattr(dataset.features["label"], "names", None)
    return list(names) if names and len(names) == count else [f"class {i}" for i in range(count)]


def build_recipe(args: argparse.Namespace, parts: PretrainedEDM2Parts, codec: LatentCodec | None):
    if args.recipe == "edm2":
        return EDM2Recipe(
            P_mean=args.P_mean,
            P_std=args.P_std,
            sigma_data=parts.sigma_data or 0.5,
            uncertainty=parts.uncertainty,
            vae=codec.vae if codec else None,
            vae_pixel_range=codec.pixel_range if codec else "[-1, 1]",
        )
    scheduler = make_noise_scheduler(
        args.noise_scheduler, args.ddpm_num_steps, args.ddpm_beta_schedule, args.prediction_type
    )
    return DDPMRecipe(scheduler, snr_gamma=args.snr_gamma, noise_offset=args.noise_offset)


def build_lr_scheduler(args: argparse.Namespace, optimizer: torch.optim.Optimizer, max_steps: int):
    if args.recipe == "edm2":
        from diffusers_scalelong.edm2 import inverse_sqrt_lr_lambda

        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, inverse_sqrt_lr_lambda(args.lr_ref_steps, args.lr_warmup_steps)
        )
    from diffusers.optimization import get_scheduler

    try:
        return get_scheduler(
            args.lr_scheduler, optimizer, num_warmup_steps=args.lr_warmup_steps, num_training_steps=max_steps
        )
    except ValueError as error:
        raise ValueError(f"--lr_scheduler {args.lr_scheduler!r}: {error}") from error


def prepare_run(args: argparse.Namespace):
    """All checks and the cheap set-up, in the order that fails fastest; nothing is written but a probe file."""
    validate_args(args)
    output_dir = ensure_writable_dir(args.output_dir)
    run = start_run(output_dir, args.resume_from_checkpoint, args.overwrite_output_dir)
    dataset = load_training_dataset(
        dataset_name=args.dataset_name,
        train_data_dir=args.train_data_dir,
        split=args.dataset_split,
        image_column=args.image_column,
        label_column=args.label_column,
        resolution=args.resolution,
        class_conditional=args.class_conditional,
        allow_upscaling=args.allow_upscaling,
        max_train_samples=args.max_train_samples,
        dataset_config_name=args.dataset_config_name,
        cache_dir=args.cache_dir,
    )
    parts = PretrainedEDM2Parts()
    if args.pretrained_model_name_or_path and args.recipe == "edm2":
        parts = load_pretrained(
            lambda: load_pretrained_edm2_parts(
                args.pretrained_model_name_or_path, revision=args.revision, variant=args.variant
            ),
            args,
        )
    codec = latent_codec(args, parts)
    channels = codec.vae.config.latent_channels if codec else infer_channels(dataset)
    classes = num_classes(dataset) if args.class_conditional else None
    recipe = build_recipe(args, parts, codec)
    set_seed(args.seed)  # identical initial weights on every process
    unet = build_model(args, channels, classes, args.resolution // codec.downsampling if codec else args.resolution)
    if run.resume_from is not None:
        run.resume_from.check_matches("unet", unet)
    return output_dir, run, dataset, recipe, unet, codec


def latent_codec(args: argparse.Namespace, parts: PretrainedEDM2Parts) -> LatentCodec | None:
    """The VAE to train on (``--vae``, else a pretrained EDM2 pipeline's) with its normalisation; None for pixels."""
    if args.vae is None and parts.vae is None:
        if args.vae_pixel_range is not None:
            raise ValueError("--vae_pixel_range needs a VAE (--vae, or a pretrained EDM2 pipeline with one)")
        return None
    if args.recipe != "edm2":
        raise ValueError("--vae (latent training) needs --recipe edm2: EDM2Pipeline decodes the latents")
    try:
        vae = AutoencoderKL.from_pretrained(args.vae) if args.vae is not None else parts.vae
    except (OSError, ValueError) as error:
        raise ValueError(f"--vae {args.vae!r} could not be loaded as an AutoencoderKL: {error}") from error
    codec = LatentCodec(vae, args.vae_pixel_range or parts.vae_pixel_range or "[-1, 1]")
    if args.resolution % codec.downsampling:
        raise ValueError(f"--resolution {args.resolution} must be a multiple of the VAE's {codec.downsampling}x scale")
    if args.cache_latents and (args.random_flip or not args.center_crop):
        raise ValueError(
            "--cache_latents encodes each image once: it needs --center_crop and no --random_flip "
            "(or pass --no-cache_latents to encode every batch)"
        )
    return codec


def train(args: argparse.Namespace) -> Path:
    output_dir, run, dataset, recipe, unet, codec = prepare_run(args)
    channels = codec.vae.config.in_channels if codec else infer_channels(dataset)
    transform = ImageTransform(
        args.resolution, center_crop=args.center_crop, random_flip=args.random_flip, channels=channels
    )
    images = TrainingImages(dataset, transform, with_labels=args.class_conditional, seed=args.seed)
    if codec is None:
        data, model_input = images, lambda batch: batch["pixel_values"]
    elif args.cache_latents:
        key = dict(dataset=dataset._fingerprint, rows=len(dataset), resolution=args.resolution, channels=channels)
        cache = cache_latent_moments(images, codec, args.latent_cache_dir or output_dir / "latents", key)
        data, model_input = CachedLatents(cache, args.class_conditional), lambda b: codec.sample(b["latent_moments"])
    else:
        data, model_input = images, lambda batch: codec.sample(codec.moments(batch["pixel_values"]))
    job = TrainingJob(
        module=recipe.wrap(unet),
        unet=unet,
        dataset=data,
        loss=lambda module, batch: recipe.loss(module, model_input(batch), batch.get("class_labels")),
        make_lr_scheduler=lambda optimizer, max_steps: build_lr_scheduler(args, optimizer, max_steps),
        make_pipeline=recipe.pipeline,
        sample=grid_sampler(recipe, class_names(dataset, num_classes(dataset)) if args.class_conditional else None),
        frozen=[codec.vae] if codec else [],
        zero_nonfinite_grads=args.recipe == "edm2",
        tracker_name="train_unconditional",
        description=f"recipe {args.recipe}",
    )
    return run_training(args, job, output_dir, run)


def main(argv: list[str] | None = None) -> int:
    return run_script_main(build_parser(), train, argv)


if __name__ == "__main__":
    sys.exit(main())
