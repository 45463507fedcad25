"""Deprecated alias of :mod:`diffusers_scalelong.trainer` (checkpoint folders: ``trainer.Checkpoint``)."""

from .._deprecated import warn_moved
from ..trainer import *  # noqa: F403
from ..trainer import __all__  # noqa: F401

warn_moved("diffusers_scalelong.training_utils", "diffusers_scalelong.trainer")
