"""EDM2 training pieces: EDM preconditioning, learned uncertainty, the EDM2 loss and lr schedule.

The weight converters (``convert_edm2_state_dict``, ``preconditioner_from_edm2_state_dict``) live in
:mod:`diffusers_scalelong.convert`; they stay importable from here.
"""

from .loss import EDM2Loss, EDM2LossOutput
from .lr_schedule import inverse_sqrt_lr_lambda
from .precond import EDMPreconditioner, edm_precondition
from .uncertainty import LearnedUncertainty

__all__ = [
    "EDM2Loss",
    "EDM2LossOutput",
    "EDMPreconditioner",
    "LearnedUncertainty",
    "convert_edm2_state_dict",
    "edm_precondition",
    "inverse_sqrt_lr_lambda",
    "preconditioner_from_edm2_state_dict",
]


def __getattr__(name: str):
    """The converters, imported on first use (``convert`` builds on this package, so it cannot load first)."""
    if name in ("convert_edm2_state_dict", "preconditioner_from_edm2_state_dict"):
        from ..convert import edm2_state_dict

        return getattr(edm2_state_dict, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
