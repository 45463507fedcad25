#!/usr/bin/env python
"""The main job: train a small diffusion model on the embedded Fashion-MNIST, then sample it and score it.

0. measure the training throughput for a few seconds with one torch thread and with all cores and keep the faster
   setting (on a busy machine multi-threaded CPU kernels stall waiting for descheduled threads); plan the training
   time: ``--train_minutes``, stretched when the measured rate would not reach ``--min_train_steps`` (the floor for
   recognisable samples) in that time; the whole job, sampling and scoring included (estimated from the same rate),
   is planned to end within ``--time_cap_minutes``, so on a slow machine training is shortened and says so;
1. train ``training/train_unconditional.py`` for that time: an EDM2 magnitude-preserving UNet (0.85M parameters, the
   28x28 images upscaled to 32x32, batch 16) with ScaleLong constant scaling of its long skips, the EDM2 recipe
   (log-normal sigma, learned uncertainty, Adam (0.9, 0.99), inverse-sqrt lr) and post-hoc EMA snapshots; neither
   the learning rate nor the post-hoc EMA needs the number of steps in advance, so training simply stops when its
   time is up (with a final snapshot);
2. reconstruct the EMA of length ``--sigma_rel`` from the snapshots (post-hoc EMA, EDM2 Algorithm 3);
3. save that network as an ``EDM2Pipeline`` folder, sample an 8x8 PNG grid and ``--num_samples`` images;
4. print FD and KID in the feature space of the package's Fashion-MNIST classifier (not Inception FID).

Outputs in ``--output_dir``: ``train/`` (checkpoints, snapshots, TensorBoard logs, grids during training),
``pipeline/`` (load with ``DiffusionPipeline.from_pretrained`` after ``import diffusers_scalelong``),
``samples.png`` and ``metrics.json``. Rerunning resumes an interrupted training run.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from diffusers_scalelong.ema import list_snapshots, save_reconstructed_models
from diffusers_scalelong.metrics import compute_fd_kid
from diffusers_scalelong.models import EDM2UNet2DModel
from diffusers_scalelong.pipelines import EDM2Pipeline
from diffusers_scalelong.schedulers import EDMHeunScheduler
from diffusers_scalelong.trainer import save_image_grid, save_pipeline_atomic

OVERHEAD_SECONDS = 30  # starting the training process, the final save, the EMA reconstruction and the metric
# Sampling comes after training; on a busy machine the load often grows meanwhile (measured: sampling took 1.3x the
# estimate from the probe's rate with two other CPU-bound processes, 1.0x on an idle machine).
SAMPLING_MARGIN = 1.3
MIN_TRAIN_MINUTES = 0.5  # however slow the machine, train at least this long (or --train_minutes if shorter)
TRAIN_SCRIPT = Path(__file__).resolve().parent.parent / "training" / "train_unconditional.py"

RESOLUTION = 32  # the 28x28 images upscaled: scores far better per image seen (benchmarks/results/training.md)
BATCH_SIZE = 16  # better scores than batch 32 for the same compute
# Widths 32, 32, 64: the 16x16 level at 32 channels makes the up-sampling block at 32x32 4x cheaper; at equal
# training time this scores better than widths 32, 64, 64 (benchmarks/results/training.md).
NETWORK = dict(
    model_channels=32, channel_mult=(1, 1, 2), layers_per_block=1, attention_resolutions=(8,), channels_per_head=32,
    lsc_method="cs", lsc_kappa=0.7,
)  # fmt: skip

# The recipe: EDM2 UNet + ScaleLong CS + EDM2 loss and lr + post-hoc EMA (see benchmarks/results/training.md).
TRAINING_RECIPE = [
    "--model", "edm2", "--model_channels", str(NETWORK["model_channels"]),
    "--channel_mult", *map(str, NETWORK["channel_mult"]), "--layers_per_block", str(NETWORK["layers_per_block"]),
    "--attention_resolutions", *map(str, NETWORK["attention_resolutions"]),
    "--channels_per_head", str(NETWORK["channels_per_head"]),
    "--lsc", NETWORK["lsc_method"], "--kappa", str(NETWORK["lsc_kappa"]),
    "--recipe", "edm2", "--learning_rate", "0.02", "--lr_warmup_steps", "100", "--lr_ref_steps", "2000",
    "--resolution", str(RESOLUTION), "--train_batch_size", str(BATCH_SIZE),
    "--ema_sigma_rels", "0.05", "0.10", "--snapshot_every", "100",
    "--checkpointing_steps", "250", "--checkpoints_total_limit", "1", "--diagnostics_every", "100",
    "--save_images_steps", "500", "--num_grid_images", "16", "--num_inference_steps", "12",
]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--output_dir", required=True, help="folder for the training run, pipeline, grid and metric")
    parser.add_argument("--train_minutes", type=float, default=7.5, help="training time (the plan)")
    parser.add_argument(
        "--min_train_steps",
        type=int,
        default=700,
        help=f"steps of batch {BATCH_SIZE} wanted for recognisable samples: when the measured rate would not reach "
        "them in --train_minutes, training is stretched as far as --time_cap_minutes allows",
    )
    parser.add_argument("--max_train_steps", type=int, default=3000, help="train at most this many steps")
    parser.add_argument(
        "--time_cap_minutes",
        type=float,
        default=11.0,
        help="the whole job (measuring, training, sampling, scoring) is planned to end within this time: on a slow "
        "machine training is shortened",
    )
    parser.add_argument("--sigma_rel", type=float, default=0.10, help="EMA length reconstructed after training")
    parser.add_argument("--num_samples", type=int, default=256, help="generated images for the metric")
    parser.add_argument(
        "--num_inference_steps", type=int, default=12, help="EDM Heun steps (2N - 1 network evaluations)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of training and sampling")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: measured; one thread wins on a machine busy with other jobs, because "
        "multi-threaded CPU kernels stall waiting for descheduled threads)",
    )
    args = parser.parse_args(argv)
    if not 0 < args.min_train_steps <= args.max_train_steps:
        parser.error("need 0 < --min_train_steps <= --max_train_steps")
    if not 0 < args.train_minutes <= args.time_cap_minutes:
        parser.error("need 0 < --train_minutes <= --time_cap_minutes")
    return args


def probe_step_rate(threads: int, slower_than: float = 0.0, seconds: float = 4.0, max_steps: int = 5) -> float:
    """Training steps per second of the demo network with ``threads`` torch threads, measured for a few seconds.

    One warm-up step, then up to ``max_steps`` timed steps (forward, backward, Adam) or ``seconds``, whichever
    comes first. A setting whose warm-up step is already more than twice as slow as a rate of ``slower_than`` is
    ruled out at once (on a busy machine a multi-threaded step can take tens of seconds).
    """
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    unet = EDM2UNet2DModel(sample_size=RESOLUTION, in_channels=1, **NETWORK)
    optimizer = torch.optim.Adam(unet.parameters(), lr=1e-4)
    images = torch.randn(BATCH_SIZE, 1, RESOLUTION, RESOLUTION)

    def timed_step() -> float:
        started = time.perf_counter()
        unet(images, torch.randn(BATCH_SIZE)).sample.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    warm_up = timed_step()
    if slower_than and warm_up > 2 / slower_than:
        return 1 / warm_up
    durations: list[float] = []
    while len(durations) < max_steps and sum(durations) < seconds:
        durations.append(timed_step())
    return len(durations) / sum(durations)


def plan_training(args: argparse.Namespace, started: float) -> float:
    """Choose the torch threads (unless given) from measured throughput; return the training time in minutes.

    Sampling ``--num_samples`` images costs about ``num_samples * (2N - 1) / (3 * BATCH_SIZE)`` training steps (a
    training step is a forward and a backward pass, about three forward passes, of BATCH_SIZE images).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    candidates = [args.threads] if args.threads else sorted({1, cores})
    rates: dict[int, float] = {}
    for threads in candidates:
        rates[threads] = probe_step_rate(threads, slower_than=max(rates.values(), default=0.0))
    args.threads = max(rates, key=rates.get)
    torch.set_num_threads(args.threads)
    rate = rates[args.threads]
    measured = ", ".join(f"{threads} thread(s): {r:.2f} steps/s" for threads, r in rates.items())
    load = f"load average {os.getloadavg()[0]:.1f} on {cores} core(s)" if hasattr(os, "getloadavg") else ""

    sampling_steps = max(args.num_samples, 64) * (2 * args.num_inference_steps - 1) / (3 * BATCH_SIZE)
    sampling_seconds = SAMPLING_MARGIN * sampling_steps / rate
    rest_minutes = (sampling_seconds + OVERHEAD_SECONDS) / 60 + (time.monotonic() - started) / 60
    room = args.time_cap_minutes - rest_minutes
    wanted = max(args.train_minutes, args.min_train_steps / rate / 60)
    minutes = max(min(wanted, room), min(args.train_minutes, MIN_TRAIN_MINUTES))
    expected = min(args.max_train_steps, int(rate * 60 * minutes))
    print(f"[0/4] throughput ({load}): {measured}; using {args.threads} thread(s)")
    print(
        f"      plan: {minutes:.1f} min of training, about {expected} steps of batch {BATCH_SIZE} "
        f"(at least {args.min_train_steps} wanted, at most {args.max_train_steps}); "
        f"the whole job should end in about {minutes + rest_minutes:.1f} min",
        flush=True,
    )
    if expected < args.min_train_steps:
        print(
            f"      this machine is too slow (or too busy) for {args.min_train_steps} steps within "
            f"--time_cap_minutes {args.time_cap_minutes}: expect weaker samples",
            flush=True,
        )
    return minutes


def train(args: argparse.Namespace, train_dir: Path, minutes: float) -> None:
    if (train_dir / "model_index.json").is_file():
        print(f"[1/4] {train_dir} holds a finished training run; reusing it (delete the folder to retrain)")
        return
    print(f"[1/4] training for {minutes:.1f} min", flush=True)
    command = [sys.executable, str(TRAIN_SCRIPT), "--output_dir", str(train_dir), *TRAINING_RECIPE]
    command += ["--max_train_steps", str(args.max_train_steps), "--max_train_time_minutes", f"{minutes:.4g}"]
    command += ["--seed", str(args.seed), "--resume_from_checkpoint", "latest"]
    result = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    if result.returncode != 0:
        raise SystemExit(f"training stopped with exit code {result.returncode}; rerun the same command to resume it")
    trained = max((info.time for info in list_snapshots(train_dir / "ema_snapshots")), default=0)
    if trained < args.min_train_steps:
        print(
            f"      the time limit stopped training after {trained} of the {args.min_train_steps} steps wanted, so "
            "expect weaker samples (rerun with larger --train_minutes and --time_cap_minutes, or on a less busy "
            "machine)",
            flush=True,
        )
    else:
        print(f"      trained {trained} steps", flush=True)


@torch.no_grad()
def sample(pipeline: EDM2Pipeline, count: int, steps: int, seed: int, batch_size: int = 128) -> torch.Tensor:
    """``count`` images in [-1, 1] from the EDM Heun sampler, in batches."""
    images = []
    generator = torch.Generator().manual_seed(seed)
    for start in range(0, count, batch_size):
        output = pipeline(
            batch_size=min(batch_size, count - start), num_inference_steps=steps, generator=generator, output_type="pt"
        )
        images.append(output.images * 2 - 1)
    return torch.cat(images)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    output_dir = Path(args.output_dir)
    train_dir = output_dir / "train"
    started = time.monotonic()
    minutes = plan_training(args, started)
    train(args, train_dir, minutes)

    print(f"[2/4] reconstructing the post-hoc EMA with sigma_rel={args.sigma_rel}", flush=True)
    (folder,) = save_reconstructed_models(
        train_dir / "ema_snapshots", output_dir / "ema", [args.sigma_rel], overwrite=True
    )
    unet = EDM2UNet2DModel.from_pretrained(folder).eval()
    pipeline = EDM2Pipeline(unet=unet, scheduler=EDMHeunScheduler())
    pipeline.set_progress_bar_config(disable=True)
    save_pipeline_atomic(pipeline, _fresh_folder(output_dir / "pipeline"))

    print(f"[3/4] sampling {args.num_samples} images ({args.num_inference_steps} Heun steps)", flush=True)
    images = sample(pipeline, max(args.num_samples, 64), args.num_inference_steps, args.seed)
    grid_path = output_dir / "samples.png"
    save_image_grid(images[:64], grid_path, nrow=8)

    print("[4/4] scoring against the Fashion-MNIST test split", flush=True)
    metrics = compute_fd_kid(images[: args.num_samples])
    metrics.update(
        sigma_rel=args.sigma_rel,
        num_inference_steps=args.num_inference_steps,
        minutes=(time.monotonic() - started) / 60,
    )
    (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    scores = ", ".join(f"{key} = {value:.4g}" for key, value in metrics.items() if key.startswith(("FD-", "KID-")))
    print(f"\n{scores} ({metrics['num_generated']} samples vs {metrics['num_reference']} real test images)")
    print(f"grid: {grid_path}\npipeline: {output_dir / 'pipeline'}\ntraining run (TensorBoard logs): {train_dir}")
    return 0


def _fresh_folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


if __name__ == "__main__":
    sys.exit(main())
