#!/usr/bin/env python
"""Fine-tune the UNet of a Stable-Diffusion-style pipeline on captioned images, with ScaleLong long-skip scaling.

The pipeline folder (or Hub repo) holds ``unet``, ``vae``, ``text_encoder``, ``tokenizer`` and ``scheduler``. The UNet
is loaded as ``ScaleLongUNet2DConditionModel`` with ``--lsc``/``--kappa`` (a CS fine-tune keeps diffusers' parameter
names); VAE and text encoder stay frozen. Loss: the noise scheduler's epsilon (or v) prediction on VAE latents.
Same Accelerate, EMA, checkpoint, exact-resume and Hub options as ``train_unconditional.py``.

Example::

    accelerate launch training/train_text_to_image.py --pretrained_model_name_or_path ./my-sd-pipeline \
        --train_data_dir ./captioned_images --resolution 512 --lsc cs --kappa 0.8 --output_dir out \
        --max_train_steps 1000 --ema_sigma_rels 0.05 0.10 --snapshot_every 250
"""

import argparse
import json
import sys
from pathlib import Path

import diffusers
import torch
from accelerate.utils import set_seed
from diffusers import AutoencoderKL, StableDiffusionPipeline
from diffusers.optimization import get_scheduler

from diffusers_scalelong.data import ImageTransform
from diffusers_scalelong.trainer import (
    CaptionedImages,
    DDPMRecipe,
    SampleGrid,
    TrainingJob,
    add_ddpm_loss_args,
    add_lsc_args,
    add_pretrained_source_args,
    add_training_args,
    ensure_writable_dir,
    images_from_numpy,
    load_captioned_dataset,
    load_pretrained_unet,
    positive_int,
    run_script_main,
    run_training,
    validate_training_args,
    weight_dtype,
)
from diffusers_scalelong.trainer.run_identity import start_run

REQUIRED_COMPONENTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--pretrained_model_name_or_path", required=True, help="Stable-Diffusion-style pipeline folder or Hub repo"
    )
    add_pretrained_source_args(model)
    add_lsc_args(parser)
    data = parser.add_argument_group("data")
    data.add_argument("--dataset_name", default=None, help="a `datasets` name or local path with images and captions")
    data.add_argument("--train_data_dir", default=None, help="an imagefolder with metadata.jsonl (file_name, text)")
    data.add_argument("--dataset_split", default="train", help="split to train on")
    data.add_argument("--image_column", default="image", help="image column")
    data.add_argument("--caption_column", default="text", help="caption column (a string or a list of strings)")
    data.add_argument("--resolution", type=positive_int, default=512, help="training resolution in pixels")
    data.add_argument("--center_crop", action="store_true", help="crop the centre instead of a random square")
    data.add_argument("--random_flip", action="store_true", help="mirror half of the images left-right")
    data.add_argument("--allow_upscaling", action="store_true", help="accept images smaller than --resolution")
    data.add_argument("--max_train_samples", type=positive_int, default=None, help="use only the first N images")
    data.add_argument(
        "--validation_prompts",
        "--validation_prompt",
        dest="validation_prompts",
        nargs="+",
        default=None,
        help="prompts of the sample grids (--save_images_steps / --save_images_epochs): one row of --eval_batch_size "
        "images per prompt, all rows from the same noise; logged to --report_to as 'validation'",
    )
    data.add_argument("--lr_scheduler", default="constant", help="diffusers lr schedule (constant, cosine, ...)")
    add_ddpm_loss_args(parser.add_argument_group("loss"))
    add_training_args(parser, default_batch_size=1)
    return parser


def validate_args(args: argparse.Namespace) -> None:
    validate_training_args(args)
    defaults = dict(learning_rate=1e-5, lr_warmup_steps=0, adam_beta1=0.9, adam_beta2=0.999, adam_weight_decay=1e-2)
    defaults.update(max_grad_norm=1.0, num_inference_steps=25)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if (args.save_images_steps or args.save_images_epochs) and not args.validation_prompts:
        raise ValueError("--save_images_steps / --save_images_epochs need --validation_prompts")


def load_components(path: str, revision: str | None = None, variant: str | None = None) -> dict:
    """The frozen components and the training noise scheduler of the pipeline at ``path`` (Hub ``revision``,
    weight files of ``variant``); a missing file or revision raises ``ValueError`` naming the options."""
    from huggingface_hub.errors import RevisionNotFoundError

    try:
        return _load_components(path, revision, variant)
    except (OSError, RevisionNotFoundError) as error:
        raise ValueError(
            f"--pretrained_model_name_or_path {path!r} (--revision {revision}, --variant {variant}) could not be "
            f"loaded: {error}"
        ) from error


def _load_components(path: str, revision: str | None, variant: str | None) -> dict:
    from transformers import CLIPTextModel, CLIPTokenizer

    index_path = Path(path) / "model_index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    if index is None and not Path(path).exists() and path.count("/") == 1:
        from huggingface_hub import hf_hub_download

        index = json.loads(Path(hf_hub_download(path, "model_index.json", revision=revision)).read_text())
    if index is None:
        raise ValueError(f"--pretrained_model_name_or_path {path!r} has no model_index.json (not a pipeline)")
    missing = [name for name in REQUIRED_COMPONENTS if not (isinstance(index.get(name), list) and index[name][0])]
    if missing:
        raise ValueError(f"--pretrained_model_name_or_path {path!r} lacks the components {missing}")
    scheduler_cls = getattr(diffusers, index["scheduler"][1], None)
    if scheduler_cls is None:
        raise ValueError(f"unknown scheduler class {index['scheduler'][1]!r} in {path}")
    scheduler = scheduler_cls.from_pretrained(path, subfolder="scheduler", revision=revision)
    weights = dict(revision=revision, variant=variant)
    return dict(
        tokenizer=CLIPTokenizer.from_pretrained(path, subfolder="tokenizer", revision=revision),
        text_encoder=CLIPTextModel.from_pretrained(path, subfolder="text_encoder", **weights),
        vae=AutoencoderKL.from_pretrained(path, subfolder="vae", **weights),
        scheduler=scheduler,
        noise_scheduler=diffusers.DDPMScheduler.from_config(scheduler.config),
    )


def train(args: argparse.Namespace) -> Path:
    validate_args(args)
    output_dir = ensure_writable_dir(args.output_dir)
    run = start_run(output_dir, args.resume_from_checkpoint, args.overwrite_output_dir)
    dataset = load_captioned_dataset(
        args.dataset_name,
        args.train_data_dir,
        split=args.dataset_split,
        image_column=args.image_column,
        caption_column=args.caption_column,
        resolution=args.resolution,
        allow_upscaling=args.allow_upscaling,
        max_train_samples=args.max_train_samples,
    )
    components = load_components(args.pretrained_model_name_or_path, args.revision, args.variant)
    set_seed(args.seed)
    unet = load_pretrained_unet(
        args.pretrained_model_name_or_path, args.lsc, args.kappa, revision=args.revision, variant=args.variant
    ).to(torch.float32)  # the trained model stays float32 (e.g. from --variant fp16 weights)
    if run.resume_from is not None:
        run.resume_from.check_matches("unet", unet)
    tokenizer, text_encoder, vae = components["tokenizer"], components["text_encoder"], components["vae"]
    recipe = DDPMRecipe(components["noise_scheduler"], snr_gamma=args.snr_gamma, noise_offset=args.noise_offset)

    def loss(module, batch):
        with torch.no_grad():
            latents = vae.encode(batch["pixel_values"].to(vae.dtype)).latent_dist.sample() * vae.config.scaling_factor
            text = text_encoder(batch["input_ids"])[0]
        # the frozen modules compute in the mixed-precision dtype; the trained UNet gets float32 inputs
        return recipe.loss(module, latents.float(), encoder_hidden_states=text.float())

    def make_pipeline(trained_unet):
        return StableDiffusionPipeline(
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            unet=trained_unet,
            scheduler=components["scheduler"],
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )

    @torch.no_grad()
    def sample(trained_unet, num_images, seed, num_inference_steps) -> SampleGrid:
        """One row of ``num_images`` per validation prompt, each from the same noise, under autocast to the
        frozen modules' dtype (as diffusers' validation)."""
        pipeline = make_pipeline(trained_unet)
        pipeline.set_progress_bar_config(disable=True)
        device_type = trained_unet.device.type
        dtype = weight_dtype(args.mixed_precision)
        rows = []
        for prompt in args.validation_prompts:
            generator = torch.Generator().manual_seed(seed)
            with torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32):
                output = pipeline(
                    [prompt] * num_images,
                    num_inference_steps=num_inference_steps,
                    generator=generator,
                    output_type="np",
                )
            rows.append(images_from_numpy(output.images))
        captions = [f"{i}: {prompt}" for i, prompt in enumerate(args.validation_prompts)]
        return SampleGrid.from_rows(rows, captions, tag="validation")

    transform = ImageTransform(args.resolution, center_crop=args.center_crop, random_flip=args.random_flip, channels=3)
    job = TrainingJob(
        module=unet,
        unet=unet,
        dataset=CaptionedImages(dataset, transform, tokenizer, seed=args.seed),
        loss=loss,
        make_lr_scheduler=lambda optimizer, max_steps: get_scheduler(
            args.lr_scheduler, optimizer, num_warmup_steps=args.lr_warmup_steps, num_training_steps=max_steps
        ),
        make_pipeline=make_pipeline,
        sample=sample if args.validation_prompts else None,
        frozen=[vae, text_encoder],
        tracker_name="train_text_to_image",
        description=f"text-to-image fine-tuning, lsc {args.lsc}",
    )
    return run_training(args, job, output_dir, run)


def main(argv: list[str] | None = None) -> int:
    return run_script_main(build_parser(), train, argv)


if __name__ == "__main__":
    sys.exit(main())
