"""Where and how a run computes: the Accelerator, compute options of the trained model, the optimiser class, and the
ScaleLong diagnostics."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, TorchDynamoPlugin

from .config import TrainingConfig

logger = logging.getLogger(__name__)


def make_accelerator(config: TrainingConfig, output_dir: Path) -> Accelerator:
    """The run's Accelerator. Without any GPU-like device it is told so (``cpu=True``): only then does Accelerate
    join the processes of ``accelerate launch --multi_gpu --num_processes N`` (or ``torchrun``) over gloo on CPU.
    ``mixed_precision`` None leaves the precision to ``accelerate launch`` / ``accelerate config``."""
    accelerator = Accelerator(
        cpu=not torch.accelerator.is_available(),
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        mixed_precision=config.mixed_precision,
        log_with=None if config.report_to == "none" else config.report_to,
        project_config=ProjectConfiguration(
            project_dir=str(output_dir), logging_dir=str(output_dir / config.logging_dir)
        ),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed),
        step_scheduler_with_optimizer=False,
        dynamo_plugin=(
            TorchDynamoPlugin(backend=config.compile_backend, mode=config.compile_mode) if config.compile else None
        ),
    )
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise ValueError(
            "mixed_precision fp16 needs a GPU (float16 training needs loss scaling); use bf16 or no on CPU"
        )
    return accelerator


def apply_compute_options(config: TrainingConfig, unet: torch.nn.Module) -> None:
    """``allow_tf32`` (torch's CUDA matmul and cuDNN flags), ``gradient_checkpointing`` (diffusers'
    ``enable_gradient_checkpointing``; a model without it is refused by name) and
    ``enable_xformers_memory_efficient_attention`` (a message where it cannot apply)."""
    if config.allow_tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if config.gradient_checkpointing:
        if not getattr(unet, "_supports_gradient_checkpointing", False):
            raise ValueError(f"gradient_checkpointing: {type(unet).__name__} does not support it")
        unet.enable_gradient_checkpointing()
    if config.enable_xformers_memory_efficient_attention:
        if importlib.util.find_spec("xformers") is None:
            logger.warning(
                "enable_xformers_memory_efficient_attention: xformers is not installed; attention keeps torch's "
                "scaled_dot_product_attention"
            )
        elif not hasattr(unet, "set_attn_processor"):
            logger.warning(
                f"enable_xformers_memory_efficient_attention: {type(unet).__name__} has no attention processors; "
                "its attention is unchanged"
            )
        else:
            unet.enable_xformers_memory_efficient_attention()


def adamw_class(config: TrainingConfig) -> type[torch.optim.Optimizer]:
    """``torch.optim.AdamW``, or bitsandbytes' ``AdamW8bit`` with ``use_8bit_adam`` (its presence is checked by
    the configuration)."""
    if not config.use_8bit_adam:
        return torch.optim.AdamW
    import bitsandbytes

    return bitsandbytes.optim.AdamW8bit


def make_diagnostics(unet: torch.nn.Module, every_n_steps: int):
    """ScaleLong's stability diagnostics on ``unet`` every ``every_n_steps`` steps, or None (off / not supported)."""
    if not every_n_steps:
        return None
    from ..scalelong.diagnostics import StabilityDiagnostics

    try:
        return StabilityDiagnostics(unet, every_n_steps=every_n_steps)
    except ValueError as error:  # a model family the diagnostics do not know
        logger.warning(f"ScaleLong diagnostics are off: {error}")
        return None
