"""Command-line options shared by the training scripts, and their validation (run before any long work)."""

import argparse
import importlib.util
import math
import os

from ..scalelong.coefficients import LSC_METHODS

SIGMA_REL_MAX = math.sqrt(1 / 12)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def sigma_rel(text: str) -> float:
    value = float(text)
    if not 0 < value < SIGMA_REL_MAX:
        raise argparse.ArgumentTypeError(f"sigma_rel must lie in (0, {SIGMA_REL_MAX:.4f}), got {text}")
    return value


def add_lsc_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("ScaleLong long-skip scaling")
    group.add_argument(
        "--lsc", choices=LSC_METHODS, default="none", help="long-skip-connection scaling method (ScaleLong)"
    )
    group.add_argument(
        "--kappa", type=positive_float, default=0.5, help="kappa of cs / cs_stage: skip i is scaled by kappa^(i-1)"
    )


def add_ddpm_loss_args(group) -> None:
    """``--snr_gamma`` and ``--noise_offset`` of the DDPM recipe (``DDPMRecipe``), as diffusers' example scripts."""
    group.add_argument(
        "--snr_gamma",
        type=positive_float,
        default=None,
        help="ddpm: Min-SNR loss weighting min(SNR, gamma) / SNR (v: / (SNR + 1)); 5.0 is the paper's choice",
    )
    group.add_argument(
        "--noise_offset",
        type=non_negative_float,
        default=0.0,
        help="ddpm: add noise_offset * N(0, 1) per image and channel to the noise (shifts its mean)",
    )


def add_pretrained_source_args(group) -> None:
    """``--revision`` and ``--variant`` of ``--pretrained_model_name_or_path``, as diffusers' example scripts."""
    group.add_argument(
        "--revision",
        default=None,
        help="branch, tag or commit of the pretrained Hub repo to load (passed to every from_pretrained)",
    )
    group.add_argument(
        "--variant",
        default=None,
        help="weight-file variant of the pretrained model, e.g. fp16 for diffusion_pytorch_model.fp16.safetensors",
    )


def add_training_args(parser: argparse.ArgumentParser, default_batch_size: int = 16) -> None:
    """Options common to all training scripts: output, steps, optimiser, Accelerate, checkpoints, EMA, Hub."""
    out = parser.add_argument_group("output and steps")
    out.add_argument(
        "--output_dir", required=True, help="folder for checkpoints, snapshots, samples, logs and the final pipeline"
    )
    out.add_argument(
        "--overwrite_output_dir",
        action="store_true",
        help="delete the checkpoints, post-hoc EMA snapshots and sample grids of an earlier run in --output_dir "
        "before training (without it a fresh run refuses such a folder)",
    )
    out.add_argument(
        "--seed", type=int, default=0, help="seed of model init, data order and noise (per process: seed + rank)"
    )
    out.add_argument(
        "--train_batch_size", type=positive_int, default=default_batch_size, help="images per device and micro-step"
    )
    out.add_argument(
        "--num_epochs", type=positive_int, default=10, help="passes over the data (ignored with --max_train_steps)"
    )
    out.add_argument("--max_train_steps", type=positive_int, default=None, help="optimiser steps to train for")
    out.add_argument(
        "--max_train_time_minutes",
        type=positive_float,
        default=None,
        help="stop early (saving everything) after this wall time",
    )
    out.add_argument(
        "--dataloader_num_workers",
        type=int,
        default=0,
        help="DataLoader worker processes (0: load in the main process)",
    )

    opt = parser.add_argument_group("optimiser")
    opt.add_argument(
        "--learning_rate", type=positive_float, default=None, help="peak learning rate (default: the recipe's)"
    )
    opt.add_argument("--lr_warmup_steps", type=int, default=None, help="linear warm-up steps (default: the recipe's)")
    opt.add_argument("--adam_beta1", type=float, default=None, help="Adam beta1 (default: the recipe's)")
    opt.add_argument("--adam_beta2", type=float, default=None, help="Adam beta2 (default: the recipe's)")
    opt.add_argument("--adam_weight_decay", type=float, default=None, help="AdamW weight decay (default: the recipe's)")
    opt.add_argument("--adam_epsilon", type=positive_float, default=1e-8, help="Adam epsilon")
    opt.add_argument(
        "--use_8bit_adam", action="store_true", help="bitsandbytes' 8-bit AdamW (needs the bitsandbytes package)"
    )
    opt.add_argument(
        "--max_grad_norm", type=float, default=None, help="gradient clipping norm, 0 = off (default: the recipe's)"
    )

    acc = parser.add_argument_group("Accelerate")
    acc.add_argument(
        "--gradient_accumulation_steps", type=positive_int, default=1, help="micro-steps per optimiser step"
    )
    acc.add_argument(
        "--mixed_precision", choices=("no", "fp16", "bf16"), default="no", help="autocast precision of forward passes"
    )
    acc.add_argument(
        "--distributed_type",
        choices=("ddp", "fsdp"),
        default="ddp",
        help="with several processes: 'ddp' keeps the whole model on every process (data parallel); 'fsdp' shards "
        "parameters, gradients and optimiser state over the processes (torch FSDP2: each repeated block is one "
        "unit; bf16 mixed precision keeps float32 shards). fsdp needs 2 or more processes (torchrun "
        "--nproc_per_node N, or accelerate launch --multi_gpu --num_processes N) and rules out --compile, --use_ema "
        "and --use_8bit_adam; the ScaleLong diagnostics are off",
    )
    acc.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the trained denoiser through Accelerate's dynamo plugin; the first step's time (which "
        "includes the compilation) is reported apart from the steady step time",
    )
    acc.add_argument(
        "--compile_mode",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
        default="default",
        help="torch.compile mode: 'default' compiles fastest and suits CPU training; 'reduce-overhead' adds CUDA "
        "graphs (GPU, small batches); 'max-autotune' searches kernels (long compilation, GPU)",
    )
    acc.add_argument(
        "--compile_backend",
        choices=("inductor", "aot_eager", "eager"),
        default="inductor",
        help="torch.compile backend: inductor generates fused kernels; eager / aot_eager only trace (for debugging)",
    )
    acc.add_argument(
        "--report_to",
        "--logger",
        dest="report_to",
        choices=("tensorboard", "wandb", "none"),
        default="tensorboard",
        help="where to log metrics (--logger is diffusers' unconditional script's name; wandb needs the wandb package)",
    )
    acc.add_argument(
        "--gradient_checkpointing",
        action="store_true",
        help="recompute activations in the backward pass (less memory, more time; same gradients)",
    )
    acc.add_argument(
        "--enable_xformers_memory_efficient_attention",
        action="store_true",
        help="xformers attention in the trained model; without the xformers package (or for a model without "
        "attention processors) a message says so and torch's scaled_dot_product_attention is kept",
    )
    acc.add_argument(
        "--allow_tf32", action="store_true", help="allow TF32 matmuls on Ampere+ GPUs (faster, ~10-bit mantissa)"
    )
    acc.add_argument("--logging_dir", default="logs", help="TensorBoard folder, relative to --output_dir")
    acc.add_argument(
        "--diagnostics_every",
        type=int,
        default=50,
        help="log ScaleLong stability diagnostics (skip/block feature norms, gradient norms, LS gates) every N steps "
        "and plot them to stability.png; 0 = off (diffusers UNets, the U-ViT and the EDM2 UNet)",
    )

    ckpt = parser.add_argument_group("checkpoints and samples")
    ckpt.add_argument(
        "--checkpointing_steps", type=positive_int, default=500, help="save a resumable checkpoint every N steps"
    )
    ckpt.add_argument(
        "--checkpoints_total_limit", type=positive_int, default=None, help="keep only the newest N checkpoints"
    )
    ckpt.add_argument(
        "--resume_from_checkpoint", default=None, help="'latest' or a checkpoint folder to resume from exactly"
    )
    ckpt.add_argument(
        "--save_images_steps",
        type=positive_int,
        default=None,
        help="write a PNG sample grid every N steps (and at the end)",
    )
    ckpt.add_argument(
        "--save_images_epochs",
        type=positive_int,
        default=None,
        help="write a PNG sample grid at the end of every N-th epoch (and at the end)",
    )
    ckpt.add_argument(
        "--eval_batch_size",
        "--num_grid_images",
        dest="num_grid_images",
        metavar="N",
        type=positive_int,
        default=16,
        help="images per sampler batch of a sample grid (diffusers' --eval_batch_size): the whole grid of an "
        "unconditional run, one row per class of a class-conditional run, one row per validation prompt",
    )
    ckpt.add_argument(
        "--num_inference_steps", type=positive_int, default=None, help="sampler steps for grids (default: the recipe's)"
    )

    ema = parser.add_argument_group("EMA")
    ema.add_argument(
        "--ema_sigma_rels",
        type=sigma_rel,
        nargs="*",
        default=[],
        help="post-hoc EMA profiles to track (EDM2), e.g. 0.05 0.10",
    )
    ema.add_argument(
        "--snapshot_every",
        type=positive_int,
        default=None,
        help="write post-hoc EMA snapshots every K steps (and at the end)",
    )
    ema.add_argument(
        "--use_ema",
        action="store_true",
        help="also keep diffusers' classic EMAModel; the final pipeline then holds its weights",
    )
    ema.add_argument("--ema_max_decay", type=float, default=0.9999, help="classic EMA: maximum decay")
    ema.add_argument("--ema_inv_gamma", type=positive_float, default=1.0, help="classic EMA: warm-up inverse gamma")
    ema.add_argument("--ema_power", type=positive_float, default=3 / 4, help="classic EMA: warm-up power")

    hub = parser.add_argument_group("Hugging Face Hub")
    hub.add_argument(
        "--push_to_hub", action="store_true", help="upload the final pipeline (and EMA snapshots) to the Hub"
    )
    hub.add_argument("--hub_model_id", default=None, help="repository id 'namespace/name' for --push_to_hub")
    hub.add_argument("--hub_private_repo", action="store_true", help="create the Hub repository as private")


def validate_training_args(args: argparse.Namespace) -> None:
    """Cross-option checks; raise ``ValueError`` naming the options."""
    if args.snapshot_every is not None and not args.ema_sigma_rels:
        raise ValueError("--snapshot_every needs --ema_sigma_rels (the post-hoc EMA profiles to snapshot)")
    if len(set(args.ema_sigma_rels)) != len(args.ema_sigma_rels):
        raise ValueError(f"--ema_sigma_rels must be distinct, got {args.ema_sigma_rels}")
    if args.push_to_hub and not args.hub_model_id:
        raise ValueError("--push_to_hub needs --hub_model_id (e.g. my-name/my-model)")
    if args.hub_model_id is not None and args.hub_model_id.count("/") != 1:
        raise ValueError(f"--hub_model_id must look like 'namespace/name', got {args.hub_model_id!r}")
    if not 0 < args.ema_max_decay < 1:
        raise ValueError(f"--ema_max_decay must lie in (0, 1), got {args.ema_max_decay}")
    if args.diagnostics_every < 0:
        raise ValueError("--diagnostics_every must be >= 0 (0 turns the diagnostics off)")
    if args.dataloader_num_workers < 0:
        raise ValueError("--dataloader_num_workers must be >= 0")
    if args.lr_warmup_steps is not None and args.lr_warmup_steps < 0:
        raise ValueError("--lr_warmup_steps must be >= 0")
    for name in ("adam_beta1", "adam_beta2"):
        value = getattr(args, name)
        if value is not None and not 0 <= value < 1:
            raise ValueError(f"--{name} must lie in [0, 1), got {value}")
    if args.use_8bit_adam and importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError("--use_8bit_adam needs the bitsandbytes package: pip install bitsandbytes")
    if args.report_to == "wandb" and importlib.util.find_spec("wandb") is None:
        raise ValueError(
            "--report_to wandb needs the wandb package: pip install wandb (or use --report_to tensorboard)"
        )
    if args.distributed_type == "fsdp":
        refused = [flag for flag in ("compile", "use_ema", "use_8bit_adam") if getattr(args, flag, False)]
        if args.mixed_precision == "fp16":
            refused.append("mixed_precision fp16")
        if refused:
            raise ValueError(
                "--distributed_type fsdp does not support "
                + ", ".join(f"--{flag}" for flag in refused)
                + " (use --ema_sigma_rels for EMA and --mixed_precision bf16)"
            )
        if int(os.environ.get("WORLD_SIZE", "1")) < 2:  # set by torchrun and accelerate launch
            from .sharding import NEEDS_PROCESSES

            raise ValueError(NEEDS_PROCESSES)
    if args.mixed_precision == "fp16":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--mixed_precision fp16 needs a CUDA GPU; use bf16 or no on CPU")
