"""diffusers' layerwise casting for :class:`MPConv`, a layer its hooks do not recognise by type.

diffusers' ``apply_layerwise_casting`` hooks only the torch layer types it lists (``nn.Linear``, ``nn.Conv2d``, ...),
so a model whose weights live in ``MPConv`` would keep every weight in full precision without a word.
:func:`apply_mp_layerwise_casting` attaches the same hook (registered under diffusers' hook name, so diffusers sees
casting as active) to every ``MPConv`` whose name no skip pattern matches. Storage dtype between forwards, compute
dtype inside them: the forward normalises the weight in float32 as always, so only the stored values are rounded.

Training works too: MPConv's forced weight normalisation would write the projected weight into the compute-dtype
copy, which the hook then rounds back to the storage dtype. A hooked layer projects functionally instead
(``MPConv.project_in_place = False``): the forward uses ``w / rms(w)`` and the gradient reaches the stored weight,
whose bits the forward leaves as they are.
"""

import re
from collections.abc import Sequence

import torch
from diffusers.hooks.hooks import HookRegistry
from diffusers.hooks.layerwise_casting import _LAYERWISE_CASTING_HOOK, LayerwiseCastingHook
from torch import nn

from .mp import MPConv


class MPConvCastingHook(LayerwiseCastingHook):
    """diffusers' ``LayerwiseCastingHook`` for an ``MPConv``: the layer's training-mode forwards project its weight
    functionally (``project_in_place = False``) rather than writing into the stored weight."""

    def initialize_hook(self, module: nn.Module) -> nn.Module:
        module.project_in_place = False
        return super().initialize_hook(module)


def apply_mp_layerwise_casting(
    model: nn.Module,
    storage_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    skip_modules_pattern: Sequence[str] = (),
    skip_modules_classes: tuple[type[nn.Module], ...] = (),
    non_blocking: bool = False,
) -> list[str]:
    """Hook every ``MPConv`` of ``model`` whose name matches none of ``skip_modules_pattern`` (``re.search``, as
    diffusers matches them) and that is not inside a module of ``skip_modules_classes``; returns the hooked names."""
    skipped_prefixes = [name for name, module in model.named_modules() if isinstance(module, skip_modules_classes)]
    hooked = []
    for name, module in model.named_modules():
        if not isinstance(module, MPConv) or any(re.search(pattern, name) for pattern in skip_modules_pattern):
            continue
        if any(name == prefix or name.startswith(f"{prefix}.") for prefix in skipped_prefixes):
            continue
        registry = HookRegistry.check_if_exists_or_initialize(module)
        registry.register_hook(MPConvCastingHook(storage_dtype, compute_dtype, non_blocking), _LAYERWISE_CASTING_HOOK)
        hooked.append(name)
    return hooked


class MPLayerwiseCastingMixin:
    """``enable_layerwise_casting`` of a diffusers model that also casts its ``MPConv`` layers.

    diffusers' method hooks the layers it recognises (e.g. the LS gates' ``nn.Linear``); the ``MPConv`` layers get
    the same storage / compute dtypes and skip patterns. Put this mixin before ``ModelMixin`` in the bases.
    """

    def enable_layerwise_casting(
        self,
        storage_dtype: torch.dtype = torch.float8_e4m3fn,
        compute_dtype: torch.dtype | None = None,
        skip_modules_pattern: tuple[str, ...] | None = None,
        skip_modules_classes: tuple[type[nn.Module], ...] | None = None,
        non_blocking: bool = False,
    ) -> None:
        from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

        compute_dtype = self.dtype if compute_dtype is None else compute_dtype
        super().enable_layerwise_casting(
            storage_dtype, compute_dtype, skip_modules_pattern, skip_modules_classes, non_blocking
        )
        patterns = DEFAULT_SKIP_MODULES_PATTERN if skip_modules_pattern is None else skip_modules_pattern
        patterns = (*patterns, *(self._keep_in_fp32_modules or ()), *(self._skip_layerwise_casting_patterns or ()))
        apply_mp_layerwise_casting(
            self, storage_dtype, compute_dtype, patterns, tuple(skip_modules_classes or ()), non_blocking
        )
