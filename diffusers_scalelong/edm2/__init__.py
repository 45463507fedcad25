"""EDM2 training pieces: EDM preconditioning, learned uncertainty, the EDM2 loss and lr schedule, weight converter."""

from .convert import convert_edm2_state_dict, preconditioner_from_edm2_state_dict
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
