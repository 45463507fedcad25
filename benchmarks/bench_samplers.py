"""Sampler benchmark: EDMHeunScheduler vs diffusers' EDM Euler and DPM-Solver at equal network evaluations (NFE).

For each NFE budget (default 63 = Heun with 32 steps, EDM2's setting, and 15 = Heun with 8 steps) the three
schedulers sample the same model from the same initial noise through ``EDM2Pipeline``. Reported per sampler:

- seconds per image (median over interleaved repeats, so all samplers see the same machine load);
- the foundation metric (``FD-FMNISTNet`` / ``KID-FMNISTNet`` against the embedded Fashion-MNIST test split);
- ODE error: RMS distance to a very fine solve (Heun, ``--reference_steps`` steps) from the same noise, for the
  deterministic samplers - the quantity the sampler actually approximates.

The model is loaded from ``--model_dir`` (an ``EDM2Pipeline`` folder) or trained here for ``--train_steps`` steps
on the embedded dataset (EDM2 network, EDM2 loss with learned uncertainty); ``--save_model_dir`` keeps it.

    python benchmarks/bench_samplers.py --output benchmarks/results/samplers.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from diffusers import DiffusionPipeline, EDMDPMSolverMultistepScheduler, EDMEulerScheduler
from tqdm.auto import tqdm

import diffusers_scalelong  # noqa: F401  (registers the package's classes for from_pretrained)
from diffusers_scalelong.data import ImageTransform, load_default_dataset
from diffusers_scalelong.edm2 import EDM2Loss, EDMPreconditioner, LearnedUncertainty, inverse_sqrt_lr_lambda
from diffusers_scalelong.metrics import compute_fd_kid
from diffusers_scalelong.models import EDM2UNet2DModel
from diffusers_scalelong.pipelines import EDM2Pipeline
from diffusers_scalelong.schedulers import EDMHeunScheduler


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", help="EDM2Pipeline folder to sample (default: train a small model here)")
    parser.add_argument("--save_model_dir", help="where to save the model trained here (as an EDM2Pipeline)")
    parser.add_argument("--train_steps", type=int, default=1000)
    parser.add_argument("--train_batch_size", type=int, default=32)
    parser.add_argument("--resolution", type=int, default=16, help="image size of the model trained here")
    parser.add_argument("--learning_rate", type=float, default=1e-2, help="reference lr of the EDM2 schedule")
    parser.add_argument("--model_channels", type=int, default=16)
    parser.add_argument("--nfe", type=int, nargs="+", default=[63, 15], help="budgets; each odd value 2N-1")
    parser.add_argument("--num_images", type=int, default=256, help="images per sampler for the metric")
    parser.add_argument("--batch_size", type=int, default=256, help="sampling batch size")
    parser.add_argument("--timing_images", type=int, default=64, help="images per extra timing round")
    parser.add_argument("--ode_images", type=int, default=64, help="images for the ODE error")
    parser.add_argument("--reference_steps", type=int, default=256, help="Heun steps of the fine reference solve")
    parser.add_argument("--timing_repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="benchmarks/results/samplers.md")
    args = parser.parse_args(argv)
    for nfe in args.nfe:
        if nfe < 3 or nfe % 2 == 0:
            raise SystemExit(f"error: --nfe values must be odd and >= 3 (Heun with N steps costs 2N - 1), got {nfe}")
    if args.model_dir and not (Path(args.model_dir) / "model_index.json").is_file():
        raise SystemExit(f"error: --model_dir {args.model_dir} has no model_index.json (save an EDM2Pipeline there)")
    if args.num_images < 2 or args.batch_size < 1 or args.ode_images < 1:
        raise SystemExit("error: --num_images must be >= 2, --batch_size and --ode_images >= 1")
    return args


def train_model(args: argparse.Namespace) -> EDM2Pipeline:
    """A small unconditional EDM2 network trained on the embedded Fashion-MNIST split (1 channel)."""
    torch.manual_seed(args.seed)
    transform = ImageTransform(resolution=args.resolution, channels=1)
    images = torch.stack([transform(image) for image in load_default_dataset("test")["image"]])
    unet = EDM2UNet2DModel(
        sample_size=args.resolution,
        in_channels=1,
        model_channels=args.model_channels,
        channel_mult=(1, 2),
        layers_per_block=1,
        attention_resolutions=(),
        channels_per_head=16,
    )
    denoiser = EDMPreconditioner(unet, LearnedUncertainty())
    loss_fn = EDM2Loss(P_mean=-0.8, P_std=1.6)  # EDM2's pixel-space setting
    optimizer = torch.optim.Adam(denoiser.parameters(), lr=args.learning_rate, betas=(0.9, 0.99))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, inverse_sqrt_lr_lambda(t_ref=max(args.train_steps // 4, 1), warmup_steps=args.train_steps // 20)
    )
    generator = torch.Generator().manual_seed(args.seed)
    for _ in tqdm(range(args.train_steps), desc="training"):
        batch = images[torch.randint(len(images), (args.train_batch_size,), generator=generator)]
        loss = loss_fn(denoiser, batch, generator=generator).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    pipe = EDM2Pipeline(unet=unet.eval(), scheduler=EDMHeunScheduler())
    if args.save_model_dir:
        pipe.save_pretrained(args.save_model_dir)
    return pipe


def samplers_for(nfe: int, base_config) -> dict[str, tuple[object, int]]:
    """name -> (scheduler, num_inference_steps) with exactly `nfe` network evaluations each."""
    return {
        f"EDMHeun {(nfe + 1) // 2} steps": (EDMHeunScheduler.from_config(base_config), (nfe + 1) // 2),
        f"EDMEuler {nfe} steps": (EDMEulerScheduler.from_config(base_config), nfe),
        f"EDMDPMSolver(2M) {nfe} steps": (EDMDPMSolverMultistepScheduler.from_config(base_config), nfe),
    }


def sample(pipe: EDM2Pipeline, scheduler, steps: int, noise: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Samples in [-1, 1] from unit noise; every sampler starts from ``noise * sigma_max`` exactly."""
    pipe.scheduler = scheduler
    pipe.set_progress_bar_config(disable=True)
    scheduler.set_timesteps(steps)
    start_scale = scheduler.config.sigma_max / scheduler.init_noise_sigma  # Euler/DPM: sqrt(sigma_max^2 + 1)
    outputs = []
    for chunk in noise.split(batch_size):
        images = pipe(
            batch_size=len(chunk), num_inference_steps=steps, latents=chunk * start_scale, output_type="latent"
        ).images
        outputs.append(images)
    return torch.cat(outputs)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.time()
    pipe = DiffusionPipeline.from_pretrained(args.model_dir) if args.model_dir else train_model(args)
    if not isinstance(pipe, EDM2Pipeline):
        raise SystemExit(f"error: {args.model_dir} holds a {type(pipe).__name__}, not an EDM2Pipeline")
    train_seconds = time.time() - started
    unet = pipe.unet
    shape = (unet.config.in_channels, unet.config.sample_size, unet.config.sample_size)
    noise = torch.randn(args.num_images, *shape, generator=torch.Generator().manual_seed(args.seed + 1))
    base_config = EDMHeunScheduler.from_config(pipe.scheduler.config).config

    ode_noise = noise[: args.ode_images]
    with torch.no_grad():
        reference = sample(
            pipe, EDMHeunScheduler.from_config(base_config), args.reference_steps, ode_noise, args.batch_size
        )

    rows = []
    for nfe in args.nfe:
        samplers = samplers_for(nfe, base_config)
        times: dict[str, list[float]] = {name: [] for name in samplers}
        images: dict[str, torch.Tensor] = {}
        for repeat in range(args.timing_repeats):  # interleaved: each round runs every sampler once
            for name, (scheduler, steps) in tqdm(samplers.items(), desc=f"NFE {nfe}, round {repeat + 1}"):
                count = args.num_images if repeat == 0 else min(args.timing_images, args.num_images)
                t0 = time.perf_counter()
                out = sample(pipe, scheduler, steps, noise[:count], args.batch_size)
                times[name].append((time.perf_counter() - t0) / count)
                if repeat == 0:
                    images[name] = out
        for name in samplers:
            generated = images[name].clamp(-1, 1)
            metric = compute_fd_kid(generated)
            ode_error = (generated[: args.ode_images] - reference).pow(2).mean().sqrt().item()
            rows.append((nfe, name, statistics.median(times[name]), metric, ode_error))

    write_report(args, rows, train_seconds)


def write_report(args: argparse.Namespace, rows: list, train_seconds: float) -> None:
    fd_key = next(key for key in rows[0][3] if key.startswith("FD-"))
    kid_key = next(key for key in rows[0][3] if key.startswith("KID-") and not key.endswith("-std"))
    lines = [
        "# Sampler benchmark: EDMHeunScheduler vs EDMEuler and EDMDPMSolver at equal network evaluations",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        "no GPU; the machine was shared with other jobs (load average about 10 on 2 cores)",
        f"- command: `{' '.join(['python benchmarks/bench_samplers.py', *sys.argv[1:]])}`",
        (
            f"- model: {args.model_dir}"
            if args.model_dir
            else f"- model: EDM2UNet2DModel (model_channels={args.model_channels}, channel_mult=(1, 2), "
            f"{args.resolution}x{args.resolution}x1, unconditional) trained here for "
            f"{args.train_steps} steps of batch {args.train_batch_size} on the embedded Fashion-MNIST test split "
            f"({train_seconds:.0f} s)"
        ),
        f"- metric: {fd_key} / {kid_key} of {args.num_images} samples per sampler against the embedded test split "
        "(classifier feature space, not Inception FID; comparable only within this table)",
        f"- ODE error: RMS difference (pixels in [-1, 1]) to a {args.reference_steps}-step Heun solve from the same "
        f"noise, over {args.ode_images} images",
        f"- time: median seconds per image over {args.timing_repeats} interleaved rounds (the first with all images, "
        f"then {args.timing_images} images; batch {args.batch_size}); torch threads: {torch.get_num_threads()}",
        "",
        f"| NFE | sampler | s / image | {fd_key} | {kid_key} | ODE error (RMS) |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for nfe, name, seconds, metric, ode_error in rows:
        lines.append(
            f"| {nfe} | {name} | {seconds:.4f} | {metric[fd_key]:.3f} | {metric[kid_key]:.4f} | {ode_error:.4f} |"
        )
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=output.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    os.replace(tmp, output)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
