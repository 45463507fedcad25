"""The training library behind the scripts of the repository's ``training/`` folder (shipped as
``diffusers_scalelong.training_scripts``).

- ``config``: :class:`TrainingConfig`, the typed, frozen options every script shares; ``cli``: options as dataclass
  fields, the parser made from them, parameter names written as flags, the scripts' ``main``;
- ``trainer``: :class:`Trainer`, the Accelerate training loop in named phases, and :class:`TrainingJob`;
- ``compute``: the Accelerator, compute options of the trained model, the optimiser class;
- ``recipes``: the DDPM and EDM2 recipes (loss, lr schedule, pipeline, grid sampler);
- ``training_images``: the training dataset, checked and wrapped for a DataLoader;
- ``model_builders``: the networks trained from scratch (``MODEL_TYPES``) or from a config;
- ``latents``: latent training data (EDM2's latent normalisation, the cached VAE moments);
- ``pretrained_edm2``: the uncertainty head, ``sigma_data`` and VAE a pretrained EDM2 pipeline brings to fine-tuning;
- ``training_ema``: the EMAs of a run (post-hoc EMA snapshots, diffusers' classic EMA);
- ``rng``: random streams that survive a resume exactly;
- ``checkpoint``: :class:`Checkpoint`, the resumable ``checkpoint-<step>`` folder and its layout;
- ``run_identity``: which run an output folder belongs to, and who may write into it;
- ``frozen``: the frozen modules (VAE, text encoder) in the mixed-precision dtype;
- ``sharding``: FSDP2 sharding, clipping and gathering;
- ``image_grid``: PNG sample grids and their tracker logging; ``output``: the output folder, the final pipeline, the
  Hub upload.
"""

from ..models.pretrained import load_model_config, load_pretrained_unet
from .checkpoint import Checkpoint, checkpoint_step
from .cli import build_parser, flag_message, option, parse_config, run_and_exit, script_main
from .config import DDPMLossOptions, PretrainedModelOptions, TrainingConfig
from .frozen import FrozenModules, weight_dtype
from .image_grid import SampleGrid, make_image_grid, save_image_atomic, save_image_grid
from .latents import VAE_PIXEL_RANGES, CachedLatents, LatentCodec, cache_latent_moments
from .model_builders import (
    MODEL_TYPES,
    build_edm2,
    build_from_config,
    build_unet2d,
    build_uvit,
    load_pretrained,
)
from .output import ensure_writable_dir, push_run_to_hub, save_pipeline_atomic
from .pretrained_edm2 import PretrainedEDM2Parts, load_pretrained_edm2_parts
from .recipes import RECIPES, DDPMRecipe, EDM2Recipe, Recipe, images_from_numpy, make_noise_scheduler, sample_rows
from .rng import TrainingRNG, item_generator
from .trainer import Trainer, TrainingDiverged, TrainingJob
from .training_ema import TrainingEMA, count_parameters
from .training_images import (
    CaptionedImages,
    TrainingImages,
    infer_channels,
    load_captioned_dataset,
    load_training_dataset,
    num_classes,
)

__all__ = [
    "VAE_PIXEL_RANGES",
    "CachedLatents",
    "CaptionedImages",
    "Checkpoint",
    "DDPMLossOptions",
    "DDPMRecipe",
    "EDM2Recipe",
    "FrozenModules",
    "LatentCodec",
    "MODEL_TYPES",
    "PretrainedEDM2Parts",
    "PretrainedModelOptions",
    "RECIPES",
    "Recipe",
    "SampleGrid",
    "Trainer",
    "TrainingConfig",
    "TrainingDiverged",
    "TrainingEMA",
    "TrainingImages",
    "TrainingJob",
    "TrainingRNG",
    "build_edm2",
    "build_from_config",
    "build_parser",
    "build_unet2d",
    "build_uvit",
    "cache_latent_moments",
    "checkpoint_step",
    "count_parameters",
    "ensure_writable_dir",
    "flag_message",
    "images_from_numpy",
    "infer_channels",
    "item_generator",
    "load_captioned_dataset",
    "load_model_config",
    "load_pretrained",
    "load_pretrained_edm2_parts",
    "load_pretrained_unet",
    "load_training_dataset",
    "make_image_grid",
    "make_noise_scheduler",
    "num_classes",
    "option",
    "parse_config",
    "push_run_to_hub",
    "run_and_exit",
    "sample_rows",
    "save_image_atomic",
    "save_image_grid",
    "save_pipeline_atomic",
    "script_main",
    "weight_dtype",
]
