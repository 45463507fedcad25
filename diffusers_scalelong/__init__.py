"""diffusers-scalelong: stable, efficient diffusion training for Hugging Face diffusers.

Map (details in the repository's ARCHITECTURE.md):

- ``scalelong/``: ScaleLong long-skip scaling: coefficients, LS gates, ``LongSkipScaling``, the long-skip protocol,
  conv-UNet hooks, loading/upgrading UNets, stability diagnostics;
- ``layers/``: EDM2's magnitude-preserving layers; ``edm2/``: preconditioning, learned uncertainty, loss, lr
  schedule, presets;
- ``models/``: ScaleLong UNets, the U-ViT, the EDM2 UNet; ``schedulers/`` and ``pipelines/``: sampling;
- ``ema/``: post-hoc EMA (tracking, snapshots, reconstruction, Hub transfer, CLI); ``hub/``: model cards and the
  Hub-native pipeline layout; ``convert/``: official weights;
- ``trainer/``: building blocks of the training scripts; ``data``, ``metrics/``, ``atomic``, ``integrity``: shared
  utilities.

Importing the package imports its submodules, so that ``DiffusionPipeline.from_pretrained``
finds the classes that ``model_index.json`` names by module path.
"""

from . import edm2, ema, hub, layers, models, pipelines, scalelong, schedulers  # noqa: E402
from ._version import __version__  # noqa: F401  (the package version)
from .edm2 import EDM2Loss, EDMPreconditioner, LearnedUncertainty, inverse_sqrt_lr_lambda  # noqa: E402
from .ema import PowerFunctionEMA, list_snapshots, reconstruct_ema  # noqa: E402
from .models import EDM2UNet2DModel, ScaleLongUNet2DConditionModel, ScaleLongUNet2DModel, UViT2DModel  # noqa: E402
from .pipelines import EDM2Pipeline  # noqa: E402
from .scalelong import apply_lsc, remove_lsc  # noqa: E402
from .schedulers import EDMHeunScheduler  # noqa: E402

__all__ = [
    "EDM2Loss",
    "EDM2Pipeline",
    "EDM2UNet2DModel",
    "EDMHeunScheduler",
    "EDMPreconditioner",
    "LearnedUncertainty",
    "PowerFunctionEMA",
    "ScaleLongUNet2DConditionModel",
    "ScaleLongUNet2DModel",
    "UViT2DModel",
    "apply_lsc",
    "edm2",
    "ema",
    "hub",
    "inverse_sqrt_lr_lambda",
    "layers",
    "list_snapshots",
    "models",
    "pipelines",
    "reconstruct_ema",
    "remove_lsc",
    "scalelong",
    "schedulers",
]
