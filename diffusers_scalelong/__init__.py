"""diffusers-scalelong: stable, efficient diffusion training for Hugging Face diffusers.

Importing the package imports its submodules, so that ``DiffusionPipeline.from_pretrained``
finds the classes that ``model_index.json`` names by module path.
"""

__version__ = "0.1.0"

from . import edm2, ema, layers, models, pipelines, scalelong, schedulers  # noqa: E402,F401
