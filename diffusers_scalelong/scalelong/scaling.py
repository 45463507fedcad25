"""The scaling module of ScaleLong: coefficients and LS gates of a model's long skips, outermost skip first."""

from collections.abc import Sequence

import torch
from torch import nn

from .coefficients import LEARNABLE_METHODS, lsc_coefficients, validate_lsc_options
from .gates import ChannelGate, TokenGate


class LongSkipScaling(nn.Module):
    """Coefficients and (for LS) calibration gates of a model's long skips, outermost skip first.

    ``factor(i, skip)`` is ``kappa_i`` for the constant methods and the gate ``g(skip)`` in (0, 1) for LS;
    ``scale(i, skip) = factor(i, skip) * skip``. Every model family owns one (``model.lsc``) and routes each long
    skip through it. It holds parameters only for the learnable methods, so CS leaves a model's state dict
    unchanged. ``ls`` shares one gate among all skips of the same width (a conv UNet's skips differ in channel
    count; U-ViT skips all have the same token count, so there it is a single gate), ``ls_nonshared`` has one per
    skip.
    """

    def __init__(
        self,
        method: str,
        kappa: float,
        skip_widths: Sequence[int | None],
        stage_ids: Sequence[int],
        gate_type: str = "channel",
        reduction: int = 16,
    ):
        super().__init__()
        validate_lsc_options(method, kappa, reduction)
        self.method = method
        self.kappa = float(kappa)
        self.widths = tuple(skip_widths)
        self.stage_ids = tuple(stage_ids)
        self.coefficients = tuple(lsc_coefficients(method, len(self.widths), kappa, self.stage_ids))
        self.gates = nn.ModuleList()
        self.gate_index: tuple[int, ...] = ()
        if method in LEARNABLE_METHODS:
            if any(width is None for width in self.widths):
                raise ValueError(
                    f"lsc_method={method!r} needs the width of every skip, but this block layout does not expose it"
                )
            gate_cls = {"channel": ChannelGate, "token": TokenGate}[gate_type]
            gate_of_width: dict[int, int] = {}
            index = []
            for width in self.widths:
                if method == "ls_nonshared" or width not in gate_of_width:
                    gate_of_width[width] = len(self.gates)
                    self.gates.append(gate_cls(width, reduction))
                index.append(gate_of_width[width] if method == "ls" else len(self.gates) - 1)
            self.gate_index = tuple(index)

    @property
    def num_skips(self) -> int:
        return len(self.coefficients)

    def factor(self, index: int, skip: torch.Tensor) -> torch.Tensor | float:
        """``kappa_index`` of skip ``index`` (0 = outermost): a constant, or for LS the gate ``g(skip)``."""
        if self.gate_index:
            return self.gates[self.gate_index[index]](skip)
        return self.coefficients[index]

    def scale(self, index: int, skip: torch.Tensor) -> torch.Tensor:
        """Scaled skip ``kappa_index * skip`` (0 = outermost); a coefficient of 1 returns ``skip`` itself."""
        factor = self.factor(index, skip)
        return skip if isinstance(factor, float) and factor == 1.0 else skip * factor

    def reset_gates(self, device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        """(Re)initialise the LS gates, materialising them on ``device`` if they sit on ``meta``."""
        for gate in self.gates:
            if any(p.is_meta for p in gate.parameters()):
                gate.to_empty(device=device or "cpu")
            gate.reset_parameters()
            if dtype is not None:
                gate.to(dtype)

    def extra_repr(self) -> str:
        return f"method={self.method!r}, kappa={self.kappa}, num_skips={self.num_skips}"
