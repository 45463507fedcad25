"""Bring released checkpoints in: NVIDIA's EDM2 pickles and post-hoc EMA snapshots, U-ViT / ScaleLong state dicts.

- :mod:`.pickle_vm`, :mod:`.safe_pickle`: read official network pickles and ``torch.save`` checkpoints as fresh
  plain data, executing nothing from the file and bounded in size, depth and shape;
- :mod:`.edm2_state_dict`: official EDM2 tensor names -> ``EDM2UNet2DModel`` + ``LearnedUncertainty``;
- :mod:`.edm2_official`: an official network pickle -> an ``EDM2Pipeline`` folder (and the preconditioner);
- :mod:`.edm2_snapshots`: official raw post-hoc EMA snapshots -> ``phema-*.safetensors`` snapshot files;
- :mod:`.output`: converted folders are built beside the target and swapped in whole;
- :mod:`.uvit_official`: an official U-ViT / ScaleLong state dict -> ``UViT2DModel``;
- :mod:`.cli`: the ``scalelong-convert-edm2`` and ``scalelong-convert-uvit`` commands.
"""

from .edm2_official import (
    convert_edm2_pickle,
    from_edm2_pickle,
    preconditioner_from_edm2_pickle,
    push_converted_edm2,
    read_edm2_pickle,
)
from .edm2_snapshots import convert_edm2_snapshots
from .edm2_state_dict import convert_edm2_state_dict, preconditioner_from_edm2_state_dict
from .safe_pickle import PickleLimits, UnsafePickleError, load_restricted_pickle, load_torch_checkpoint
from .uvit_official import (
    convert_uvit_checkpoint,
    convert_uvit_state_dict,
    official_vpsde_scheduler,
    uvit_from_official,
)

__all__ = [
    "PickleLimits",
    "UnsafePickleError",
    "convert_edm2_pickle",
    "convert_edm2_snapshots",
    "convert_edm2_state_dict",
    "convert_uvit_checkpoint",
    "convert_uvit_state_dict",
    "from_edm2_pickle",
    "load_restricted_pickle",
    "load_torch_checkpoint",
    "official_vpsde_scheduler",
    "preconditioner_from_edm2_pickle",
    "preconditioner_from_edm2_state_dict",
    "push_converted_edm2",
    "read_edm2_pickle",
    "uvit_from_official",
]
