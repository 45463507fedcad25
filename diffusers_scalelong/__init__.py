"""diffusers-scalelong: stable, efficient diffusion training for Hugging Face diffusers.

Importing the package registers its models, schedulers and pipelines so that
``DiffusionPipeline.from_pretrained`` can resolve the classes that
``model_index.json`` names by module path.
"""

__version__ = "0.1.0"
