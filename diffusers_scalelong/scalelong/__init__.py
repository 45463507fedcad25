"""ScaleLong (arXiv 2310.13545): scaling of long skip connections.

- ``coefficients``: the constant coefficients ``kappa_i`` and the one check of (lsc_method, lsc_kappa, lsc_reduction);
- ``gates``: the learnable LS calibration gates (token-wise for U-ViT, channel-wise for conv UNets);
- ``scaling``: :class:`LongSkipScaling`, the module every model family routes its long skips through (``model.lsc``);
- ``skips``: the long-skip protocol (``long_skip_layout()``: which skips, their widths and stages, where they meet
  the decoder input);
- ``conv_hooks``: scaling for diffusers conv UNets through up-block pre-hooks (``apply_lsc`` / ``remove_lsc``);
- ``loading``: ``from_pretrained`` that initialises LS gates missing from a checkpoint;
- ``diagnostics``: the training-stability measurements of the paper's analysis (:class:`StabilityDiagnostics`).
"""

from .coefficients import LEARNABLE_METHODS, LSC_METHODS, lsc_coefficients, validate_lsc_options
from .conv_hooks import apply_lsc, install_conv_lsc, remove_lsc
from .diagnostics import StabilityDiagnostics
from .gates import ChannelGate, TokenGate
from .loading import LongSkipScalingLoaderMixin
from .scaling import LongSkipScaling
from .skips import HasLongSkips, LongSkip, LongSkipLayout, conv_long_skip_layout, long_skip_layout

__all__ = [
    "LEARNABLE_METHODS",
    "LSC_METHODS",
    "ChannelGate",
    "HasLongSkips",
    "LongSkip",
    "LongSkipLayout",
    "LongSkipScaling",
    "LongSkipScalingLoaderMixin",
    "StabilityDiagnostics",
    "TokenGate",
    "apply_lsc",
    "conv_long_skip_layout",
    "install_conv_lsc",
    "long_skip_layout",
    "lsc_coefficients",
    "remove_lsc",
    "validate_lsc_options",
]
