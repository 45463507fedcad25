"""Everything the package pushes to the Hugging Face Hub shares one model-card style (``cards``).

- ``registration``: importing the package lets diffusers load its components by repo id (run on import);
- ``layout``: the Hub-native layout of a saved pipeline folder (shim files for ``trust_remote_code=True``), its
  model card and :func:`push_pipeline_to_hub`; ``shims``: the shim files; ``auto_model``: the same for one model
  folder (``auto_map``, for diffusers' ``AutoModel``);
- ``access``: one clear error when the Hub cannot be reached, and the check before a long job that ends in a push;
- post-hoc EMA snapshot sets and reconstructed models travel through :mod:`diffusers_scalelong.ema.hub_transfer`.
"""

from .access import HubAccessError, check_hub_access
from .auto_model import write_auto_model_files
from .cards import INSTALL, PROJECT_URL, build_card, markdown_table
from .layout import model_card, push_pipeline_to_hub, write_hub_layout
from .registration import register_with_diffusers
from .shims import shim_folder

register_with_diffusers()

__all__ = [
    "INSTALL",
    "PROJECT_URL",
    "HubAccessError",
    "build_card",
    "check_hub_access",
    "markdown_table",
    "model_card",
    "push_pipeline_to_hub",
    "register_with_diffusers",
    "shim_folder",
    "write_auto_model_files",
    "write_hub_layout",
]
