"""Deprecated alias of :mod:`diffusers_scalelong.hub.layout`."""

from .._deprecated import warn_moved
from ..hub.layout import model_card, push_pipeline_to_hub, shim_folder, write_hub_layout

warn_moved("diffusers_scalelong.pipelines.hub_layout", "diffusers_scalelong.hub.layout")

__all__ = ["model_card", "push_pipeline_to_hub", "shim_folder", "write_hub_layout"]
