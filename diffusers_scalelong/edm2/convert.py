"""Former home of the EDM2 state-dict converter, kept so that old imports keep working.

The converter lives in :mod:`diffusers_scalelong.convert.edm2_state_dict`.
"""

from ..convert.edm2_state_dict import convert_edm2_state_dict, preconditioner_from_edm2_state_dict

__all__ = ["convert_edm2_state_dict", "preconditioner_from_edm2_state_dict"]
