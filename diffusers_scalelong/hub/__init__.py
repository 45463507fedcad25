"""Everything the package pushes to the Hugging Face Hub shares one model-card style (``cards``).

- ``layout``: the Hub-native layout of a saved pipeline folder (shim files for ``trust_remote_code=True``), its
  model card and :func:`push_pipeline_to_hub`;
- ``access``: one clear error when the Hub cannot be reached, and the check before a long job that ends in a push;
- post-hoc EMA snapshot sets and reconstructed models travel through :mod:`diffusers_scalelong.ema.hub_transfer`.

The EMA transfer functions were importable from this module before; those names still resolve here (deprecated).
"""

from .access import HubAccessError, check_hub_access
from .cards import build_card, markdown_table
from .layout import model_card, push_pipeline_to_hub, shim_folder, write_hub_layout

__all__ = [
    "HubAccessError",
    "build_card",
    "check_hub_access",
    "markdown_table",
    "model_card",
    "push_pipeline_to_hub",
    "shim_folder",
    "write_hub_layout",
]

_MOVED_TO_EMA = (
    "DEFAULT_PATH_IN_REPO",
    "INDEX_FILENAME",
    "RemoteSnapshot",
    "list_remote_snapshots",
    "pull_snapshots",
    "push_reconstruction",
    "push_snapshots",
    "reconstruct_from_hub",
)


def __getattr__(name: str):
    """The post-hoc EMA Hub functions under their old path ``diffusers_scalelong.hub`` (deprecated)."""
    if name in _MOVED_TO_EMA:
        from .._deprecated import warn_moved
        from ..ema import hub_transfer

        warn_moved(f"diffusers_scalelong.hub.{name}", f"diffusers_scalelong.ema.hub_transfer.{name}")
        return getattr(hub_transfer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
