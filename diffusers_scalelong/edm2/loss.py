"""The EDM2 training loss with learned uncertainty (Karras et al., arXiv 2312.02696, Eqs. 14-16 and 21)."""

import math
from dataclasses import dataclass

import torch

from ..validation import SIGMA_RANGE, check_number, check_sigma
from .precond import EDMPreconditioner

__all__ = ["EDM2Loss", "EDM2LossOutput"]

#: A standard normal draw lies within +-DRAW_Z but for 2e-9 of draws: the range P_mean and P_std must keep in bounds.
DRAW_Z = 6.0


@dataclass
class EDM2LossOutput:
    """Result of :class:`EDM2Loss`; everything but ``loss`` and ``per_sample_loss`` is detached.

    - ``loss``: scalar to back-propagate (sum over pixels, mean over the batch);
    - ``per_sample_loss``: [B] ``sum_pixels (w / exp(u)) (D - y)^2 + u``;
    - ``weighted_error``: [B] raw loss ``mean_pixels w (D - y)^2`` - the quantity ``exp(u(sigma))`` learns;
    - ``sigma``, ``logvar``: [B] the noise levels drawn and ``u(sigma)``.
    """

    loss: torch.Tensor
    per_sample_loss: torch.Tensor
    weighted_error: torch.Tensor
    sigma: torch.Tensor
    logvar: torch.Tensor


class EDM2Loss:
    """EDM2 denoising loss with log-normal noise levels and learned uncertainty.

    ``ln sigma ~ N(P_mean, P_std^2)``, ``n ~ N(0, sigma^2 I)``, ``w(sigma) = (sigma^2 + sd^2) / (sigma sd)^2``;
    per element ``L = (w / exp(u(sigma))) (D(y + n; sigma) - y)^2 + u(sigma)``, summed over pixels, averaged over
    the batch. Without an uncertainty head ``u = 0`` and this is the EDM loss. Defaults: ImageNet-512 latents
    (``P_mean=-0.4, P_std=1.0``); ImageNet-64 pixels use ``-0.8, 1.6``. ``sigma_data`` (of ``w``) is the
    denoiser's own ``.sigma_data`` unless given here (e.g. for a denoiser wrapped by DistributedDataParallel).
    ``exp(P_mean +- 6 P_std)`` must stay within ``[1e-18, 1e18]`` (``SIGMA_RANGE``), the noise levels the
    preconditioning computes in float32.
    """

    def __init__(self, P_mean: float = -0.4, P_std: float = 1.0, sigma_data: float | None = None):
        log_range = math.log(SIGMA_RANGE[1])
        check_number("P_mean", P_mean, -log_range, log_range)
        check_number("P_std", P_std, 0.0, log_range / DRAW_Z, low_inclusive=False)
        if abs(P_mean) + DRAW_Z * P_std > log_range:
            raise ValueError(
                f"P_mean={P_mean} and P_std={P_std} draw noise levels exp(P_mean +- {DRAW_Z:g} P_std) beyond "
                f"[{SIGMA_RANGE[0]:g}, {SIGMA_RANGE[1]:g}], where the preconditioning leaves float32's range"
            )
        self.P_mean = float(P_mean)
        self.P_std = float(P_std)
        self.sigma_data = None if sigma_data is None else check_sigma("sigma_data", sigma_data)

    def sample_sigma(
        self, batch_size: int, device: torch.device | str = "cpu", generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """``sigma = exp(P_mean + P_std z)``, z ~ N(0, 1), float32 [batch_size]."""
        z = torch.randn(batch_size, generator=generator, device=device, dtype=torch.float32)
        return (z * self.P_std + self.P_mean).exp()

    def __call__(
        self,
        denoiser: EDMPreconditioner | torch.nn.Module,
        images: torch.Tensor,
        class_labels: torch.Tensor | None = None,
        sigma: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> EDM2LossOutput:
        """Loss of ``denoiser`` on clean ``images`` [B, C, H, W] (sigma drawn unless given, one value or one per
        image, each in ``SIGMA_RANGE``; noise from ``generator``)."""
        if not isinstance(images, torch.Tensor) or images.ndim != 4 or not images.is_floating_point():
            raise ValueError(f"images must be a float tensor [B, C, H, W], got {_describe(images)}")
        y = images.to(torch.float32)
        if sigma is None:
            sigma = self.sample_sigma(y.shape[0], y.device, generator)
        else:
            sigma = _check_given_sigma(sigma, y.shape[0])
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=y.device).reshape(-1).expand(y.shape[0])
        s = sigma.reshape(-1, 1, 1, 1)
        sd = self.sigma_data if self.sigma_data is not None else getattr(denoiser, "sigma_data", None)
        if sd is None:
            raise ValueError("EDM2Loss needs sigma_data: pass EDM2Loss(sigma_data=...) or a denoiser with .sigma_data")
        if getattr(denoiser, "sigma_data", sd) != sd:
            raise ValueError(f"EDM2Loss(sigma_data={sd}) differs from the denoiser's sigma_data={denoiser.sigma_data}")
        weight = (s**2 + sd**2) / (s * sd) ** 2
        noise = torch.randn(y.shape, generator=generator, device=y.device, dtype=torch.float32) * s
        denoised, logvar = denoiser(y + noise, sigma, class_labels, return_logvar=True)
        weighted_error = weight * (denoised - y) ** 2
        per_element = weighted_error / logvar.exp() + logvar
        per_sample = per_element.flatten(1).sum(dim=1)
        return EDM2LossOutput(
            loss=per_sample.mean(),
            per_sample_loss=per_sample,
            weighted_error=weighted_error.detach().flatten(1).mean(dim=1),
            sigma=sigma.detach(),
            logvar=logvar.detach().flatten(),
        )


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return repr(value)


def _check_given_sigma(sigma: torch.Tensor | float, batch_size: int) -> torch.Tensor:
    """``sigma`` as a float32 tensor of 1 or ``batch_size`` values, each a noise level in ``SIGMA_RANGE``."""
    values = torch.as_tensor(sigma).detach()
    if values.is_complex() or values.dtype == torch.bool or values.numel() not in (1, batch_size):
        raise ValueError(f"sigma must hold 1 or {batch_size} (the batch size) real values, got {_describe(sigma)}")
    values = values.to(torch.float32)
    low, high = SIGMA_RANGE
    if not bool(((values >= low) & (values <= high)).all()):  # also refuses NaN
        raise ValueError(f"sigma must lie in [{low:g}, {high:g}], got {values.flatten().tolist()[:8]}")
    return sigma
