"""Training recipes, each in one place: the loss of a batch, the lr schedule, the pipeline a trained UNet is saved in,
its sampler for grids, and the :class:`~diffusers_scalelong.trainer.trainer.TrainingJob` that ties them to a UNet."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import diffusers
import torch
import torch.nn.functional as F
from diffusers import DDIMPipeline, DDIMScheduler, DDPMPipeline
from diffusers.optimization import get_scheduler
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from diffusers.training_utils import compute_snr

from .image_grid import SampleGrid
from .trainer import TrainingJob

RECIPES = ("ddpm", "edm2")


def make_noise_scheduler(
    name: str, num_train_timesteps: int, beta_schedule: str, prediction_type: str
) -> SchedulerMixin:
    """A diffusers noise scheduler by class name (any with ``add_noise`` over discrete training timesteps)."""
    cls = getattr(diffusers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, SchedulerMixin) and hasattr(cls, "add_noise")):
        raise ValueError(
            f"noise_scheduler {name!r} is not a diffusers noise scheduler with add_noise (e.g. DDPMScheduler)"
        )
    try:
        return cls(
            num_train_timesteps=num_train_timesteps, beta_schedule=beta_schedule, prediction_type=prediction_type
        )
    except (TypeError, ValueError, NotImplementedError) as error:
        raise ValueError(f"noise_scheduler {name}: {error}") from error


def images_from_numpy(array) -> torch.Tensor:
    """Pipeline output ``output_type="np"`` ([N, H, W, C] in [0, 1]) -> tensor [N, C, H, W] in [-1, 1]."""
    return torch.from_numpy(array).permute(0, 3, 1, 2).float() * 2 - 1


def sample_rows(
    pipeline, rows: list[dict], num_images: int, seed: int, num_inference_steps: int, **call_kwargs
) -> list[torch.Tensor]:
    """One batch of ``num_images`` per entry of ``rows`` (extra pipeline arguments of that row: class labels, a
    prompt), every row from the same noise (``seed``), as tensors in [-1, 1]."""
    pipeline.set_progress_bar_config(disable=True)
    images = []
    for row in rows:
        output = pipeline(
            **row,
            generator=torch.Generator(device="cpu").manual_seed(seed),
            num_inference_steps=num_inference_steps,
            output_type="np",
            **call_kwargs,
        )
        images.append(images_from_numpy(output.images))
    return images


class Recipe:
    """What the recipes share: the grid sampler (one batch, or a row per class) and the job they make of a UNet."""

    name = ""

    def wrap(self, unet: torch.nn.Module) -> torch.nn.Module:
        """The module that is trained: the UNet itself."""
        return unet

    def pipeline(self, unet: torch.nn.Module):
        raise NotImplementedError

    def sampling_pipeline(self, unet: torch.nn.Module):
        """The pipeline that draws the grids (the saved pipeline unless a recipe samples differently)."""
        return self.pipeline(unet)

    @torch.no_grad()
    def sample(self, unet: torch.nn.Module, num_images: int, seed: int, num_inference_steps: int) -> torch.Tensor:
        """``num_images`` images in [-1, 1] from the recipe's deterministic sampler with a private generator."""
        pipeline = self.sampling_pipeline(unet)
        return sample_rows(pipeline, [dict(batch_size=num_images)], num_images, seed, num_inference_steps)[0]

    def grid_sampler(self, class_names: list[str] | None) -> Callable[..., SampleGrid]:
        """The sample-grid function: one batch, or for a class-conditional model one row per class, every row from
        the same noise."""
        if class_names is None:
            return lambda *args: SampleGrid(self.sample(*args))

        @torch.no_grad()
        def sample(unet, num_images: int, seed: int, num_inference_steps: int) -> SampleGrid:
            rows = [dict(class_labels=[label] * num_images) for label in range(len(class_names))]
            images = sample_rows(self.pipeline(unet), rows, num_images, seed, num_inference_steps)
            return SampleGrid.from_rows(images, class_names, tag="test_samples")

        return sample

    def job(
        self,
        unet: torch.nn.Module,
        dataset,
        model_input: Callable[[dict], torch.Tensor],
        class_names: list[str] | None = None,
        frozen: list | None = None,
        tracker_name: str = "train",
        base_model: str | None = None,
        dataset_name: str | None = None,
        prepare_data: Callable[[], object] | None = None,
    ) -> TrainingJob:
        """The :class:`TrainingJob` of ``unet`` on ``dataset``, whose batches give the images (or latents) through
        ``model_input`` and their class labels as ``class_labels``."""
        return TrainingJob(
            module=self.wrap(unet),
            unet=unet,
            dataset=dataset,
            loss=lambda trained, batch: self.loss(trained, model_input(batch), batch.get("class_labels")),
            make_lr_scheduler=self.lr_scheduler,
            make_pipeline=self.pipeline,
            sample=self.grid_sampler(class_names),
            frozen=frozen or [],
            zero_nonfinite_grads=self.name == "edm2",
            tracker_name=tracker_name,
            description=f"recipe {self.name}",
            save_extras=self.save_extras,
            base_model=base_model,
            dataset_name=dataset_name,
            prepare_data=prepare_data,
        )

    def save_extras(self, folder: Path, unet: torch.nn.Module, module: torch.nn.Module) -> None:
        """Write what the final pipeline folder holds besides the pipeline of ``unet`` (``module``: the whole trained
        module); nothing for this recipe."""


class DDPMRecipe(Recipe):
    """Denoising diffusion (Ho et al. 2020): ``x_t = sqrt(a_t) x_0 + sqrt(1 - a_t) n`` with uniform integer ``t``,
    loss ``|| F(x_t, t) - target ||^2`` where the target is ``n`` (epsilon), ``sqrt(a_t) n - sqrt(1 - a_t) x_0``
    (v) or ``x_0`` (sample).

    ``snr_gamma``: Min-SNR weighting (Hang et al. 2023, as diffusers' example scripts): each image's loss is weighted
    by ``min(SNR_t, gamma) / SNR_t`` (epsilon), ``min(SNR_t, gamma) / (SNR_t + 1)`` (v) or ``min(SNR_t, gamma)``
    (sample), ``SNR_t = a_t / (1 - a_t)``. ``noise_offset``: the noise is ``n + noise_offset * m`` with
    ``m ~ N(0, 1)`` per image and channel (a shift of the noise mean, as diffusers' ``noise_offset``).
    ``input_perturbation``: the network sees ``x_t`` made with ``n + input_perturbation * m`` (``m ~ N(0, 1)``) while
    the target keeps ``n`` (Ning et al. 2023, diffusers' ``--input_perturbation``). ``lr_scheduler``,
    ``lr_warmup_steps``: diffusers' ``get_scheduler`` over the run's steps.
    """

    name = "ddpm"

    def __init__(
        self,
        noise_scheduler: SchedulerMixin,
        snr_gamma: float | None = None,
        noise_offset: float = 0.0,
        lr_scheduler: str = "constant",
        lr_warmup_steps: int = 0,
        input_perturbation: float = 0.0,
    ):
        if snr_gamma is not None and not snr_gamma > 0:
            raise ValueError(f"snr_gamma must be positive, got {snr_gamma}")
        if not noise_offset >= 0:
            raise ValueError(f"noise_offset must be >= 0, got {noise_offset}")
        self.noise_scheduler = noise_scheduler
        self.snr_gamma = snr_gamma
        self.noise_offset = noise_offset
        if not input_perturbation >= 0:
            raise ValueError(f"input_perturbation must be >= 0, got {input_perturbation}")
        self.lr_scheduler_name = lr_scheduler
        self.lr_warmup_steps = lr_warmup_steps
        self.input_perturbation = input_perturbation

    def lr_scheduler(self, optimizer: torch.optim.Optimizer, max_steps: int):
        try:
            return get_scheduler(
                self.lr_scheduler_name, optimizer, num_warmup_steps=self.lr_warmup_steps, num_training_steps=max_steps
            )
        except ValueError as error:
            raise ValueError(f"lr_scheduler {self.lr_scheduler_name!r}: {error}") from error

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
        prediction_type = self.noise_scheduler.config.prediction_type
        if prediction_type == "v_prediction":
            return clipped / (snr + 1)
        return clipped if prediction_type == "sample" else clipped / snr

    def loss(
        self, model: torch.nn.Module, images: torch.Tensor, class_labels: torch.Tensor | None = None, **model_kwargs
    ) -> torch.Tensor:
        """Mean squared error of the prediction; ``model_kwargs`` (e.g. ``encoder_hidden_states``) go to the model."""
        if class_labels is not None:
            model_kwargs["class_labels"] = class_labels
        noise = self.draw_noise(images)
        steps = self.noise_scheduler.config.num_train_timesteps
        timesteps = torch.randint(0, steps, (images.shape[0],), device=images.device)
        perturbed = noise + self.input_perturbation * torch.randn_like(noise) if self.input_perturbation else noise
        noisy = self.noise_scheduler.add_noise(images, perturbed, timesteps)
        prediction = model(noisy, timesteps, **model_kwargs).sample
        target = {
            "v_prediction": lambda: self.noise_scheduler.get_velocity(images, noise, timesteps),
            "sample": lambda: images,
        }.get(self.noise_scheduler.config.prediction_type, lambda: noise)()
        if self.snr_gamma is None:
            return F.mse_loss(prediction.float(), target.float())
        per_image = F.mse_loss(prediction.float(), target.float(), reduction="none").flatten(1).mean(1)
        return (per_image * self.loss_weights(timesteps)).mean()

    def pipeline(self, unet: torch.nn.Module) -> DDPMPipeline:
        return DDPMPipeline(unet=unet, scheduler=self.noise_scheduler)

    def sampling_pipeline(self, unet: torch.nn.Module) -> DDIMPipeline:
        """Grids come from DDIM (deterministic, few steps) with the training scheduler's configuration."""
        return DDIMPipeline(unet=unet, scheduler=DDIMScheduler.from_config(self.noise_scheduler.config))


class EDM2Recipe(Recipe):
    """EDM2 (Karras et al. 2024): ``ln sigma ~ N(P_mean, P_std^2)``, EDM preconditioning around the raw UNet ``F``,
    loss ``(w(sigma) / exp(u(sigma))) ||D(y + n; sigma) - y||^2 + u(sigma)`` with a learned uncertainty ``u``, and
    the inverse-square-root lr (``lr_ref_steps``, ``lr_warmup_steps``).

    The module that is trained is ``EDMPreconditioner(unet, LearnedUncertainty)`` (a given ``uncertainty`` head, e.g.
    a pretrained pipeline's, or a new one); the pipeline holds the UNet, an EDM sampler (the preconditioning lives in
    the scheduler) and, for latent models, the ``vae`` working in ``vae_pixel_range``. The final pipeline folder also
    holds the preconditioner's files (``uncertainty/``, ``preconditioner_config.json``), so that fine-tuning from it
    continues the uncertainty head with its ``sigma_data``.
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
        lr_ref_steps: int = 35_000,
        lr_warmup_steps: int = 0,
    ):
        from ..edm2 import EDM2Loss, inverse_sqrt_lr_lambda

        self.loss_fn = EDM2Loss(P_mean=P_mean, P_std=P_std, sigma_data=sigma_data)
        self.lr_lambda = inverse_sqrt_lr_lambda(lr_ref_steps, lr_warmup_steps)
        self.sigma_data = sigma_data
        self.logvar_channels = logvar_channels
        self.uncertainty = uncertainty
        self.vae = vae
        self.vae_pixel_range = vae_pixel_range

    def lr_scheduler(self, optimizer: torch.optim.Optimizer, max_steps: int):
        """Inverse-square-root decay (it needs no step count)."""
        return torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_lambda)

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

    def save_extras(self, folder: Path, unet: torch.nn.Module, module: torch.nn.Module) -> None:
        """The preconditioner beside the pipeline, as the EDM2 converter writes it: the saved ``unet``, the trained
        uncertainty head of ``module`` and its ``sigma_data``."""
        from ..edm2 import EDMPreconditioner

        EDMPreconditioner(unet, module.uncertainty, sigma_data=module.sigma_data).save_pretrained(folder)
