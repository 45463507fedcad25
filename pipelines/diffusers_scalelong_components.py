"""Component file for diffusers-scalelong models and schedulers in a Hub repo.

A copy sits in each component folder (``unet/``, ``scheduler/``, ...) whose ``model_index.json`` entry is
``["diffusers_scalelong_components", "<Class>"]``; diffusers imports it to find the class when loading by repo id
with ``trust_remote_code=True``. The implementations live in the installed package:
``pip install diffusers-scalelong``.
"""

from diffusers_scalelong.models import EDM2UNet2DModel, ScaleLongUNet2DConditionModel, ScaleLongUNet2DModel, UViT2DModel
from diffusers_scalelong.schedulers import EDMHeunScheduler

__all__ = [
    "EDM2UNet2DModel",
    "EDMHeunScheduler",
    "ScaleLongUNet2DConditionModel",
    "ScaleLongUNet2DModel",
    "UViT2DModel",
]
