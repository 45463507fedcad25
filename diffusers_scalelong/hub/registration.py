"""diffusers loads the package's components by repo id once the package is imported.

``save_pretrained`` of a pipeline records a component of another library under its module path, e.g.
``"unet": ["diffusers_scalelong.models.scalelong_unet", "ScaleLongUNet2DModel"]``. From a local folder diffusers
loads that from the imported module; by repo id it first checks every such name against its table of libraries
(``LOADABLE_CLASSES``, where ``transformers`` is listed) or a code file in the repo, and refuses the rest before
anything is downloaded. :func:`register_with_diffusers` (run when the package is imported) lists the modules of the
package's component classes in that table, with the base classes and save/load methods of diffusers' own entry, so a
repo written by diffusers' ``push_to_hub`` or ``save_pretrained(push_to_hub=True)`` loads like a local folder.

A model folder's ``config.json`` names only its class, which diffusers' ``AutoModel`` looks up on the ``diffusers``
module: the classes are made attributes of it too (as ``EDM2Pipeline`` and ``EDMHeunScheduler`` are), unless
diffusers has its own of that name.
"""

import diffusers
from diffusers.pipelines import pipeline_loading_utils

from ..edm2.uncertainty import LearnedUncertainty
from ..models import EDM2UNet2DModel, ScaleLongUNet2DConditionModel, ScaleLongUNet2DModel, UViT2DModel
from ..schedulers import EDMHeunScheduler

COMPONENT_CLASSES = (
    EDM2UNet2DModel,
    EDMHeunScheduler,
    LearnedUncertainty,
    ScaleLongUNet2DConditionModel,
    ScaleLongUNet2DModel,
    UViT2DModel,
)
"""The classes a pipeline folder may name as components (the component shim file re-exports the same)."""


def register_with_diffusers() -> list[str]:
    """Add the modules of :data:`COMPONENT_CLASSES` to diffusers' ``LOADABLE_CLASSES`` and the classes to the
    ``diffusers`` module; returns the module names."""
    table = pipeline_loading_utils.LOADABLE_CLASSES
    modules = sorted({cls.__module__ for cls in COMPONENT_CLASSES})
    for module in modules:
        table.setdefault(module, dict(table["diffusers"]))
    for cls in COMPONENT_CLASSES:
        if not hasattr(diffusers, cls.__name__):
            setattr(diffusers, cls.__name__, cls)
    return modules
