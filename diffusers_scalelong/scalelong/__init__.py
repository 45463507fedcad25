"""ScaleLong: scaling of long skip connections."""

from .coefficients import LEARNABLE_METHODS, LSC_METHODS, lsc_coefficients, validate_lsc_options
from .gates import ChannelGate, TokenGate
from .hooks import LongSkipScaling, apply_lsc, conv_skip_layout, remove_lsc
from .loading import LongSkipScalingLoaderMixin

__all__ = [
    "LEARNABLE_METHODS",
    "LSC_METHODS",
    "ChannelGate",
    "LongSkipScaling",
    "LongSkipScalingLoaderMixin",
    "TokenGate",
    "apply_lsc",
    "conv_skip_layout",
    "lsc_coefficients",
    "remove_lsc",
    "validate_lsc_options",
]
