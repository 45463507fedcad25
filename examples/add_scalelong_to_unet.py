#!/usr/bin/env python
"""Add ScaleLong long-skip scaling to a saved diffusers UNet and save it so that the scaling is kept.

    python examples/add_scalelong_to_unet.py --pipeline outputs/demo/train --lsc cs --kappa 0.7 --output_dir scaled

Works for a pipeline folder holding a ``UNet2DModel`` (or ``UNet2DConditionModel``): the weights load into the
``ScaleLong*`` subclass, whose config records ``lsc_method``/``lsc_kappa``. For constant scaling the parameter names
do not change, so the result also loads back into the vanilla class (without the scaling).
"""

import argparse

import torch
from diffusers import DiffusionPipeline

import diffusers_scalelong  # noqa: F401  (registers the plugin classes for from_pretrained)
from diffusers_scalelong.models import load_pretrained_unet
from diffusers_scalelong.scalelong import LSC_METHODS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", required=True, help="a pipeline folder or Hub repo with a unet/ component")
    parser.add_argument("--lsc", choices=LSC_METHODS, default="cs", help="long-skip scaling method")
    parser.add_argument("--kappa", type=float, default=0.7, help="kappa of cs / cs_stage")
    parser.add_argument("--output_dir", required=True, help="where to save the pipeline with the scaled UNet")
    args = parser.parse_args()

    pipeline = DiffusionPipeline.from_pretrained(args.pipeline)
    scaled = load_pretrained_unet(args.pipeline, args.lsc, args.kappa)
    sample = torch.randn(2, scaled.config.in_channels, scaled.config.sample_size, scaled.config.sample_size)
    with torch.no_grad():
        before = pipeline.unet(sample, 10).sample
        after = scaled(sample, 10).sample
    print(
        f"{type(pipeline.unet).__name__} -> {type(scaled).__name__} (lsc_method={scaled.config.lsc_method}, kappa={scaled.config.lsc_kappa})"
    )
    print(f"relative change of the output: {((after - before).norm() / before.norm()).item():.3f} (fine-tune to adapt)")
    pipeline.unet = scaled
    pipeline.register_modules(unet=scaled)
    pipeline.save_pretrained(args.output_dir)
    print(f"saved to {args.output_dir}")


if __name__ == "__main__":
    main()
