"""Deprecated alias of :mod:`diffusers_scalelong.scalelong.diagnostics`."""

from ._deprecated import warn_moved
from .scalelong.diagnostics import StabilityDiagnostics

warn_moved("diffusers_scalelong.diagnostics", "diffusers_scalelong.scalelong.diagnostics")

__all__ = ["StabilityDiagnostics"]
