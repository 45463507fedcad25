"""EDM2Pipeline: sampling with an EDM-preconditioned network F and any of the EDM schedulers.

The network is the raw F of EDM/EDM2 (``EDM2UNet2DModel``, or any UNet whose timestep input is
``c_noise = ln(sigma)/4``); the scheduler applies the preconditioning ``D = c_skip x + c_out F(c_in x, c_noise)``.
Guidance with a second network: ``D_w = D_g + w (D - D_g)``. Both denoisers share ``c_skip x`` and ``c_out``, so this
equals preconditioning ``F_w = F_g + w (F - F_g)``, which is what the pipeline passes to the scheduler.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from contextlib import ExitStack

import torch
from diffusers import (
    AutoencoderKL,
    DiffusionPipeline,
    EDMDPMSolverMultistepScheduler,
    EDMEulerScheduler,
    ImagePipelineOutput,
    ModelMixin,
)
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from diffusers.image_processor import VaeImageProcessor
from diffusers.utils.torch_utils import randn_tensor

from ..layers import cached_weight_normalization
from ..schedulers import EDMHeunScheduler
from ..validation import SIGMA_RANGE, check_number, check_sigma
from .latent_scaling import VAE_PIXEL_RANGES, check_latent_scaling, denormalize_latents, from_vae_range

EDM_SCHEDULERS = (EDMHeunScheduler, EDMEulerScheduler, EDMDPMSolverMultistepScheduler)


class EDM2Pipeline(DiffusionPipeline):
    """Unconditional or class-conditional image generation with EDM/EDM2 networks.

    Args:
        unet: the raw network F, called as ``unet(c_in x, c_noise, class_labels=...)``; class-conditional when
            ``unet.config.num_class_embeds`` is set.
        scheduler: `EDMHeunScheduler` (EDM's sampler), `EDMEulerScheduler` or `EDMDPMSolverMultistepScheduler`.
        vae: optional `AutoencoderKL` for latent models. Latents are decoded with the per-channel scaling in the
            VAE's config: ``z = x * latents_std / scaling_factor + latents_mean`` (see `set_edm2_latent_scaling`),
            or ``z = x / scaling_factor`` when the VAE has no per-channel statistics.
        guide_unet: optional guiding network for ``D_g + w (D - D_g)``: an unconditional network
            (``num_class_embeds`` unset: classifier-free guidance) or a smaller / less-trained version of `unet`
            (autoguidance).
        default_guidance_scale: the guidance weight w used when a call gives none (saved in ``model_index.json``,
            e.g. the weight a released model pair was tuned with); values other than 1 need `guide_unet`.
        vae_pixel_range: the pixel range of the VAE's images: ``"[-1, 1]"`` (diffusers' convention, default) or
            ``"[0, 1]"`` (EDM2's released latent models, whose encoder saw pixels / 255); decoded images are mapped
            from it to [-1, 1].
    """

    model_cpu_offload_seq = "guide_unet->unet->vae"
    _optional_components = ["vae", "guide_unet"]
    _callback_tensor_inputs = ["latents", "class_labels"]

    def __init__(
        self,
        unet: ModelMixin,
        scheduler: EDMHeunScheduler | EDMEulerScheduler | EDMDPMSolverMultistepScheduler,
        vae: AutoencoderKL | None = None,
        guide_unet: ModelMixin | None = None,
        default_guidance_scale: float = 1.0,
        vae_pixel_range: str = "[-1, 1]",
    ) -> None:
        super().__init__()
        self._check_components(unet, scheduler, vae, guide_unet)
        if default_guidance_scale != 1.0 and guide_unet is None:
            raise ValueError(f"default_guidance_scale={default_guidance_scale} needs a guide_unet")
        if vae_pixel_range not in VAE_PIXEL_RANGES:
            raise ValueError(f"vae_pixel_range must be one of {list(VAE_PIXEL_RANGES)}, got {vae_pixel_range!r}")
        self.register_modules(unet=unet, scheduler=scheduler, vae=vae, guide_unet=guide_unet)
        self.register_to_config(default_guidance_scale=float(default_guidance_scale), vae_pixel_range=vae_pixel_range)
        vae_scale = 2 ** (len(vae.config.block_out_channels) - 1) if vae is not None else 1
        self.image_processor = VaeImageProcessor(vae_scale_factor=vae_scale, do_normalize=True)

    @staticmethod
    def _check_components(unet, scheduler, vae, guide_unet) -> None:
        if not isinstance(scheduler, EDM_SCHEDULERS):
            names = ", ".join(cls.__name__ for cls in EDM_SCHEDULERS)
            raise ValueError(
                f"scheduler must be an EDM-family scheduler ({names}) whose timesteps are c_noise values and which "
                f"applies the EDM preconditioning; got {type(scheduler).__name__}. Convert a compatible config with "
                "EDMHeunScheduler.from_config(scheduler.config)."
            )
        for key in ("sigma_min", "sigma_max", "sigma_data"):  # diffusers' EDM schedulers take any float here
            check_sigma(f"scheduler.config.{key}", scheduler.config[key])
        out_channels = getattr(unet.config, "out_channels", None) or unet.config.in_channels
        if out_channels != unet.config.in_channels:
            raise ValueError(
                f"unet must map a sample to the same channels (F-prediction), got in_channels="
                f"{unet.config.in_channels}, out_channels={out_channels}"
            )
        if vae is not None:
            channels = vae.config.latent_channels
            if channels != unet.config.in_channels:
                raise ValueError(
                    f"the VAE's latent_channels ({channels}) do not match the unet's in_channels "
                    f"({unet.config.in_channels})"
                )
            for key in ("latents_mean", "latents_std"):
                values = getattr(vae.config, key, None)
                if values is not None and len(values) != channels:
                    raise ValueError(f"vae.config.{key} has {len(values)} values, the VAE has {channels} channels")
        if guide_unet is not None:
            for key in ("in_channels", "out_channels", "sample_size"):
                if getattr(guide_unet.config, key) != getattr(unet.config, key):
                    raise ValueError(
                        f"guide_unet.config.{key} ({getattr(guide_unet.config, key)}) differs from "
                        f"unet.config.{key} ({getattr(unet.config, key)})"
                    )

    @property
    def num_classes(self) -> int | None:
        """Number of classes of a class-conditional `unet`, None when it is unconditional."""
        return getattr(self.unet.config, "num_class_embeds", None)

    @property
    def num_timesteps(self) -> int:
        """Network evaluations of the last call (entries of the scheduler's `timesteps`)."""
        return self._num_timesteps

    @property
    def guidance_scale(self) -> float:
        """The guidance weight w of the running call, read at every step: a callback may change it between steps
        through ``pipeline._guidance_scale`` (as diffusers' guidance cut-off callbacks do)."""
        return self._guidance_scale

    @property
    def do_guidance(self) -> bool:
        """Whether the current step evaluates `guide_unet`: only when ``guidance_scale != 1``."""
        return self._guidance_scale != 1.0

    @property
    def interrupt(self) -> bool:
        """Set ``pipeline._interrupt = True`` (e.g. from a callback) to skip the remaining steps of the call."""
        return self._interrupt

    # ------------------------------------------------------------------ inputs
    def _prepare_class_labels(self, class_labels, batch_size: int | None, device) -> tuple[torch.Tensor | None, int]:
        num_classes = self.num_classes
        if num_classes is None:
            if class_labels is not None:
                raise ValueError("class_labels were given, but the unet is unconditional (num_class_embeds is None)")
            return None, 1 if batch_size is None else batch_size
        if class_labels is None:
            raise ValueError(
                f"the unet is class-conditional with {num_classes} classes: pass class_labels "
                "(an int or one label per image)"
            )
        labels = torch.as_tensor(class_labels).reshape(-1)
        if torch.is_floating_point(labels) or labels.dtype == torch.bool:
            raise ValueError(f"class_labels must be integers, got dtype {labels.dtype}")
        if labels.numel() == 1:
            labels = labels.expand(1 if batch_size is None else batch_size)
        elif batch_size is not None and labels.numel() != batch_size:
            raise ValueError(f"got {labels.numel()} class_labels for batch_size={batch_size}")
        if labels.min() < 0 or labels.max() >= num_classes:
            raise ValueError(f"class_labels must lie in [0, {num_classes - 1}], got {labels.tolist()}")
        return labels.to(device=device, dtype=torch.long), labels.numel()

    def _latent_shape(self, batch_size: int) -> tuple[int, ...]:
        size = self.unet.config.sample_size
        height, width = (size, size) if isinstance(size, int) else tuple(size)
        return (batch_size, self.unet.config.in_channels, height, width)

    def _network_output(self, unet, model_input, timestep, class_labels) -> torch.Tensor:
        conditional = getattr(unet.config, "num_class_embeds", None) is not None
        kwargs = {"class_labels": class_labels} if conditional else {}
        t = timestep.to(device=model_input.device, dtype=torch.float32).expand(model_input.shape[0])
        return unet(model_input.to(unet.dtype), t, **kwargs).sample.to(torch.float32)

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1] from normalised latents (:func:`~.latent_scaling.denormalize_latents`), the VAE's output
        mapped from ``vae_pixel_range`` to [-1, 1]."""
        z = denormalize_latents(latents, self.vae.config)
        images = self.vae.decode(z.to(self.vae.dtype)).sample
        return from_vae_range(images, self.config.get("vae_pixel_range", "[-1, 1]"))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs) -> EDM2Pipeline:
        """diffusers' ``from_pretrained``, with a clearer error for a Hub-layout repo loaded without
        ``trust_remote_code=True``."""
        try:
            return super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        except ValueError as error:
            if kwargs.get("trust_remote_code") or "trust_remote_code" not in str(error):
                raise
            raise ValueError(
                f"{pretrained_model_name_or_path} is in diffusers-scalelong's Hub layout: model_index.json names "
                "small code files in the repo that import the installed diffusers_scalelong package. Load it with "
                f"EDM2Pipeline.from_pretrained({str(pretrained_model_name_or_path)!r}, trust_remote_code=True) or "
                f"DiffusionPipeline.from_pretrained({str(pretrained_model_name_or_path)!r}, trust_remote_code=True)."
            ) from error

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def __call__(
        self,
        batch_size: int | None = None,
        class_labels: int | Sequence[int] | torch.Tensor | None = None,
        num_inference_steps: int = 32,
        guidance_scale: float | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
        callback_on_step_end: Callable[[DiffusionPipeline, int, torch.Tensor, dict], dict]
        | PipelineCallback
        | MultiPipelineCallbacks
        | None = None,
        callback_on_step_end_tensor_inputs: list[str] | None = None,
    ) -> ImagePipelineOutput | tuple:
        """Generate images.

        Args:
            batch_size: number of images (default: one per class label, or 1).
            class_labels: class of each image (an int applies to all); required iff the unet is class-conditional.
            num_inference_steps: sampler steps N (`EDMHeunScheduler`: 2N - 1 network evaluations; 32 is EDM2's).
            guidance_scale: w in ``D_g + w (D - D_g)``; values other than 1 need `guide_unet`. Default: the
                pipeline's ``default_guidance_scale`` (1 unless set).
            generator: random generator(s) for the initial noise and any scheduler noise (a list: one per image).
            latents: initial noise (unscaled, standard normal) instead of drawing it.
            output_type: ``"pil"``, ``"np"`` (float in [0, 1], NHWC), ``"pt"`` (float in [0, 1], NCHW) or ``"latent"``.
            return_dict: return an `ImagePipelineOutput` (True) or a tuple ``(images,)``.
            callback_on_step_end: ``f(pipeline, i, t, callback_kwargs) -> dict`` called after every scheduler step,
                or a diffusers ``PipelineCallback`` / ``MultiPipelineCallbacks``; returned tensors replace the
                pipeline's (e.g. ``{"latents": ...}``). It may set ``pipeline._guidance_scale`` (read at every step:
                the guide network runs only while it differs from 1) or ``pipeline._interrupt``.
            callback_on_step_end_tensor_inputs: names passed in ``callback_kwargs`` (subset of
                ``["latents", "class_labels"]``; default ``["latents"]``); a ``PipelineCallback`` brings its own
                ``tensor_inputs``.

        Examples:
            >>> import torch
            >>> from diffusers_scalelong import EDM2Pipeline, EDM2UNet2DModel, EDMHeunScheduler
            >>> unet = EDM2UNet2DModel(
            ...     sample_size=8, in_channels=1, model_channels=8, channel_mult=(1, 2), layers_per_block=1, num_class_embeds=3,
            ...     channels_per_head=8,
            ... )
            >>> pipe = EDM2Pipeline(unet=unet, scheduler=EDMHeunScheduler())
            >>> pipe.set_progress_bar_config(disable=True)
            >>> images = pipe(
            ...     class_labels=[0, 2], num_inference_steps=3, generator=torch.manual_seed(0), output_type="pt"
            ... ).images
            >>> images.shape  # one image per class label, in [0, 1]
            torch.Size([2, 1, 8, 8])
            >>> bool(images.min() >= 0 and images.max() <= 1)
            True
        """
        if isinstance(callback_on_step_end, PipelineCallback | MultiPipelineCallbacks):
            callback_on_step_end_tensor_inputs = callback_on_step_end.tensor_inputs
        if callback_on_step_end_tensor_inputs is None:
            callback_on_step_end_tensor_inputs = ["latents"]
        if guidance_scale is None:
            guidance_scale = self.config.get("default_guidance_scale", 1.0)
        self._check_call(
            batch_size, num_inference_steps, guidance_scale, output_type, callback_on_step_end_tensor_inputs
        )
        self._guidance_scale = guidance_scale
        self._interrupt = False
        device = self._execution_device
        class_labels, batch_size = self._prepare_class_labels(class_labels, batch_size, device)
        if isinstance(generator, list) and len(generator) != batch_size:
            raise ValueError(f"got {len(generator)} generators for {batch_size} images")

        self.scheduler.set_timesteps(num_inference_steps, device=device)
        timesteps = self.scheduler.timesteps
        self._check_schedule()
        shape = self._latent_shape(batch_size)
        if latents is None:
            latents = randn_tensor(shape, generator=generator, device=device, dtype=torch.float32)
        else:
            self._check_latents(latents, shape)
        latents = latents.to(device=device, dtype=torch.float32) * self.scheduler.init_noise_sigma

        self._num_timesteps = len(timesteps)
        finite_steps: dict[int, torch.Tensor] = {}  # step -> (network output finite, latents finite)
        # The networks' normalised weights are computed once per call, not once per evaluation (MPConv layers).
        with ExitStack() as weight_caches:
            for network in {id(n): n for n in (self.unet, self.guide_unet) if n is not None}.values():
                weight_caches.enter_context(cached_weight_normalization(network))
            for i, t in enumerate(self.progress_bar(timesteps)):
                if self.interrupt:
                    continue
                model_input = self.scheduler.scale_model_input(latents, t)
                output = self._network_output(self.unet, model_input, t, class_labels)
                if self.do_guidance:
                    if self.guide_unet is None:
                        raise ValueError(
                            f"guidance_scale={self.guidance_scale} (set during the call, before step {i}) needs a guide_unet"
                        )
                    check_number("guidance_scale", self.guidance_scale)
                    guide = self._network_output(self.guide_unet, model_input, t, class_labels)
                    output = guide + self.guidance_scale * (output - guide)
                latents = self.scheduler.step(output, t, latents, generator=generator).prev_sample.to(torch.float32)
                # read once after the loop (no synchronisation per step): were the output and the new latents finite?
                finite_steps[i] = torch.stack([output.isfinite().all(), latents.isfinite().all()])
                if callback_on_step_end is not None:
                    callback_kwargs = {}
                    for name in callback_on_step_end_tensor_inputs:
                        callback_kwargs[name] = locals()[name]
                    callback_outputs = callback_on_step_end(self, i, t, callback_kwargs)
                    latents = callback_outputs.pop("latents", latents)
                    class_labels = callback_outputs.pop("class_labels", class_labels)

        self._check_finite_latents(latents, finite_steps, timesteps)
        if output_type == "latent":
            images = latents
        else:
            images = self.decode_latents(latents) if self.vae is not None else latents
            if self.vae is not None and not bool(images.isfinite().all()):
                raise ValueError(
                    "the VAE decoded NaN or inf from finite latents: its weights hold NaN or inf, or it overflows in "
                    f"{self.vae.dtype} (decode in float32: vae.to(torch.float32))"
                )
            images = self.image_processor.postprocess(images.float(), output_type=output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (images,)
        return ImagePipelineOutput(images=images)

    def _check_call(self, batch_size, num_inference_steps, guidance_scale, output_type, tensor_inputs) -> None:
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if not isinstance(num_inference_steps, int) or num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be a positive integer, got {num_inference_steps!r}")
        check_number("guidance_scale", guidance_scale)
        if guidance_scale != 1.0 and self.guide_unet is None:
            raise ValueError(
                f"guidance_scale={guidance_scale} needs a guide network: load the pipeline with guide_unet= "
                "(an unconditional network for classifier-free guidance, or a smaller/less-trained one for "
                "autoguidance), or use guidance_scale=1.0"
            )
        if output_type not in ("pil", "np", "pt", "latent"):
            raise ValueError(f"output_type must be 'pil', 'np', 'pt' or 'latent', got {output_type!r}")
        unknown = [name for name in tensor_inputs if name not in self._callback_tensor_inputs]
        if unknown:
            raise ValueError(
                f"callback_on_step_end_tensor_inputs {unknown} are not available; choose from {self._callback_tensor_inputs}"
            )
        if self.vae is not None and output_type != "latent":
            self._check_latent_scaling()

    def _check_schedule(self) -> None:
        """The scheduler's noise levels and timesteps must be finite (diffusers' EDM schedulers compute them in
        float32 from whatever sigmas their config holds, e.g. a scheduler swapped in after construction)."""
        finite = bool(self.scheduler.timesteps.isfinite().all()) and bool(self.scheduler.sigmas.isfinite().all())
        if not (finite and math.isfinite(float(self.scheduler.init_noise_sigma))):
            config = self.scheduler.config
            raise ValueError(
                f"the scheduler's timesteps hold NaN or inf: scheduler.config.sigma_min={config.sigma_min} or "
                f"sigma_max={config.sigma_max} leaves float32's range (use sigmas in [{SIGMA_RANGE[0]:g}, {SIGMA_RANGE[1]:g}])"
            )

    def _check_latent_scaling(self) -> None:
        check_latent_scaling(self.vae.config)

    @staticmethod
    def _check_latents(latents: object, shape: tuple[int, ...]) -> None:
        """Given initial noise: a real tensor of ``shape``, every value finite."""
        if not isinstance(latents, torch.Tensor) or not latents.is_floating_point():
            raise ValueError(f"latents must be a float tensor of shape {shape}, got {latents!r:.80}")
        if tuple(latents.shape) != shape:
            raise ValueError(f"latents must have shape {shape}, got {tuple(latents.shape)}")
        if not bool(latents.isfinite().all()):
            raise ValueError("latents hold NaN or inf: pass standard normal noise (or None to draw it)")

    def _check_finite_latents(
        self, latents: torch.Tensor, finite_steps: dict[int, torch.Tensor], timesteps: torch.Tensor
    ) -> None:
        """Raise ``ValueError`` naming the likely cause when sampling ended in NaN or inf (black images otherwise)."""
        if bool(latents.isfinite().all()):
            return
        flags = {i: flag.tolist() for i, flag in finite_steps.items()}
        bad = [i for i, (_, latents_finite) in flags.items() if not latents_finite]
        if not bad:
            raise ValueError("sampling ended in NaN or inf latents: a callback_on_step_end returned them")
        step = bad[0]
        where = f"at step {step} of {len(timesteps)} (timestep {float(timesteps[step]):.4g})"
        if flags[step][0]:
            cause = (
                "from a finite network output, so the scheduler's update overflowed (check its sigma_min / "
                "sigma_max) or a callback_on_step_end returned them"
            )
        else:
            networks = [("unet", self.unet)] + ([("guide_unet", self.guide_unet)] if self.do_guidance else [])
            broken = [
                f"{owner}.{name}"
                for owner, network in networks
                for name, param in network.named_parameters()
                if not bool(param.isfinite().all())
            ]
            if broken:
                cause = f"the network's weights hold NaN or inf ({', '.join(broken[:3])})"
            else:
                cause = (
                    f"the network output was NaN or inf (guidance_scale={self.guidance_scale}; a network in "
                    f"{self.unet.dtype} may overflow: sample in float32)"
                )
        raise ValueError(f"sampling produced NaN or inf latents {where}: {cause}")
