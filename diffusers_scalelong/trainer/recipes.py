"""Training recipes: the loss of one batch, the pipeline a trained UNet is saved in, and quick sampling for grids."""

import diffusers
import torch
import torch.nn.functional as F
from diffusers import DDIMPipeline, DDIMScheduler, DDPMPipeline
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from diffusers.training_utils import compute_snr

RECIPES = ("ddpm", "edm2")


def make_noise_scheduler(
    name: str, num_train_timesteps: int, beta_schedule: str, prediction_type: str
) -> SchedulerMixin:
    """A diffusers noise scheduler by class name (any with ``add_noise`` over discrete training timesteps)."""
    cls = getattr(diffusers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, SchedulerMixin) and hasattr(cls, "add_noise")):
        raise ValueError(
            f"--noise_scheduler {name!r} is not a diffusers noise scheduler with add_noise (e.g. DDPMScheduler)"
        )
    try:
        return cls(
            num_train_timesteps=num_train_timesteps, beta_schedule=beta_schedule, prediction_type=prediction_type
        )
    except (TypeError, ValueError, NotImplementedError) as error:
        raise ValueError(f"--noise_scheduler {name}: {error}") from error


def images_from_numpy(array) -> torch.Tensor:
    """Pipeline output ``output_type="np"`` ([N, H, W, C] in [0, 1]) -> tensor [N, C, H, W] in [-1, 1]."""
    return torch.from_numpy(array).permute(0, 3, 1, 2).float() * 2 - 1


class DDPMRecipe:
    """Denoising diffusion (Ho et al. 2020): ``x_t = sqrt(a_t) x_0 + sqrt(1 - a_t) n`` with uniform integer ``t``,
    loss ``|| F(x_t, t) - target ||^2`` where the target is ``n`` (epsilon) or ``sqrt(a_t) n - sqrt(1 - a_t) x_0`` (v).

    ``snr_gamma``: Min-SNR weighting (Hang et al. 2023, as diffusers' example scripts): each image's loss is weighted
    by ``min(SNR_t, gamma) / SNR_t`` (epsilon) or ``min(SNR_t, gamma) / (SNR_t + 1)`` (v), ``SNR_t = a_t / (1 - a_t)``.
    ``noise_offset``: the noise is ``n + noise_offset * m`` with ``m ~ N(0, 1)`` per image and channel (a shift of
    the noise mean, as diffusers' ``--noise_offset``).
    """

    name = "ddpm"

    def __init__(self, noise_scheduler: SchedulerMixin, snr_gamma: float | None = None, noise_offset: float = 0.0):
        if snr_gamma is not None and not snr_gamma > 0:
            raise ValueError(f"--snr_gamma must be positive, got {snr_gamma}")
        if not noise_offset >= 0:
            raise ValueError(f"--noise_offset must be >= 0, got {noise_offset}")
        self.noise_scheduler = noise_scheduler
        self.snr_gamma = snr_gamma
        self.noise_offset = noise_offset

    def draw_noise(self, images: torch.Tensor) -> torch.Tensor:
        """Standard normal noise like ``images``, plus ``noise_offset`` times one normal value per image and channel."""
        noise = torch.randn_like(images)
        if self.noise_offset:
            noise += self.noise_offset * torch.randn(images.shape[:2] + (1,) * (images.ndim - 2), device=images.device)
        return noise

    def loss_weights(self, timesteps: torch.Tensor) -> torch.Tensor:
        """Min-SNR weight of each image's mean squared error (1 without ``snr_gamma``)."""
        if self.snr_gamma is None:
            return torch.ones(timesteps.shape, device=timesteps.device)
        snr = compute_snr(self.noise_scheduler, timesteps)
        clipped = snr.clamp(max=self.snr_gamma)
        if self.noise_scheduler.config.prediction_type == "v_prediction":
            return clipped / (snr + 1)
        return clipped / snr

    def loss(
        self, model: torch.nn.Module, images: torch.Tensor, class_labels: torch.Tensor | None = None, **model_kwargs
    ) -> torch.Tensor:
        """Mean squared error of the prediction; ``model_kwargs`` (e.g. ``encoder_hidden_states``) go to the model."""
        if class_labels is not None:
            model_kwargs["class_labels"] = class_labels
        noise = self.draw_noise(images)
        steps = self.noise_scheduler.config.num_train_timesteps
        timesteps = torch.randint(0, steps, (images.shape[0],), device=images.device)
        noisy = self.noise_scheduler.add_noise(images, noise, timesteps)
        prediction = model(noisy, timesteps, **model_kwargs).sample
        if self.noise_scheduler.config.prediction_type == "v_prediction":
            target = self.noise_scheduler.get_velocity(images, noise, timesteps)
        else:
            target = noise
        if self.snr_gamma is None:
            return F.mse_loss(prediction.float(), target.float())
        per_image = F.mse_loss(prediction.float(), target.float(), reduction="none").flatten(1).mean(1)
        return (per_image * self.loss_weights(timesteps)).mean()

    def wrap(self, unet: torch.nn.Module) -> torch.nn.Module:
        """The module that is trained: the UNet itself."""
        return unet

    def pipeline(self, unet: torch.nn.Module) -> DDPMPipeline:
        return DDPMPipeline(unet=unet, scheduler=self.noise_scheduler)

    @torch.no_grad()
    def sample(self, unet: torch.nn.Module, num_images: int, seed: int, num_inference_steps: int) -> torch.Tensor:
        """Images in [-1, 1] from DDIM (deterministic, ``num_inference_steps`` steps) with a private generator."""
        sampler = DDIMPipeline(unet=unet, scheduler=DDIMScheduler.from_config(self.noise_scheduler.config))
        sampler.set_progress_bar_config(disable=True)
        generator = torch.Generator(device="cpu").manual_seed(seed)
        output = sampler(
            batch_size=num_images, generator=generator, num_inference_steps=num_inference_steps, output_type="np"
        )
        return images_from_numpy(output.images)


class EDM2Recipe:
    """EDM2 (Karras et al. 2024): ``ln sigma ~ N(P_mean, P_std^2)``, EDM preconditioning around the raw UNet ``F``,
    loss ``(w(sigma) / exp(u(sigma))) ||D(y + n; sigma) - y||^2 + u(sigma)`` with a learned uncertainty ``u``.

    The module that is trained is ``EDMPreconditioner(unet, LearnedUncertainty)`` (a given ``uncertainty`` head, e.g.
    an imported network's, or a new one); the pipeline holds the UNet, an EDM sampler (the preconditioning lives in
    the scheduler) and, for latent models, the ``vae`` working in ``vae_pixel_range``.
    """

    name = "edm2"

    def __init__(
        self,
        P_mean: float = -0.8,
        P_std: float = 1.6,
        sigma_data: float = 0.5,
        logvar_channels: int = 128,
        uncertainty: torch.nn.Module | None = None,
        vae: torch.nn.Module | None = None,
        vae_pixel_range: str = "[-1, 1]",
    ):
        from ..edm2 import EDM2Loss

        self.loss_fn = EDM2Loss(P_mean=P_mean, P_std=P_std, sigma_data=sigma_data)
        self.sigma_data = sigma_data
        self.logvar_channels = logvar_channels
        self.uncertainty = uncertainty
        self.vae = vae
        self.vae_pixel_range = vae_pixel_range

    def wrap(self, unet: torch.nn.Module) -> torch.nn.Module:
        from ..edm2 import EDMPreconditioner, LearnedUncertainty

        uncertainty = self.uncertainty if self.uncertainty is not None else LearnedUncertainty(self.logvar_channels)
        return EDMPreconditioner(unet, uncertainty, sigma_data=self.sigma_data)

    def loss(
        self, denoiser: torch.nn.Module, images: torch.Tensor, class_labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The EDM2 loss of ``denoiser`` (possibly wrapped for data parallelism, which hides ``sigma_data``)."""
        return self.loss_fn(denoiser, images, class_labels).loss

    def scheduler(self):
        from ..schedulers import EDMHeunScheduler

        return EDMHeunScheduler(sigma_data=self.sigma_data)

    def pipeline(self, unet: torch.nn.Module):
        from ..pipelines import EDM2Pipeline

        return EDM2Pipeline(unet=unet, scheduler=self.scheduler(), vae=self.vae, vae_pixel_range=self.vae_pixel_range)

    @torch.no_grad()
    def sample(self, unet: torch.nn.Module, num_images: int, seed: int, num_inference_steps: int) -> torch.Tensor:
        """Images in [-1, 1] from the deterministic EDM Heun sampler with a private generator."""
        sampler = self.pipeline(unet)
        sampler.set_progress_bar_config(disable=True)
        generator = torch.Generator(device="cpu").manual_seed(seed)
        output = sampler(
            batch_size=num_images, generator=generator, num_inference_steps=num_inference_steps, output_type="np"
        )
        return images_from_numpy(output.images)
