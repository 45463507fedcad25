"""Schedulers: the EDM Heun sampler, interchangeable with diffusers' EDM schedulers.

diffusers finds a scheduler's ``compatibles`` by name on the ``diffusers`` module, so importing this package makes
``diffusers.EDMHeunScheduler`` available (unless diffusers defines one itself) and lists it among the compatibles of
diffusers' EDM schedulers, as theirs are among its own.
"""

import diffusers
from diffusers import SchedulerMixin  # noqa: F401  (diffusers' loader checks the module for this base class)

from .edm_heun import EDMHeunScheduler, EDMHeunSchedulerOutput


def _register_with_diffusers() -> None:
    if not hasattr(diffusers, "EDMHeunScheduler"):
        diffusers.EDMHeunScheduler = EDMHeunScheduler
    for name in EDMHeunScheduler._compatibles:
        scheduler = getattr(diffusers, name)
        if "EDMHeunScheduler" not in scheduler._compatibles:
            scheduler._compatibles = [*scheduler._compatibles, "EDMHeunScheduler"]


_register_with_diffusers()

__all__ = ["EDMHeunScheduler", "EDMHeunSchedulerOutput"]
