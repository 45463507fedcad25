"""EDM preconditioning (Karras et al. 2022, Table 1): ``D(x; sigma) = c_skip x + c_out F(c_in x, c_noise)``.

The one definition of the four c-functions, used by :class:`EDMHeunScheduler` and
:class:`diffusers_scalelong.edm2.EDMPreconditioner`. Same as diffusers' ``EDMEulerScheduler``
(``_get_conditioning_c_in``, ``precondition_noise``, ``precondition_outputs`` with ``prediction_type="epsilon"``),
written with the same operations so both give the same floats; a network trained through the preconditioner samples
with diffusers' EDM schedulers unchanged. ``sigma`` is a float or a tensor; ``sigma_data`` a float.
"""

import torch


def edm_c_in(sigma: float | torch.Tensor, sigma_data: float) -> float | torch.Tensor:
    """``c_in = 1 / sqrt(sigma^2 + sigma_data^2)``."""
    return 1 / ((sigma**2 + sigma_data**2) ** 0.5)


def edm_c_noise(sigma: torch.Tensor) -> torch.Tensor:
    """``c_noise = ln(sigma) / 4``."""
    return 0.25 * torch.log(sigma)


def edm_c_skip(sigma: float | torch.Tensor, sigma_data: float) -> float | torch.Tensor:
    """``c_skip = sigma_data^2 / (sigma^2 + sigma_data^2)``."""
    return sigma_data**2 / (sigma**2 + sigma_data**2)


def edm_c_out(sigma: float | torch.Tensor, sigma_data: float) -> float | torch.Tensor:
    """``c_out = sigma sigma_data / sqrt(sigma^2 + sigma_data^2)``."""
    return sigma * sigma_data / (sigma**2 + sigma_data**2) ** 0.5
