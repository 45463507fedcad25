#!/usr/bin/env python
"""Choose the EMA length after training: reconstruct several sigma_rel from a run's post-hoc EMA snapshots and
score each with the package's Fashion-MNIST FD (the EDM2 paper's Fig. 5 idea, at toy scale).

    python examples/choose_ema_length.py --run outputs/demo/train --sigma_rels 0.03 0.05 0.08 0.12 0.16
"""

import argparse

import torch

from diffusers_scalelong.ema import reconstruct_ema, resolve_model_class
from diffusers_scalelong.ema.snapshots import list_snapshots
from diffusers_scalelong.metrics import compute_fd_kid
from diffusers_scalelong.pipelines import EDM2Pipeline
from diffusers_scalelong.schedulers import EDMHeunScheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="a train_unconditional.py output folder (with ema_snapshots/)")
    parser.add_argument("--sigma_rels", type=float, nargs="+", default=[0.03, 0.05, 0.08, 0.12, 0.16])
    parser.add_argument("--num_samples", type=int, default=256, help="generated images per sigma_rel")
    parser.add_argument("--steps", type=int, default=12, help="EDM Heun steps")
    args = parser.parse_args()

    folder = f"{args.run}/ema_snapshots"
    info = list_snapshots(folder)[-1]
    unet = resolve_model_class(info.model_class).from_config(info.model_config).eval()
    for sigma_rel, state in zip(args.sigma_rels, reconstruct_ema(folder, args.sigma_rels), strict=True):
        unet.load_state_dict(state)
        pipeline = EDM2Pipeline(unet=unet, scheduler=EDMHeunScheduler())
        pipeline.set_progress_bar_config(disable=True)
        generator = torch.Generator().manual_seed(0)
        images = pipeline(
            batch_size=args.num_samples, num_inference_steps=args.steps, generator=generator, output_type="pt"
        ).images
        scores = compute_fd_kid(images * 2 - 1)
        print(
            f"sigma_rel {sigma_rel:.3f}: "
            + ", ".join(
                f"{k} {v:.4g}" for k, v in scores.items() if k.startswith(("FD-", "KID-")) and not k.endswith("std")
            )
        )


if __name__ == "__main__":
    main()
