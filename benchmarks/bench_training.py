#!/usr/bin/env python
"""Training throughput (images/s) of each model family at the demo's settings, and the demo's wall time.

Settings: 32x32 greyscale, batch 32, one optimiser step (forward, backward, Adam) per measurement, models of about
1M parameters: diffusers' UNet2DModel and ScaleLongUNet2DModel (CS) with the DDPM recipe, the U-ViT with the DDPM
recipe, the EDM2 UNet with the EDM2 recipe (preconditioning + learned uncertainty). The families are measured
interleaved (round robin) so that a shared machine's load hits them alike; both wall and process CPU time are
reported. ``--demo_dir`` adds the wall time recorded by ``examples/demo.py`` (its metrics.json).

    python benchmarks/bench_training.py --rounds 5 --demo_dir outputs/demo
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from diffusers_scalelong.trainer import DDPMRecipe, EDM2Recipe, build_edm2, build_unet2d, build_uvit
from diffusers_scalelong.trainer.recipes import make_noise_scheduler

RESULTS = Path(__file__).parent / "results" / "training.md"


def families(resolution: int = 32):
    ddpm = DDPMRecipe(make_noise_scheduler("DDPMScheduler", 1000, "linear", "epsilon"))
    unet = dict(
        resolution=resolution, channels=1, block_out_channels=(32, 64, 64), layers_per_block=1, attention_levels=(2,)
    )
    unet.update(norm_num_groups=16, num_class_embeds=None, lsc_kappa=0.7)
    return {
        "unet2d (DDPM)": (build_unet2d(scalelong=False, lsc_method="none", **unet), ddpm),
        "scalelong_unet2d cs (DDPM)": (build_unet2d(scalelong=True, lsc_method="cs", **unet), ddpm),
        "uvit cs (DDPM)": (build_uvit(resolution, 1, 2, 128, 6, 4, None, "cs", 0.7), ddpm),
        "edm2 cs (EDM2, demo)": (
            build_edm2(resolution, 1, None, 32, (1, 2, 2), 1, (8,), None, "cs", 0.7, channels_per_head=32),
            EDM2Recipe(),
        ),
    }


def measure(rounds: int, batch_size: int) -> list[dict]:
    torch.manual_seed(0)
    runs = {}
    for name, (unet, recipe) in families().items():
        module = recipe.wrap(unet)
        runs[name] = (unet, recipe, module, torch.optim.Adam(module.parameters(), lr=1e-4), [], [])
    images = torch.randn(batch_size, 1, 32, 32)
    for round_index in range(rounds + 1):  # round 0 warms up
        for _unet, recipe, module, optimizer, walls, cpus in runs.values():
            wall, cpu = time.perf_counter(), time.process_time()
            recipe.loss(module, images).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if round_index:
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
    rows = []
    for name, (unet, _, _, _, walls, cpus) in runs.items():
        wall, cpu = statistics.median(walls), statistics.median(cpus)
        params = sum(p.numel() for p in unet.parameters()) / 1e6
        rows.append(
            dict(
                family=name,
                params=params,
                wall=wall,
                cpu=cpu,
                images_per_s=batch_size / wall,
                best=batch_size / min(walls),
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="measured steps per family")
    parser.add_argument("--batch_size", type=int, default=32, help="images per step (the demo's)")
    parser.add_argument("--demo_dir", default=None, help="an examples/demo.py output folder to report its wall time")
    parser.add_argument("--note", default="", help="a remark about the machine (e.g. 'shared with other jobs')")
    args = parser.parse_args()

    rows = measure(args.rounds, args.batch_size)
    lines = [
        "# Training throughput",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__} with {torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.1f}",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- settings: 32x32x1, batch {args.batch_size}, median of {args.rounds} interleaved steps (forward + backward + Adam)",
    ]
    if args.note:
        lines.append(f"- note: {args.note}")
    lines += [
        "",
        "| family | params (M) | s/step (wall) | CPU s/step | images/s (median) | images/s (best step) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['family']} | {row['params']:.2f} | {row['wall']:.2f} | {row['cpu']:.2f} | {row['images_per_s']:.1f} | {row['best']:.1f} |"
        )
    if args.demo_dir:
        metrics = json.loads((Path(args.demo_dir) / "metrics.json").read_text())
        scores = ", ".join(f"{k} = {v:.4g}" for k, v in metrics.items() if k.startswith(("FD-", "KID-")))
        lines += [
            "",
            f"Demo (`examples/demo.py`) in {args.demo_dir}: {metrics['minutes']:.1f} min after set-up; {scores}.",
        ]
    text = "\n".join(lines) + "\n"
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
