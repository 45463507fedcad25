"""diffusers models: ScaleLong UNets, the U-ViT and the EDM2 UNet (with the paper's presets), and loading a pretrained
(vanilla) UNet into its ScaleLong subclass (``load_pretrained_unet``)."""

from .edm2_presets import EDM2_PRESETS, EDM2Preset, get_edm2_preset
from .edm2_unet import EDM2UNet2DModel
from .pretrained import load_model_config, load_pretrained_unet, model_class_by_name
from .scalelong_unet import ScaleLongUNet2DConditionModel, ScaleLongUNet2DModel
from .uvit import UViT2DModel

__all__ = [
    "EDM2_PRESETS",
    "EDM2Preset",
    "EDM2UNet2DModel",
    "ScaleLongUNet2DConditionModel",
    "ScaleLongUNet2DModel",
    "UViT2DModel",
    "get_edm2_preset",
    "load_model_config",
    "load_pretrained_unet",
    "model_class_by_name",
]
