#!/usr/bin/env python
"""Sample a saved EDM2 pipeline (e.g. the demo's ``pipeline/`` folder) with a chosen EDM sampler, as a PNG grid.

    python examples/sample_edm2_pipeline.py --pipeline outputs/demo/pipeline --sampler heun --steps 16 --out grid.png

``heun`` is EDM's 2nd-order sampler (2N - 1 network evaluations); ``euler`` and ``dpm`` are diffusers' own EDM
schedulers, interchangeable because all of them apply the same EDM preconditioning.
"""

import argparse

import torch
from diffusers import DiffusionPipeline, EDMDPMSolverMultistepScheduler, EDMEulerScheduler

import diffusers_scalelong  # noqa: F401  (registers EDM2Pipeline and the plugin classes)
from diffusers_scalelong.schedulers import EDMHeunScheduler
from diffusers_scalelong.trainer import save_image_grid

SAMPLERS = {"heun": EDMHeunScheduler, "euler": EDMEulerScheduler, "dpm": EDMDPMSolverMultistepScheduler}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", required=True, help="an EDM2Pipeline folder")
    parser.add_argument("--sampler", choices=SAMPLERS, default="heun", help="EDM sampler")
    parser.add_argument("--steps", type=int, default=16, help="sampler steps")
    parser.add_argument("--num_images", type=int, default=64, help="images in the grid")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial noise")
    parser.add_argument("--out", default="grid.png", help="PNG file to write")
    args = parser.parse_args()

    pipeline = DiffusionPipeline.from_pretrained(args.pipeline)
    pipeline.scheduler = SAMPLERS[args.sampler].from_config(pipeline.scheduler.config)
    generator = torch.Generator().manual_seed(args.seed)
    images = pipeline(
        batch_size=args.num_images, num_inference_steps=args.steps, generator=generator, output_type="pt"
    ).images
    save_image_grid(images * 2 - 1, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
