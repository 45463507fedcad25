"""Component file for diffusers-scalelong models and schedulers in a Hub repo.

A copy sits in each component folder (``unet/``, ``scheduler/``, ...) whose ``model_index.json`` entry is
``["diffusers_scalelong_components", "<Class>"]``; diffusers imports it to find the class when loading by repo id
with ``trust_remote_code=True``. The implementations live in the installed ``diffusers_scalelong`` package; without
it, the import below fails with the install command (filled in when the file is written into a repo).
"""

import importlib

INSTALL_COMMAND = "(see the package's README)"

try:
    _package = importlib.import_module("diffusers_scalelong")
except ModuleNotFoundError as error:
    if error.name != "diffusers_scalelong":
        raise
    raise ImportError(
        f"This repository's models need the diffusers-scalelong package, which is not installed. "
        f"Install it with: {INSTALL_COMMAND}"
    ) from error

EDM2UNet2DModel = _package.EDM2UNet2DModel
EDMHeunScheduler = _package.EDMHeunScheduler
LearnedUncertainty = _package.LearnedUncertainty
ScaleLongUNet2DConditionModel = _package.ScaleLongUNet2DConditionModel
ScaleLongUNet2DModel = _package.ScaleLongUNet2DModel
UViT2DModel = _package.UViT2DModel

__all__ = [
    "EDM2UNet2DModel",
    "EDMHeunScheduler",
    "LearnedUncertainty",
    "ScaleLongUNet2DConditionModel",
    "ScaleLongUNet2DModel",
    "UViT2DModel",
]
