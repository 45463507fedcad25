"""The configuration of a training run: every option of the training scripts, typed, built once and frozen.

:class:`TrainingConfig` holds the options every script shares (output, steps, optimiser, Accelerate, checkpoints,
EMA, Hub); a script subclasses it with its model, recipe and data options. Each field is also a command-line option
(:func:`~diffusers_scalelong.trainer.cli.option`). Values a recipe chooses (``learning_rate`` and the others whose
field default is ``None``) are filled by the subclass's ``derived_defaults`` while the configuration is built.

The configuration checks only how options combine (``__post_init__``); each value is checked by the object it
configures (the loss checks ``P_std``, the EMA tracker ``sigma_rels``, the model its widths), which the trainer builds
before anything is written.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
from dataclasses import dataclass

from ..scalelong.coefficients import LSC_METHODS
from .cli import option

OUTPUT = "output and steps"
OPTIMISER = "optimiser"
ACCELERATE = "Accelerate"
CHECKPOINTS = "checkpoints and samples"
EMA = "EMA"
HUB = "Hugging Face Hub"
MODEL = "model"


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = float(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def fraction(text: str) -> float:
    """argparse type: a number in [0, 1) (Adam's betas)."""
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1), got {text}")
    return value


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """The options every training script shares. Subclasses add their model, recipe and data options."""

    # ---------------------------------------------------------------------------------------- output and steps
    output_dir: str = option(
        help="folder for checkpoints, snapshots, samples, logs and the final pipeline", group=OUTPUT
    )
    overwrite_output_dir: bool = option(
        False,
        help="replace the checkpoints, post-hoc EMA snapshots and sample grids of an earlier run in output_dir (they "
        "are moved aside when training starts and deleted once the new run has written its first checkpoint; without "
        "this a fresh run refuses such a folder)",
        group=OUTPUT,
    )
    seed: int = option(0, help="seed of model init, data order and noise (per process: seed + rank)", group=OUTPUT)
    train_batch_size: int = option(16, help="images per device and micro-step", group=OUTPUT, type=positive_int)
    num_epochs: int = option(
        10,
        help="passes over the data (ignored with max_train_steps)",
        group=OUTPUT,
        aliases=("--num_train_epochs",),
        type=positive_int,
    )
    max_train_steps: int | None = option(None, help="optimiser steps to train for", group=OUTPUT, type=positive_int)
    max_train_time_minutes: float | None = option(
        None, help="stop early (saving everything) after this wall time", group=OUTPUT, type=positive_float
    )
    dataloader_num_workers: int = option(
        0, help="DataLoader worker processes (0: load in the main process)", group=OUTPUT, type=non_negative_int
    )
    local_rank: int = option(
        -1,
        help="accepted for launchers that pass it; each process's rank comes from the environment that accelerate "
        "launch / torchrun set",
        group=OUTPUT,
    )

    # ---------------------------------------------------------------------------------------- optimiser
    learning_rate: float | None = option(
        None, help="peak learning rate (default: the recipe's)", group=OPTIMISER, type=positive_float
    )
    lr_warmup_steps: int | None = option(
        None, help="linear warm-up steps (default: the recipe's)", group=OPTIMISER, type=non_negative_int
    )
    adam_beta1: float | None = option(None, help="Adam beta1 (default: the recipe's)", group=OPTIMISER, type=fraction)
    adam_beta2: float | None = option(None, help="Adam beta2 (default: the recipe's)", group=OPTIMISER, type=fraction)
    adam_weight_decay: float | None = option(
        None, help="AdamW weight decay (default: the recipe's)", group=OPTIMISER, type=non_negative_float
    )
    scale_lr: bool = option(
        False,
        help="multiply learning_rate by gradient_accumulation_steps x train_batch_size x processes (as diffusers' "
        "scripts)",
        group=OPTIMISER,
    )
    adam_epsilon: float = option(1e-8, help="Adam epsilon", group=OPTIMISER, type=positive_float)
    use_8bit_adam: bool = option(
        False, help="bitsandbytes' 8-bit AdamW (needs the bitsandbytes package)", group=OPTIMISER
    )
    max_grad_norm: float | None = option(
        None,
        help="gradient clipping norm, 0 = off (default: the recipe's)",
        group=OPTIMISER,
        type=non_negative_float,
    )

    # ---------------------------------------------------------------------------------------- Accelerate
    gradient_accumulation_steps: int = option(
        1, help="micro-steps per optimiser step", group=ACCELERATE, type=positive_int
    )
    mixed_precision: str | None = option(
        None,
        help="autocast precision of forward passes (default: what `accelerate launch --mixed_precision` or "
        "`accelerate config` set, else no)",
        group=ACCELERATE,
        choices=("no", "fp16", "bf16"),
    )
    distributed_type: str = option(
        "ddp",
        help="with several processes: 'ddp' keeps the whole model on every process (data parallel); 'fsdp' shards "
        "parameters, gradients and optimiser state over the processes (torch FSDP2: each repeated block is one "
        "unit; bf16 mixed precision keeps float32 shards). fsdp needs 2 or more processes (torchrun "
        "--nproc_per_node N, or accelerate launch --multi_gpu --num_processes N) and rules out compile, use_ema "
        "and use_8bit_adam; the ScaleLong diagnostics are off",
        group=ACCELERATE,
        choices=("ddp", "fsdp"),
    )
    compile: bool = option(
        False,
        help="torch.compile the trained denoiser through Accelerate's dynamo plugin; the first step's time (which "
        "includes the compilation) is reported apart from the steady step time",
        group=ACCELERATE,
        parameter="compile",
    )
    compile_mode: str = option(
        "default",
        help="torch.compile mode: 'default' compiles fastest and suits CPU training; 'reduce-overhead' adds CUDA "
        "graphs (GPU, small batches); 'max-autotune' searches kernels (long compilation, GPU)",
        group=ACCELERATE,
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    )
    compile_backend: str = option(
        "inductor",
        help="torch.compile backend: inductor generates fused kernels; eager / aot_eager only trace (for debugging)",
        group=ACCELERATE,
        choices=("inductor", "aot_eager", "eager"),
    )
    report_to: str = option(
        "tensorboard",
        help="where to log metrics (--logger is diffusers' unconditional script's name; tensorboard needs the "
        "tensorboard package, wandb the wandb package)",
        group=ACCELERATE,
        aliases=("--logger",),
        choices=("tensorboard", "wandb", "none"),
    )
    tracker_project_name: str | None = option(
        None, help="project (run) name of the metrics logger (default: the script's name)", group=ACCELERATE
    )
    gradient_checkpointing: bool = option(
        False,
        help="recompute activations in the backward pass (less memory, more time; same gradients)",
        group=ACCELERATE,
    )
    enable_xformers_memory_efficient_attention: bool = option(
        False,
        help="xformers attention in the trained model; without the xformers package (or for a model without "
        "attention processors) a message says so and torch's scaled_dot_product_attention is kept",
        group=ACCELERATE,
    )
    allow_tf32: bool = option(
        False, help="allow TF32 matmuls on Ampere+ GPUs (faster, ~10-bit mantissa)", group=ACCELERATE
    )
    logging_dir: str = option("logs", help="TensorBoard folder, relative to output_dir", group=ACCELERATE)
    diagnostics_every: int = option(
        50,
        help="log ScaleLong stability diagnostics (skip/block feature norms, gradient norms, LS gates) every N steps "
        "and plot them to stability.png; 0 = off (diffusers UNets, the U-ViT and the EDM2 UNet)",
        group=ACCELERATE,
        type=non_negative_int,
    )

    # ---------------------------------------------------------------------------------------- checkpoints, samples
    checkpointing_steps: int = option(
        500, help="save a resumable checkpoint every N steps", group=CHECKPOINTS, type=positive_int
    )
    checkpoints_total_limit: int | None = option(
        None, help="keep only the newest N checkpoints", group=CHECKPOINTS, type=positive_int
    )
    resume_from_checkpoint: str | None = option(
        None, help="'latest' or a checkpoint folder to resume from exactly", group=CHECKPOINTS
    )
    save_images_steps: int | None = option(
        None, help="write a PNG sample grid every N steps (and at the end)", group=CHECKPOINTS, type=positive_int
    )
    save_images_epochs: int | None = option(
        None,
        help="write a PNG sample grid at the end of every N-th epoch (and at the end)",
        group=CHECKPOINTS,
        aliases=("--validation_epochs",),
        type=positive_int,
    )
    save_model_epochs: int | None = option(
        None,
        help="also write the pipeline into output_dir at the end of every N-th epoch (it is always written at the "
        "end of the run)",
        group=CHECKPOINTS,
        type=positive_int,
    )
    eval_batch_size: int = option(
        16,
        help="images per sampler batch of a sample grid: the whole grid of an unconditional run, one row per class "
        "of a class-conditional run, one row per validation prompt",
        group=CHECKPOINTS,
        aliases=("--num_grid_images",),
        metavar="N",
        type=positive_int,
    )
    num_inference_steps: int | None = option(
        None,
        help="sampler steps for grids (default: the recipe's)",
        group=CHECKPOINTS,
        aliases=("--ddpm_num_inference_steps",),
        type=positive_int,
    )

    # ---------------------------------------------------------------------------------------- EMA
    ema_sigma_rels: tuple[float, ...] = option(
        (),
        help="post-hoc EMA profiles to track (EDM2), e.g. 0.05 0.10",
        group=EMA,
        type=float,
        parameter="sigma_rels",
    )
    snapshot_every: int | None = option(
        None, help="write post-hoc EMA snapshots every K steps (and at the end)", group=EMA, type=positive_int
    )
    use_ema: bool = option(
        False, help="also keep diffusers' classic EMAModel; the final pipeline then holds its weights", group=EMA
    )
    ema_max_decay: float = option(0.9999, help="classic EMA: maximum decay, in (0, 1)", group=EMA, type=fraction)
    ema_inv_gamma: float = option(1.0, help="classic EMA: warm-up inverse gamma", group=EMA, type=positive_float)
    ema_power: float = option(3 / 4, help="classic EMA: warm-up power", group=EMA, type=positive_float)
    offload_ema: bool = option(
        False, help="classic EMA: keep the average on the CPU between updates (less accelerator memory)", group=EMA
    )
    foreach_ema: bool = option(
        False,
        help="classic EMA: update with torch's multi-tensor (foreach) operations (faster, more memory)",
        group=EMA,
    )

    # ---------------------------------------------------------------------------------------- Hub
    push_to_hub: bool = option(False, help="upload the final pipeline (and EMA snapshots) to the Hub", group=HUB)
    hub_model_id: str | None = option(
        None,
        help="repository id 'namespace/name' for push_to_hub (default, as diffusers' scripts: your user name / the "
        "output_dir folder's name)",
        group=HUB,
    )
    hub_private_repo: bool = option(False, help="create the Hub repository as private", group=HUB)
    hub_token: str | None = option(
        None,
        help="Hub token for push_to_hub (default: HF_TOKEN or the login of `hf auth login`; prefer those: a token "
        "on the command line is visible to other users of the machine)",
        group=HUB,
    )

    # ---------------------------------------------------------------------------------------- checks
    def derived_defaults(self) -> dict:
        """Values for the options left ``None`` that the script derives from others (e.g. its recipe's)."""
        return {}

    def __post_init__(self) -> None:
        """The derived defaults, then how options combine; values are checked by the objects they configure."""
        for key, value in self.derived_defaults().items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)  # still being built: frozen once __init__ returns
        if self.snapshot_every is not None and not self.ema_sigma_rels:
            raise ValueError("snapshot_every needs ema_sigma_rels (the post-hoc EMA profiles to snapshot)")
        if self.hub_model_id is not None and self.hub_model_id.count("/") != 1:
            raise ValueError(f"hub_model_id must look like 'namespace/name', got {self.hub_model_id!r}")
        if self.overwrite_output_dir and self.resume_from_checkpoint is not None:
            raise ValueError("pass either resume_from_checkpoint or overwrite_output_dir, not both")
        if not 0 < self.ema_max_decay < 1:
            raise ValueError(f"ema_max_decay must lie in (0, 1), got {self.ema_max_decay}")
        if self.use_8bit_adam and importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError("use_8bit_adam needs the bitsandbytes package: pip install bitsandbytes")
        if self.report_to != "none" and importlib.util.find_spec(self.report_to) is None:
            raise ValueError(
                f"report_to {self.report_to} needs the {self.report_to} package: pip install {self.report_to} "
                "(or pass report_to none)"
            )
        if self.distributed_type == "fsdp":
            refused = [name for name in ("compile", "use_ema", "use_8bit_adam") if getattr(self, name)]
            refused += ["mixed_precision fp16"] if self.mixed_precision == "fp16" else []
            if refused:
                raise ValueError(
                    f"distributed_type fsdp does not support {', '.join(refused)} (use ema_sigma_rels for EMA and "
                    "mixed_precision bf16)"
                )

    @classmethod
    def from_command_line(cls, argv: list[str] | None = None):
        """The configuration of a command line (``sys.argv[1:]`` when None), defaults resolved and checked."""
        from .cli import build_parser, parse_config

        return parse_config(build_parser(cls, cls.__doc__ or ""), cls, argv)

    @property
    def wants_grids(self) -> bool:
        """Whether sample grids are written at all."""
        return self.save_images_steps is not None or self.save_images_epochs is not None


@dataclass(frozen=True, kw_only=True)
class PretrainedModelOptions:
    """Options of the scripts that load a pretrained model: which revision and weight files, and the ScaleLong
    long-skip scaling added to it (or to a network built from scratch)."""

    revision: str | None = option(
        None,
        help="branch, tag or commit of the pretrained Hub repo to load (passed to every from_pretrained)",
        group=MODEL,
        parameter="revision",
    )
    variant: str | None = option(
        None,
        help="which weight files of the pretrained model to load, e.g. fp16 for diffusion_pytorch_model.fp16.safetensors",
        group=MODEL,
        parameter="variant",
    )
    lsc: str = option(
        "none",
        help="long-skip-connection scaling method (ScaleLong)",
        group=MODEL,
        choices=LSC_METHODS,
        parameter="lsc_method",
    )
    kappa: float = option(
        0.5,
        help="kappa of cs / cs_stage: skip i is scaled by kappa^(i-1)",
        group=MODEL,
        type=positive_float,
        parameter="lsc_kappa",
    )


@dataclass(frozen=True, kw_only=True)
class DDPMLossOptions:
    """The loss options of diffusers' example scripts, for the DDPM recipe (``DDPMRecipe`` checks their values)."""

    snr_gamma: float | None = option(
        None,
        help="ddpm: Min-SNR loss weighting min(SNR, gamma) / SNR (v: / (SNR + 1)); 5.0 is the paper's choice",
        group="DDPM loss",
        type=positive_float,
    )
    noise_offset: float = option(
        0.0,
        help="ddpm: add noise_offset * N(0, 1) per image and channel to the noise (shifts its mean)",
        group="DDPM loss",
        type=non_negative_float,
    )
