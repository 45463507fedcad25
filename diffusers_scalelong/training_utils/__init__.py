"""Building blocks of the training scripts in ``training/``: options, data, models, recipes, EMA, checkpoints."""

from .checkpoints import (
    check_checkpoint_matches,
    list_checkpoints,
    load_components,
    resolve_resume_checkpoint,
    rotate_checkpoints,
    save_checkpoint,
    save_components,
)
from .cli import add_lsc_args, add_training_args, positive_float, positive_int, validate_training_args
from .data import (
    CaptionedImages,
    TrainingImages,
    infer_channels,
    load_captioned_dataset,
    load_training_dataset,
    num_classes,
)
from .ema import TrainingEMA, count_parameters
from .export import push_run_to_hub, save_pipeline_atomic
from .images import make_image_grid, save_image_grid
from .io import ensure_writable_dir, save_image_atomic
from .loop import TrainingDiverged, TrainingJob, run_script_main, run_training
from .models import MODEL_TYPES, build_edm2, build_unet2d, build_uvit, load_model_config, load_pretrained_unet
from .recipes import RECIPES, DDPMRecipe, EDM2Recipe, images_from_numpy, make_noise_scheduler
from .rng import TrainingRNG, item_generator

__all__ = [
    "CaptionedImages",
    "MODEL_TYPES",
    "RECIPES",
    "DDPMRecipe",
    "EDM2Recipe",
    "TrainingDiverged",
    "TrainingEMA",
    "TrainingImages",
    "TrainingJob",
    "TrainingRNG",
    "add_lsc_args",
    "add_training_args",
    "build_edm2",
    "build_unet2d",
    "build_uvit",
    "check_checkpoint_matches",
    "count_parameters",
    "ensure_writable_dir",
    "images_from_numpy",
    "infer_channels",
    "item_generator",
    "list_checkpoints",
    "load_components",
    "load_captioned_dataset",
    "load_model_config",
    "load_pretrained_unet",
    "load_training_dataset",
    "make_image_grid",
    "make_noise_scheduler",
    "num_classes",
    "positive_float",
    "positive_int",
    "push_run_to_hub",
    "resolve_resume_checkpoint",
    "rotate_checkpoints",
    "run_script_main",
    "run_training",
    "save_checkpoint",
    "save_components",
    "save_image_atomic",
    "save_image_grid",
    "save_pipeline_atomic",
    "validate_training_args",
]
