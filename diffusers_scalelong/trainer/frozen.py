"""The frozen modules of a run (VAE, text encoder): on the device in the mixed-precision dtype, as diffusers' example
scripts keep them (``weight_dtype``), while the trained model stays float32.

The weights as loaded are kept on the CPU while the run uses the cast copies, and :meth:`FrozenModules.restore`
puts them back before the final pipeline is saved: the saved VAE and text encoder are bit-identical to the ones
loaded, whatever ``mixed_precision`` the run used.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["FrozenModules", "weight_dtype"]

_WEIGHT_DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def weight_dtype(mixed_precision: str) -> torch.dtype:
    """The dtype of frozen weights under ``mixed_precision`` (``no``: float32, ``fp16``, ``bf16``)."""
    try:
        return _WEIGHT_DTYPES[mixed_precision]
    except KeyError:
        raise ValueError(f"mixed_precision must be one of {list(_WEIGHT_DTYPES)}, got {mixed_precision!r}") from None


class FrozenModules:
    """Modules a run uses without training them: eval mode, no gradients, on ``device`` in ``dtype``."""

    def __init__(self, modules: list[nn.Module], device: torch.device | str, dtype: torch.dtype):
        self.modules = list(modules)
        self.dtype = dtype
        self._originals: list[dict[str, torch.Tensor] | None] = []
        for module in self.modules:
            floating = [t for t in module.state_dict().values() if torch.is_floating_point(t)]
            changes = any(t.dtype != dtype for t in floating)
            # the state_dict's tensors are the loaded weights themselves (no copy); .to() below makes new ones
            self._originals.append({k: v.cpu() for k, v in module.state_dict().items()} if changes else None)
            module.to(device, dtype=dtype if changes else None).eval().requires_grad_(False)

    def describe(self) -> str:
        """One line naming each frozen module and its dtype."""
        return ", ".join(f"{type(m).__name__} in {next(m.parameters()).dtype}" for m in self.modules)

    def restore(self) -> None:
        """Put back the weights as loaded (original dtype, on the CPU), exactly."""
        for module, original in zip(self.modules, self._originals, strict=True):
            if original is not None:
                module.load_state_dict(original, assign=True)
                module.requires_grad_(False)
        self._originals = [None] * len(self.modules)
