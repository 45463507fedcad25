#!/usr/bin/env python
"""Fine-tune the UNet of a Stable-Diffusion-style pipeline on captioned images, with ScaleLong long-skip scaling.

The pipeline folder (or Hub repo) holds ``unet``, ``vae``, ``text_encoder``, ``tokenizer`` and ``scheduler``. The UNet
is loaded as ``ScaleLongUNet2DConditionModel`` with ``--lsc``/``--kappa`` (a CS fine-tune keeps diffusers' parameter
names); VAE and text encoder stay frozen. Loss: the noise scheduler's epsilon (or v) prediction on VAE latents.
Same Accelerate, EMA, checkpoint, exact-resume and Hub options as ``scalelong-train``.

The script reads top to bottom: the options (:class:`TextToImageConfig`), then :func:`build_job` (the pipeline's
components, data, UNet: every check, nothing written), then the shared :class:`~diffusers_scalelong.trainer.Trainer`.

Example::

    accelerate launch -m diffusers_scalelong.training_scripts.train_text_to_image \
        --pretrained_model_name_or_path ./my-sd-pipeline --train_data_dir ./captioned_images --resolution 512 \
        --lsc cs --kappa 0.8 --output_dir out --max_train_steps 1000 --ema_sigma_rels 0.05 0.10 --snapshot_every 250
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

import diffusers
import torch
from accelerate.utils import set_seed
from diffusers import AutoencoderKL, StableDiffusionPipeline

from diffusers_scalelong.data import ImageTransform
from diffusers_scalelong.sources import fetch_file
from diffusers_scalelong.trainer import (
    CaptionedImages,
    DDPMLossOptions,
    DDPMRecipe,
    PretrainedModelOptions,
    SampleGrid,
    Trainer,
    TrainingConfig,
    TrainingJob,
    load_captioned_dataset,
    load_pretrained,
    load_pretrained_unet,
    option,
    run_and_exit,
    sample_rows,
    script_main,
)
from diffusers_scalelong.trainer.config import (
    fraction,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)

MODEL, DATA, LOSS = "model", "data", "loss"
REQUIRED_COMPONENTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")


@dataclass(frozen=True, kw_only=True)
class TextToImageConfig(DDPMLossOptions, PretrainedModelOptions, TrainingConfig):
    """The options of this script: the shared ones of :class:`TrainingConfig`, then model, data and loss."""

    train_batch_size: int = option(
        1, help="images per device and micro-step", group="output and steps", type=positive_int
    )
    # diffusers' text-to-image defaults where the shared options leave them to the script
    learning_rate: float = option(1e-5, help="peak learning rate", group="optimiser", type=positive_float)
    lr_warmup_steps: int = option(0, help="linear warm-up steps", group="optimiser", type=non_negative_int)
    adam_beta1: float = option(0.9, help="Adam beta1", group="optimiser", type=fraction)
    adam_beta2: float = option(0.999, help="Adam beta2", group="optimiser", type=fraction)
    adam_weight_decay: float = option(1e-2, help="AdamW weight decay", group="optimiser", type=non_negative_float)
    max_grad_norm: float = option(
        1.0, help="gradient clipping norm, 0 = off", group="optimiser", type=non_negative_float
    )
    num_inference_steps: int = option(
        25,
        help="sampler steps for grids",
        group="checkpoints and samples",
        aliases=("--ddpm_num_inference_steps",),
        type=positive_int,
    )

    # ---------------------------------------------------------------------------------------- model
    pretrained_model_name_or_path: str = option(help="Stable-Diffusion-style pipeline folder or Hub repo", group=MODEL)

    # ---------------------------------------------------------------------------------------- data
    dataset_name: str | None = option(None, help="a `datasets` name or local path with images and captions", group=DATA)
    train_data_dir: str | None = option(None, help="an imagefolder with metadata.jsonl (file_name, text)", group=DATA)
    dataset_config_name: str | None = option(None, help="configuration of dataset_name (if it has several)", group=DATA)
    dataset_split: str = option("train", help="split to train on", group=DATA)
    cache_dir: str | None = option(None, help="`datasets` cache folder (default: the datasets library's)", group=DATA)
    image_column: str = option("image", help="image column", group=DATA)
    caption_column: str = option("text", help="caption column (a string or a list of strings)", group=DATA)
    resolution: int = option(
        512, help="image size in pixels the model trains at", group=DATA, type=positive_int, parameter="resolution"
    )
    center_crop: bool = option(False, help="crop the centre instead of a random square", group=DATA)
    random_flip: bool = option(False, help="mirror half of the images left-right", group=DATA)
    allow_upscaling: bool = option(False, help="accept images smaller than resolution", group=DATA)
    max_train_samples: int | None = option(None, help="use only the first N images", group=DATA, type=positive_int)
    validation_prompts: tuple[str, ...] = option(
        (),
        help="prompts of the sample grids (save_images_steps / save_images_epochs): one row of eval_batch_size "
        "images per prompt, all rows from the same noise; logged to report_to as 'validation'",
        group=DATA,
        aliases=("--validation_prompt",),
    )

    image_interpolation_mode: str = option(
        "bicubic",
        help="resampling filter of the resize (this script resizes with bicubic, as the package's image transform)",
        group=DATA,
        choices=("bicubic",),
    )

    # ---------------------------------------------------------------------------------------- loss
    lr_scheduler: str = option("constant", help="diffusers lr schedule (constant, cosine, ...)", group=LOSS)
    prediction_type: str | None = option(
        None,
        help="network target (default: the pipeline scheduler's prediction_type)",
        group=LOSS,
        choices=("epsilon", "v_prediction"),
    )
    input_perturbation: float = option(
        0.0,
        help="perturb the noise of the noisy input by input_perturbation * N(0, 1), the target stays the noise "
        "(Ning et al. 2023, as diffusers' script)",
        group=LOSS,
        type=non_negative_float,
    )

    dream_training: bool = option(False, help="not offered here: DREAM training is refused", group=LOSS)
    dream_detail_preservation: float | None = option(
        None, help="not offered here: it applies to dream_training", group=LOSS
    )
    non_ema_revision: str | None = option(
        None, help="not offered here: the trained UNet is always loaded from revision", group=LOSS
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.wants_grids and not self.validation_prompts:
            raise ValueError("save_images_steps / save_images_epochs need validation_prompts")
        if self.dream_training or self.dream_detail_preservation is not None:
            raise ValueError("dream_training (DREAM) is not offered by this script; train without it")
        if self.non_ema_revision is not None:
            raise ValueError(
                "non_ema_revision is not offered by this script: it loads the UNet from revision; post-hoc EMA "
                "(ema_sigma_rels) chooses the EMA after training instead"
            )


def read_model_index(path: str, revision: str | None) -> dict:
    """``model_index.json`` of a local pipeline folder or Hub repo, with the components this script needs."""
    index_path = fetch_file(path, "model_index.json", revision)
    if index_path is None:
        raise ValueError(f"pretrained_model_name_or_path {path!r} has no model_index.json (not a pipeline)")
    index = json.loads(index_path.read_text())
    missing = [name for name in REQUIRED_COMPONENTS if not (isinstance(index.get(name), list) and index[name][0])]
    if missing:
        raise ValueError(f"pretrained_model_name_or_path {path!r} lacks the components {missing}")
    return index


def load_components(
    path: str, revision: str | None = None, variant: str | None = None, prediction_type: str | None = None
) -> dict:
    """The frozen components and the training noise scheduler of the pipeline at ``path`` (Hub ``revision``,
    weight files of ``variant``; ``prediction_type`` replaces the scheduler's)."""
    from transformers import CLIPTextModel, CLIPTokenizer

    index = read_model_index(path, revision)
    scheduler_cls = getattr(diffusers, index["scheduler"][1], None)
    if scheduler_cls is None:
        raise ValueError(f"unknown scheduler class {index['scheduler'][1]!r} in {path}")
    scheduler = scheduler_cls.from_pretrained(path, subfolder="scheduler", revision=revision)
    if prediction_type is not None:
        scheduler.register_to_config(prediction_type=prediction_type)
    weights = dict(revision=revision, variant=variant)
    return dict(
        tokenizer=CLIPTokenizer.from_pretrained(path, subfolder="tokenizer", revision=revision),
        text_encoder=CLIPTextModel.from_pretrained(path, subfolder="text_encoder", **weights),
        vae=AutoencoderKL.from_pretrained(path, subfolder="vae", **weights),
        scheduler=scheduler,
        noise_scheduler=diffusers.DDPMScheduler.from_config(scheduler.config),
    )


class TextToImageRecipe(DDPMRecipe):
    """diffusers' text-to-image fine-tuning: the DDPM loss on VAE latents, conditioned on the caption's text
    embedding; the pipeline is a ``StableDiffusionPipeline``; grids have one row per validation prompt."""

    def __init__(self, components: dict, config: TextToImageConfig):
        super().__init__(
            components["noise_scheduler"],
            snr_gamma=config.snr_gamma,
            noise_offset=config.noise_offset,
            lr_scheduler=config.lr_scheduler,
            lr_warmup_steps=config.lr_warmup_steps,
            input_perturbation=config.input_perturbation,
        )
        self.components = components
        self.prompts = list(config.validation_prompts)

    def caption_loss(self, unet: torch.nn.Module, batch: dict) -> torch.Tensor:
        vae, text_encoder = self.components["vae"], self.components["text_encoder"]
        with torch.no_grad():
            latents = vae.encode(batch["pixel_values"].to(vae.dtype)).latent_dist.sample() * vae.config.scaling_factor
            text = text_encoder(batch["input_ids"])[0]
        # the frozen modules compute in the mixed-precision dtype; the trained UNet gets float32 inputs
        return self.loss(unet, latents.float(), encoder_hidden_states=text.float())

    def pipeline(self, unet: torch.nn.Module) -> StableDiffusionPipeline:
        parts = self.components
        return StableDiffusionPipeline(
            vae=parts["vae"],
            text_encoder=parts["text_encoder"],
            tokenizer=parts["tokenizer"],
            unet=unet,
            scheduler=parts["scheduler"],
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )

    @torch.no_grad()
    def prompt_grid(self, unet: torch.nn.Module, num_images: int, seed: int, num_inference_steps: int) -> SampleGrid:
        """One row of ``num_images`` per validation prompt, each from the same noise, under autocast to the frozen
        modules' dtype (as diffusers' validation)."""
        dtype = self.components["vae"].dtype
        rows = [dict(prompt=[prompt] * num_images) for prompt in self.prompts]
        with torch.autocast(unet.device.type, dtype=dtype, enabled=dtype != torch.float32):
            images = sample_rows(self.pipeline(unet), rows, num_images, seed, num_inference_steps)
        captions = [f"{i}: {prompt}" for i, prompt in enumerate(self.prompts)]
        return SampleGrid.from_rows(images, captions, tag="validation")


def build_job(config: TextToImageConfig) -> TrainingJob:
    """The pipeline's components, the captioned data and the UNet; nothing is written."""
    source, revision, variant = config.pretrained_model_name_or_path, config.revision, config.variant
    components = load_pretrained(
        lambda: load_components(source, revision, variant, config.prediction_type), source, revision, variant
    )
    dataset = load_captioned_dataset(
        config.dataset_name,
        config.train_data_dir,
        split=config.dataset_split,
        image_column=config.image_column,
        caption_column=config.caption_column,
        resolution=config.resolution,
        allow_upscaling=config.allow_upscaling,
        max_train_samples=config.max_train_samples,
        dataset_config_name=config.dataset_config_name,
        cache_dir=config.cache_dir,
    )
    set_seed(config.seed)
    unet = load_pretrained(
        lambda: load_pretrained_unet(source, config.lsc, config.kappa, revision=revision, variant=variant),
        source,
        revision,
        variant,
    ).to(torch.float32)  # the trained model stays float32 (e.g. from --variant fp16 weights)
    recipe = TextToImageRecipe(components, config)
    transform = ImageTransform(
        config.resolution, center_crop=config.center_crop, random_flip=config.random_flip, channels=3
    )
    return TrainingJob(
        module=unet,
        unet=unet,
        dataset=CaptionedImages(dataset, transform, components["tokenizer"], seed=config.seed),
        loss=recipe.caption_loss,
        make_lr_scheduler=recipe.lr_scheduler,
        make_pipeline=recipe.pipeline,
        sample=recipe.prompt_grid if config.validation_prompts else None,
        frozen=[components["vae"], components["text_encoder"]],
        tracker_name="train_text_to_image",
        description=f"text-to-image fine-tuning, lsc {config.lsc}",
        base_model=source,
        dataset_name=config.dataset_name,
    )


def train(config: TextToImageConfig):
    return Trainer(config, build_job(config)).train()


main = script_main(TextToImageConfig, train, __doc__.split("\n\n")[0])


def console_main(argv: Sequence[str] | None = None) -> NoReturn:
    """The ``scalelong-train-text-to-image`` command: ``main(argv)``, its process ended as :func:`run_and_exit` ends a launched one."""
    run_and_exit(lambda: main(argv))


if __name__ == "__main__":
    console_main()
