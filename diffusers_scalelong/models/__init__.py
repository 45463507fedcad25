"""models subpackage."""

from .scalelong_unet import ScaleLongUNet2DConditionModel, ScaleLongUNet2DModel  # noqa: F401
from .uvit import UViT2DModel  # noqa: F401
