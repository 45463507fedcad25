"""models subpackage."""

from .edm2_unet import EDM2UNet2DModel  # noqa: F401
from .scalelong_unet import ScaleLongUNet2DConditionModel, ScaleLongUNet2DModel  # noqa: F401
from .uvit import UViT2DModel  # noqa: F401
