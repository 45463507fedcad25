"""Schedulers: the EDM Heun sampler, interchangeable with diffusers' EDM schedulers."""

from diffusers import SchedulerMixin  # noqa: F401  (diffusers' loader checks the module for this base class)

from .edm_heun import EDMHeunScheduler, EDMHeunSchedulerOutput

__all__ = ["EDMHeunScheduler", "EDMHeunSchedulerOutput"]
