#!/usr/bin/env python
"""Train or fine-tune an unconditional (or class-conditional) diffusion UNet with Accelerate.

Models: diffusers' ``UNet2DModel``, ``ScaleLongUNet2DModel``, the U-ViT, the EDM2 UNet, or a pretrained UNet
(``--pretrained_model_name_or_path``) with ScaleLong long-skip scaling added. Recipes: ``ddpm`` (epsilon/v prediction
with a diffusers noise scheduler) or ``edm2`` (log-normal sigma, EDM preconditioning, learned uncertainty, Adam
(0.9, 0.99), inverse-square-root lr). Post-hoc EMA snapshots (``--ema_sigma_rels --snapshot_every``), exact resume
(``--resume_from_checkpoint latest``) and several processes (``accelerate launch --num_processes N``).

Example (the embedded Fashion-MNIST, EDM2 recipe with ScaleLong and post-hoc EMA)::

    python training/train_unconditional.py --output_dir out --model edm2 --recipe edm2 --lsc cs --kappa 0.7 \
        --ema_sigma_rels 0.05 0.10 --snapshot_every 500 --max_train_steps 2000
"""

import argparse
import logging
import math
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, broadcast, set_seed
from tqdm.auto import tqdm

from diffusers_scalelong.data import ImageTransform
from diffusers_scalelong.training_utils import (
    MODEL_TYPES,
    RECIPES,
    DDPMRecipe,
    EDM2Recipe,
    TrainingEMA,
    TrainingImages,
    TrainingRNG,
    add_lsc_args,
    add_training_args,
    build_edm2,
    build_unet2d,
    build_uvit,
    check_checkpoint_matches,
    count_parameters,
    ensure_writable_dir,
    infer_channels,
    list_checkpoints,
    load_components,
    load_pretrained_unet,
    load_training_dataset,
    make_noise_scheduler,
    num_classes,
    positive_int,
    push_folder_to_hub,
    resolve_resume_checkpoint,
    save_checkpoint,
    save_components,
    save_image_grid,
    save_pipeline_atomic,
    validate_training_args,
)

logger = get_logger("train_unconditional")

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
    ),
}


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite."""


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
        help="edm2: the paper's preset widths",
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
    recipe.add_argument("--P_mean", type=float, default=-0.8, help="edm2: mean of ln(sigma) during training")
    recipe.add_argument("--P_std", type=float, default=1.6, help="edm2: standard deviation of ln(sigma)")
    recipe.add_argument(
        "--lr_ref_steps", type=positive_int, default=35_000, help="edm2: steps after which the lr decays as 1/sqrt(t)"
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
    add_training_args(parser, default_batch_size=32)
    return parser


def validate_args(args: argparse.Namespace) -> None:
    """Everything that can be checked from the options alone; raises ``ValueError`` naming the option."""
    validate_training_args(args)
    for key, value in RECIPE_DEFAULTS[args.recipe].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.dataset_name and args.train_data_dir:
        raise ValueError("pass either --dataset_name or --train_data_dir, not both")
    if args.model == "unet2d" and args.lsc != "none" and not args.pretrained_model_name_or_path:
        raise ValueError("--model unet2d is diffusers' vanilla UNet; use --model scalelong_unet2d with --lsc")
    if args.class_conditional and args.recipe == "ddpm":
        raise ValueError("--class_conditional needs --recipe edm2 (DDPMPipeline samples unconditionally)")
    if args.recipe == "edm2" and args.prediction_type != "epsilon":
        raise ValueError("--prediction_type applies to --recipe ddpm only")
    if args.P_std <= 0:
        raise ValueError(f"--P_std must be positive, got {args.P_std}")
    if args.dropout is not None and not 0 <= args.dropout < 1:
        raise ValueError(f"--dropout must lie in [0, 1), got {args.dropout}")
    if args.max_grad_norm < 0:
        raise ValueError("--max_grad_norm must be >= 0 (0 disables clipping)")


def build_model(args: argparse.Namespace, channels: int, classes: int | None) -> torch.nn.Module:
    """The UNet to train (from scratch or pretrained), before any wrapping by the recipe."""
    if args.pretrained_model_name_or_path:
        return load_pretrained_unet(args.pretrained_model_name_or_path, args.lsc, args.kappa)
    if args.model in ("unet2d", "scalelong_unet2d"):
        return build_unet2d(
            scalelong=args.model == "scalelong_unet2d",
            resolution=args.resolution,
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
            resolution=args.resolution,
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
        resolution=args.resolution,
        channels=channels,
        patch_size=args.uvit_patch_size,
        embed_dim=args.uvit_embed_dim,
        depth=args.uvit_depth,
        num_heads=args.uvit_num_heads,
        num_class_embeds=classes,
        lsc_method=args.lsc,
        lsc_kappa=args.kappa,
    )


def build_recipe(args: argparse.Namespace):
    if args.recipe == "edm2":
        return EDM2Recipe(P_mean=args.P_mean, P_std=args.P_std)
    scheduler = make_noise_scheduler(
        args.noise_scheduler, args.ddpm_num_steps, args.ddpm_beta_schedule, args.prediction_type
    )
    return DDPMRecipe(scheduler)


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
    resume_from = resolve_resume_checkpoint(args.resume_from_checkpoint, output_dir)
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
    )
    channels = infer_channels(dataset)
    classes = num_classes(dataset) if args.class_conditional else None
    recipe = build_recipe(args)
    set_seed(args.seed)  # identical initial weights on every process
    unet = build_model(args, channels, classes)
    if resume_from is not None:
        check_checkpoint_matches(resume_from, "unet", unet)
    return output_dir, resume_from, dataset, channels, recipe, unet


def train(args: argparse.Namespace) -> Path:
    output_dir, resume_from, dataset, channels, recipe, unet = prepare_run(args)

    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=None if args.report_to == "none" else args.report_to,
        project_config=ProjectConfiguration(
            project_dir=str(output_dir), logging_dir=str(output_dir / args.logging_dir)
        ),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        step_scheduler_with_optimizer=False,
    )
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    step_rng = TrainingRNG(args.seed + accelerator.process_index, accelerator.device)  # noise differs per process

    module = recipe.wrap(unet)
    module.train()
    transform = ImageTransform(
        args.resolution, center_crop=args.center_crop, random_flip=args.random_flip, channels=channels
    )
    loader = torch.utils.data.DataLoader(
        TrainingImages(dataset, transform, with_labels=args.class_conditional, seed=args.seed),
        batch_size=args.train_batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.dataloader_num_workers,
    )
    if len(loader) // accelerator.num_processes < args.gradient_accumulation_steps:
        raise ValueError(
            f"{len(dataset)} images give fewer than one optimiser step per epoch at --train_batch_size "
            f"{args.train_batch_size} x {accelerator.num_processes} processes x --gradient_accumulation_steps {args.gradient_accumulation_steps}"
        )
    optimizer = torch.optim.AdamW(
        module.parameters(),
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        weight_decay=args.adam_weight_decay,
        eps=args.adam_epsilon,
    )
    steps_per_epoch = math.ceil(len(loader) / accelerator.num_processes / args.gradient_accumulation_steps)
    max_steps = args.max_train_steps or args.num_epochs * steps_per_epoch
    num_epochs = math.ceil(max_steps / steps_per_epoch)
    lr_scheduler = build_lr_scheduler(args, optimizer, max_steps)
    module, optimizer, loader, lr_scheduler = accelerator.prepare(module, optimizer, loader, lr_scheduler)
    live = accelerator.unwrap_model(module)
    live_unet = live.unet if hasattr(live, "uncertainty") else live

    ema = TrainingEMA(
        live_unet,
        sigma_rels=tuple(args.ema_sigma_rels),
        snapshot_dir=output_dir / "ema_snapshots",
        snapshot_every=args.snapshot_every,
        use_classic=args.use_ema,
        classic_kwargs=dict(decay=args.ema_max_decay, inv_gamma=args.ema_inv_gamma, power=args.ema_power),
        enabled=accelerator.is_main_process,
    )

    def save_model_hook(models, weights, folder):
        step_rng.save(folder, accelerator.process_index)
        if accelerator.is_main_process:
            for model in models:
                save_components(accelerator.unwrap_model(model), folder)
            ema.save(folder)
        for _ in models:
            weights.pop()

    def load_model_hook(models, folder):
        step_rng.load(folder, accelerator.process_index)
        while models:
            load_components(accelerator.unwrap_model(models.pop()), folder)

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)

    global_step = 0
    if resume_from is not None:
        accelerator.print(f"Resuming from {resume_from}")
        accelerator.load_state(str(resume_from))
        ema.load(resume_from, live_unet)
        global_step = int(resume_from.name.split("-")[1])
    first_epoch = global_step // steps_per_epoch
    skip_batches = (global_step % steps_per_epoch) * args.gradient_accumulation_steps

    if accelerator.is_main_process and args.report_to != "none":
        accelerator.init_trackers("train_unconditional", config={k: str(v) for k, v in vars(args).items()})
    accelerator.print(
        f"{type(live_unet).__name__}: {count_parameters(live_unet) / 1e6:.2f}M parameters; {len(dataset)} images; "
        f"recipe {args.recipe}; {max_steps} steps of {args.train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps} images"
    )

    def sample_grid(step: int) -> None:
        export = ema.export_unet(live_unet)
        export.eval()
        images = recipe.sample(export, args.num_grid_images, args.seed, args.num_inference_steps)
        live_unet.train()
        save_image_grid(images, output_dir / "samples" / f"step-{step:07d}.png")

    progress = tqdm(total=max_steps, initial=global_step, disable=not accelerator.is_local_main_process, desc="steps")
    start = time.monotonic()
    stop = global_step >= max_steps
    micro_losses = []
    for epoch in range(first_epoch, num_epochs):
        if stop:
            break
        loader.set_epoch(epoch)
        batches = loader
        if epoch == first_epoch and skip_batches:
            batches = accelerator.skip_first_batches(loader, skip_batches)
            batches.set_epoch(epoch)  # the new loader would otherwise replay epoch 0's order
        for batch in batches:
            with accelerator.accumulate(module), step_rng.active():
                loss = recipe.loss(module, batch["pixel_values"], batch.get("class_labels"))
                mean_loss = accelerator.gather(loss.detach()[None]).mean()
                if not torch.isfinite(mean_loss):
                    raise TrainingDiverged(f"the loss is {mean_loss.item()} at step {global_step + 1}")
                micro_losses.append(mean_loss.item())
                accelerator.backward(loss)
                grad_norm = None
                if accelerator.sync_gradients:
                    if args.recipe == "edm2":
                        for parameter in module.parameters():
                            if parameter.grad is not None:
                                torch.nan_to_num_(parameter.grad, nan=0.0, posinf=0.0, neginf=0.0)
                    grad_norm = accelerator.clip_grad_norm_(module.parameters(), args.max_grad_norm or float("inf"))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if not accelerator.sync_gradients:
                continue

            lr = lr_scheduler.get_last_lr()[0]
            lr_scheduler.step()
            global_step += 1
            progress.update(1)
            ema.update(live_unet, global_step)
            logs = {"loss": sum(micro_losses) / len(micro_losses), "lr": lr, "grad_norm": float(grad_norm)}
            micro_losses.clear()
            progress.set_postfix(loss=f"{logs['loss']:.4f}")
            accelerator.log(logs, step=global_step)

            stop = global_step >= max_steps
            if args.max_train_time_minutes is not None:
                out_of_time = torch.tensor(float(time.monotonic() - start > 60 * args.max_train_time_minutes))
                if accelerator.num_processes > 1:
                    out_of_time = broadcast(out_of_time.to(accelerator.device))
                if out_of_time.item():
                    accelerator.print(f"--max_train_time_minutes reached after {global_step} steps")
                    stop = True
            if accelerator.is_main_process:
                ema.maybe_snapshot(global_step, final=stop)
                if args.save_images_steps and (global_step % args.save_images_steps == 0 or stop):
                    sample_grid(global_step)
            if global_step % args.checkpointing_steps == 0:
                path = save_checkpoint(accelerator, output_dir, global_step, args.checkpoints_total_limit)
                accelerator.print(f"saved {path}")
            if stop:
                break
    progress.close()

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        pipeline = recipe.pipeline(ema.export_unet(live_unet))
        save_pipeline_atomic(pipeline, output_dir)
        accelerator.print(f"pipeline saved to {output_dir}")
        if args.push_to_hub:
            url = push_folder_to_hub(output_dir, args.hub_model_id, private=args.hub_private_repo)
            accelerator.print(f"pushed to {url}")
    accelerator.end_training()
    return output_dir


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        train(args)
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    except TrainingDiverged as error:
        found = list_checkpoints(args.output_dir)
        last = found[-1] if found else None
        print(
            f"error: {error}; training stopped. "
            + (f"The last good checkpoint is {last}; " if last else "No checkpoint was written yet; ")
            + "lower --learning_rate and resume with --resume_from_checkpoint latest.",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
