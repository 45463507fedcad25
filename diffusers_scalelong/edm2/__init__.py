"""EDM2 training pieces: EDM preconditioning, learned uncertainty, the EDM2 loss and lr schedule, the paper's presets.

The weight converters (``convert_edm2_state_dict``, ``preconditioner_from_edm2_state_dict``) live in
:mod:`diffusers_scalelong.convert`; they stay importable from here.
"""

from .loss import EDM2Loss, EDM2LossOutput
from .lr_schedule import inverse_sqrt_lr_lambda
from .precond import EDMPreconditioner, edm_precondition
from .presets import EDM2_PRESETS, EDM2Preset, get_edm2_preset
from .uncertainty import LearnedUncertainty

__all__ = [
    "EDM2_PRESETS",
    "EDM2Loss",
    "EDM2LossOutput",
    "EDM2Preset",
    "EDMPreconditioner",
    "LearnedUncertainty",
    "convert_edm2_state_dict",
    "edm_precondition",
    "get_edm2_preset",
    "inverse_sqrt_lr_lambda",
    "preconditioner_from_edm2_state_dict",
]


def __getattr__(name: str):
    """The converters, imported on first use (``convert`` builds on this package, so it cannot load first)."""
    if name in ("convert_edm2_state_dict", "preconditioner_from_edm2_state_dict"):
        from ..convert import edm2_state_dict

        return getattr(edm2_state_dict, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
