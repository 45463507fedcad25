"""Building blocks of the training scripts in the repository's ``training/`` folder.

- ``options``: command-line options shared by the scripts and their validation;
- ``training_images``: the training dataset, checked and wrapped for a DataLoader;
- ``model_builders``: the networks trained from scratch (``MODEL_TYPES``);
- ``recipes``: the DDPM and EDM2 losses, pipelines and grid samplers;
- ``training_ema``: the EMAs of a run (post-hoc EMA snapshots, diffusers' classic EMA);
- ``rng``: random streams that survive a resume exactly;
- ``checkpoint``: :class:`Checkpoint`, the resumable ``checkpoint-<step>`` folder and its layout;
- ``frozen``: the frozen modules (VAE, text encoder) in the mixed-precision dtype;
- ``image_grid``: PNG sample grids and their tracker logging; ``output``: the output folder, the final pipeline, the Hub upload;
- ``loop``: the Accelerate training loop (:func:`run_training`);
- ``latents``: latent training data (EDM2's latent normalisation, the cached VAE moments);
- ``pretrained_edm2``: the uncertainty head, ``sigma_data`` and VAE a pretrained EDM2 pipeline brings to fine-tuning.
"""

from ..scalelong.upgrade import load_model_config, load_pretrained_unet
from .checkpoint import Checkpoint, checkpoint_step
from .frozen import FrozenModules, weight_dtype
from .image_grid import SampleGrid, make_image_grid, save_image_atomic, save_image_grid
from .latents import VAE_PIXEL_RANGES, CachedLatents, LatentCodec, cache_latent_moments
from .loop import TrainingDiverged, TrainingJob, run_script_main, run_training
from .model_builders import MODEL_TYPES, build_edm2, build_from_config, build_unet2d, build_uvit
from .options import (
    add_ddpm_loss_args,
    add_lsc_args,
    add_pretrained_source_args,
    add_training_args,
    positive_float,
    positive_int,
    validate_training_args,
)
from .output import ensure_writable_dir, push_run_to_hub, save_pipeline_atomic
from .pretrained_edm2 import PretrainedEDM2Parts, load_pretrained_edm2_parts
from .recipes import RECIPES, DDPMRecipe, EDM2Recipe, images_from_numpy, make_noise_scheduler
from .rng import TrainingRNG, item_generator
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
    "MODEL_TYPES",
    "RECIPES",
    "SampleGrid",
    "DDPMRecipe",
    "EDM2Recipe",
    "FrozenModules",
    "LatentCodec",
    "PretrainedEDM2Parts",
    "TrainingDiverged",
    "TrainingEMA",
    "TrainingImages",
    "TrainingJob",
    "TrainingRNG",
    "add_ddpm_loss_args",
    "add_lsc_args",
    "add_pretrained_source_args",
    "add_training_args",
    "build_edm2",
    "build_from_config",
    "build_unet2d",
    "build_uvit",
    "cache_latent_moments",
    "checkpoint_step",
    "count_parameters",
    "ensure_writable_dir",
    "images_from_numpy",
    "infer_channels",
    "item_generator",
    "load_captioned_dataset",
    "load_model_config",
    "load_pretrained_edm2_parts",
    "load_pretrained_unet",
    "load_training_dataset",
    "make_image_grid",
    "make_noise_scheduler",
    "num_classes",
    "positive_float",
    "positive_int",
    "push_run_to_hub",
    "run_script_main",
    "run_training",
    "save_image_atomic",
    "save_image_grid",
    "save_pipeline_atomic",
    "validate_training_args",
    "weight_dtype",
]
