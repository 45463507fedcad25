"""diffusers models: ScaleLong UNets, the U-ViT and the EDM2 UNet."""

from .edm2_unet import EDM2UNet2DModel
from .scalelong_unet import ScaleLongUNet2DConditionModel, ScaleLongUNet2DModel
from .uvit import UViT2DModel

__all__ = ["EDM2UNet2DModel", "ScaleLongUNet2DConditionModel", "ScaleLongUNet2DModel", "UViT2DModel"]
