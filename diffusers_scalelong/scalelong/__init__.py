"""ScaleLong: scaling of long skip connections."""

from .coefficients import LEARNABLE_METHODS, LSC_METHODS, lsc_coefficients, validate_lsc_options

__all__ = ["LEARNABLE_METHODS", "LSC_METHODS", "lsc_coefficients", "validate_lsc_options"]
