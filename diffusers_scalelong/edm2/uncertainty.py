"""Learned uncertainty u(sigma) of the EDM2 loss (Karras et al., arXiv 2312.02696, Eq. 21)."""

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin

from ..layers.legacy_config import LegacyAutoMapMixin
from ..layers.mp import MPConv, MPFourier
from ..layers.mp_casting import MPLayerwiseCastingMixin
from ..validation import MAX_PARAMETERS, check_count

__all__ = ["LearnedUncertainty", "ModelMixin"]


class LearnedUncertainty(LegacyAutoMapMixin, MPLayerwiseCastingMixin, ModelMixin, ConfigMixin):
    """Log-variance head ``u(sigma) = MPConv(C -> 1)(MPFourier(C)(c_noise))`` with ``c_noise = ln(sigma) / 4``.

    ``exp(u(sigma))`` learns the expected EDM-weighted error at noise level sigma; the loss divides by it, which
    balances the noise levels' contributions automatically. A diffusers model, so it saves and loads with
    ``save_pretrained`` / ``from_pretrained`` next to the UNet.
    """

    @register_to_config
    def __init__(self, num_channels: int = 128):
        super().__init__()
        check_count("num_channels", num_channels, 1, MAX_PARAMETERS)  # its parameter count is num_channels
        self.fourier = MPFourier(num_channels)
        self.linear = MPConv(num_channels, 1)

    def forward(self, c_noise: torch.Tensor) -> torch.Tensor:
        """``u`` for every entry of ``c_noise``, shape ``[B, 1, 1, 1]``, float32."""
        c_noise = torch.as_tensor(c_noise, dtype=torch.float32).flatten()
        return self.linear(self.fourier(c_noise)).to(torch.float32).reshape(-1, 1, 1, 1)
