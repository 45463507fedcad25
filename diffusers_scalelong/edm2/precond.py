"""EDM preconditioning ``D(x; sigma) = c_skip x + c_out F(c_in x, c_noise)`` around a raw network F.

The c-functions (one definition in :mod:`diffusers_scalelong.schedulers.edm_preconditioning`, shared with
``EDMHeunScheduler``) are the same as diffusers' ``EDMEulerScheduler`` (``precondition_inputs`` /
``precondition_noise`` / ``precondition_outputs`` with ``prediction_type="epsilon"``), so a network trained
through this wrapper samples with those schedulers unchanged:

    c_in = 1 / sqrt(sigma^2 + sd^2),  c_noise = ln(sigma) / 4,
    c_skip = sd^2 / (sigma^2 + sd^2),  c_out = sigma sd / sqrt(sigma^2 + sd^2).
"""

import json
import os

import torch
from torch import nn

from ..atomic import atomic_write_text
from ..schedulers.edm_preconditioning import edm_c_in, edm_c_noise, edm_c_out, edm_c_skip
from ..validation import check_sigma
from .uncertainty import LearnedUncertainty

__all__ = ["EDMPreconditioner", "edm_precondition"]

PRECONDITIONER_CONFIG = "preconditioner_config.json"


def _sigma_tensor(sigma: torch.Tensor | float, sample: torch.Tensor) -> torch.Tensor:
    """``sigma`` as float32 [B or 1, 1, 1, 1] on the sample's device."""
    sigma = torch.as_tensor(sigma, dtype=torch.float32, device=sample.device).reshape(-1, 1, 1, 1)
    if sigma.shape[0] not in (1, sample.shape[0]):
        raise ValueError(f"sigma has {sigma.shape[0]} values for a batch of {sample.shape[0]}")
    return sigma


def edm_precondition(
    model: nn.Module,
    sample: torch.Tensor,
    sigma: torch.Tensor | float,
    class_labels: torch.Tensor | None = None,
    sigma_data: float = 0.5,
) -> torch.Tensor:
    """Denoised estimate ``D(x; sigma) = c_skip x + c_out F(c_in x, c_noise, class_labels)``, in float32.

    ``model`` is a raw network called as ``model(c_in x, c_noise, class_labels=...)`` returning ``.sample`` or a
    tensor (e.g. :class:`EDM2UNet2DModel`); its input is cast to the dtype of ``sample``.
    """
    check_sigma("sigma_data", sigma_data)
    x = sample.to(torch.float32)
    sigma = _sigma_tensor(sigma, sample)
    model_input = (x * edm_c_in(sigma, sigma_data)).to(sample.dtype)
    kwargs = {} if class_labels is None else {"class_labels": class_labels}
    output = model(model_input, edm_c_noise(sigma.flatten()), **kwargs)
    output = output.sample if hasattr(output, "sample") else output
    return edm_c_skip(sigma, sigma_data) * x + edm_c_out(sigma, sigma_data) * output.to(torch.float32)


class EDMPreconditioner(nn.Module):
    """The EDM2 denoiser: a raw UNet ``F`` with EDM preconditioning and an optional learned uncertainty ``u``.

    ``forward(x, sigma, class_labels)`` returns ``D(x; sigma)`` (float32), and with ``return_logvar=True`` also
    ``u(sigma)`` of shape [B, 1, 1, 1]. ``save_pretrained(dir)`` writes ``unet/``, ``uncertainty/`` and
    ``preconditioner_config.json``; ``from_pretrained(dir)`` reads them back.
    """

    def __init__(self, unet: nn.Module, uncertainty: LearnedUncertainty | None = None, sigma_data: float = 0.5) -> None:
        super().__init__()
        if not isinstance(unet, nn.Module):
            raise ValueError(f"unet must be a torch module (the raw network F), got {type(unet).__name__}")
        if uncertainty is not None and not isinstance(uncertainty, nn.Module):
            raise ValueError(f"uncertainty must be None or a LearnedUncertainty, got {type(uncertainty).__name__}")
        self.unet = unet
        self.uncertainty = uncertainty
        self.sigma_data = check_sigma("sigma_data", sigma_data)

    def forward(
        self,
        sample: torch.Tensor,
        sigma: torch.Tensor | float,
        class_labels: torch.Tensor | None = None,
        return_logvar: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        denoised = edm_precondition(self.unet, sample, sigma, class_labels, self.sigma_data)
        if not return_logvar:
            return denoised
        sigma = _sigma_tensor(sigma, sample).expand(sample.shape[0], 1, 1, 1)
        if self.uncertainty is None:
            return denoised, torch.zeros_like(sigma)
        return denoised, self.uncertainty(edm_c_noise(sigma.flatten()))

    def components(self) -> dict[str, nn.Module]:
        """The diffusers models inside, by folder name: ``unet`` and, when present, ``uncertainty``."""
        found = {"unet": self.unet}
        if self.uncertainty is not None:
            found["uncertainty"] = self.uncertainty
        return found

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs) -> None:
        """The one save format of a preconditioner: ``unet/`` and ``uncertainty/`` as diffusers model folders, plus
        ``preconditioner_config.json`` (``sigma_data`` and the UNet's class name)."""
        os.makedirs(save_directory, exist_ok=True)
        for name, component in self.components().items():
            component.save_pretrained(os.path.join(save_directory, name), **kwargs)
        config = {"sigma_data": self.sigma_data, "unet_class": type(self.unet).__name__}
        atomic_write_text(os.path.join(save_directory, PRECONDITIONER_CONFIG), json.dumps(config, indent=2))

    @staticmethod
    def read_config(directory: str | os.PathLike) -> dict:
        """``preconditioner_config.json`` of a folder written by :meth:`save_pretrained`."""
        config_path = os.path.join(directory, PRECONDITIONER_CONFIG)
        if not os.path.isfile(config_path):
            raise ValueError(f"{config_path} not found: not a folder written by EDMPreconditioner.save_pretrained")
        with open(config_path) as handle:
            return json.load(handle)

    def load_weights(self, directory: str | os.PathLike) -> None:
        """Load the weights of a :meth:`save_pretrained` folder into this preconditioner in place (safetensors only),
        after checking that it was saved with the same UNet class and ``sigma_data``."""
        config = self.read_config(directory)
        saved = (config.get("unet_class"), float(config["sigma_data"]))
        if saved != (type(self.unet).__name__, self.sigma_data):
            raise ValueError(
                f"{directory} holds a preconditioner of {saved[0]} with sigma_data={saved[1]}, but this one wraps "
                f"{type(self.unet).__name__} with sigma_data={self.sigma_data}"
            )
        for name, component in self.components().items():
            path = os.path.join(directory, name)
            if not os.path.isdir(path):
                raise ValueError(f"{directory} has no {name}/ folder")
            loaded = type(component).from_pretrained(path, low_cpu_mem_usage=False)
            component.load_state_dict(loaded.state_dict())

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, **kwargs) -> "EDMPreconditioner":
        """Load what :meth:`save_pretrained` wrote; the UNet class is the one its config names (a model of this
        package or of diffusers). ``kwargs`` go to both loaders."""
        from ..models.pretrained import model_class_by_name

        config = cls.read_config(directory)
        unet_class = model_class_by_name(config.get("unet_class", "EDM2UNet2DModel"))
        unet = unet_class.from_pretrained(os.path.join(directory, "unet"), **kwargs)
        uncertainty_dir = os.path.join(directory, "uncertainty")
        uncertainty = (
            LearnedUncertainty.from_pretrained(uncertainty_dir, **kwargs) if os.path.isdir(uncertainty_dir) else None
        )
        return cls(unet, uncertainty, sigma_data=config["sigma_data"])
