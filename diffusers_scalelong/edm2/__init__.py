"""EDM2 training pieces: EDM preconditioning, learned uncertainty, the EDM2 loss and lr schedule, the paper's presets
(defined with the EDM2 UNet in :mod:`diffusers_scalelong.models.edm2_presets`).

The weight converters (``convert_edm2_state_dict``, ``preconditioner_from_edm2_state_dict``) live in
:mod:`diffusers_scalelong.convert`.
"""

from ..models.edm2_presets import EDM2_PRESETS, EDM2Preset, get_edm2_preset
from .loss import EDM2Loss, EDM2LossOutput
from .lr_schedule import inverse_sqrt_lr_lambda
from .precond import EDMPreconditioner, edm_precondition
from .uncertainty import LearnedUncertainty

__all__ = [
    "EDM2_PRESETS",
    "EDM2Loss",
    "EDM2LossOutput",
    "EDM2Preset",
    "EDMPreconditioner",
    "LearnedUncertainty",
    "edm_precondition",
    "get_edm2_preset",
    "inverse_sqrt_lr_lambda",
]
