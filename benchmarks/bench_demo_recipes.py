#!/usr/bin/env python
"""Recipe variants of the README's main job compared at equal training time: FD-FMNISTNet per CPU minute.

Every variant trains ``examples/demo.py``'s recipe (with the variant's arguments appended, so they override it) for
``--minutes`` of wall time on one torch thread; two variants run side by side, so each has one core of a 2-core
machine. Then the post-hoc EMA (``--sigma_rel``) is reconstructed at the end and at about half the steps, 256
images are sampled with the demo's sampler and scored. One JSON line per finished variant goes to ``--record``;
variants already there are skipped, so an interrupted comparison resumes.

    python benchmarks/bench_demo_recipes.py --work_dir /tmp/recipes --record benchmarks/results/demo_recipes.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import demo  # noqa: E402

from diffusers_scalelong.ema import list_snapshots, reconstruct_ema  # noqa: E402
from diffusers_scalelong.metrics import compute_fd_kid  # noqa: E402
from diffusers_scalelong.models import EDM2UNet2DModel  # noqa: E402
from diffusers_scalelong.pipelines import EDM2Pipeline  # noqa: E402
from diffusers_scalelong.schedulers import EDMHeunScheduler  # noqa: E402

VARIANTS: dict[str, list[str]] = {
    "demo": [],
    "mult 1 1 2": ["--channel_mult", "1", "1", "2"],
    "mult 1 1 1": ["--channel_mult", "1", "1", "1"],
    "P_mean -1.2, P_std 1.2": ["--P_mean", "-1.2", "--P_std", "1.2"],
    "mult 1 1 2, P_mean -0.4": ["--channel_mult", "1", "1", "2", "--P_mean", "-0.4"],
    "mult 1 1 2, lr 0.03": ["--channel_mult", "1", "1", "2", "--learning_rate", "0.03"],
}


def train(work_dir: Path, name: str, extra: list[str], minutes: float) -> subprocess.Popen:
    command = [
        sys.executable,
        str(demo.TRAIN_SCRIPT),
        "--output_dir",
        str(work_dir / slug(name)),
        *demo.TRAINING_RECIPE,
    ]
    command += [
        *extra,
        "--snapshot_every",
        "50",
        "--max_train_steps",
        "100000",
        "--max_train_time_minutes",
        str(minutes),
    ]
    command += ["--save_images_steps", "100000", "--seed", "0"]
    with open(work_dir / f"{slug(name)}.log", "w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )


def score(run_dir: Path, sigma_rel: float, steps: int) -> dict[str, float]:
    """FD-FMNISTNet of the post-hoc EMA at the final step and at the snapshot nearest half of it."""
    snapshots = list_snapshots(run_dir / "ema_snapshots")
    final = max(s.time for s in snapshots)
    half = min({s.time for s in snapshots}, key=lambda t: abs(t - final / 2))
    unet = EDM2UNet2DModel.from_pretrained(run_dir / "unet")
    scores = {}
    for when in (half, final):
        (state,) = reconstruct_ema(snapshots, [sigma_rel], target_time=when)
        unet.load_state_dict(state)
        pipeline = EDM2Pipeline(unet=unet.eval(), scheduler=EDMHeunScheduler())
        pipeline.set_progress_bar_config(disable=True)
        images = demo.sample(pipeline, 256, steps, seed=0)
        scores[str(when)] = compute_fd_kid(images)["FD-FMNISTNet"]
    return scores


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work_dir", type=Path, required=True, help="folder for the training runs")
    parser.add_argument("--record", type=Path, required=True, help="JSON lines, one per finished variant")
    parser.add_argument("--minutes", type=float, default=7.5, help="training wall time per variant")
    parser.add_argument("--sigma_rel", type=float, default=0.10)
    parser.add_argument("--num_inference_steps", type=int, default=12)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    done = (
        {json.loads(line)["variant"] for line in args.record.read_text().splitlines()}
        if args.record.exists()
        else set()
    )
    todo = [name for name in args.variants if name not in done]
    torch.set_num_threads(1)
    for pair in (todo[i : i + 2] for i in range(0, len(todo), 2)):
        started = time.monotonic()
        processes = {name: train(args.work_dir, name, VARIANTS[name], args.minutes) for name in pair}
        for name, process in processes.items():
            if process.wait() != 0:
                sys.exit(f"{name}: training failed, see {args.work_dir / slug(name)}.log")
        for name in pair:
            run_dir = args.work_dir / slug(name)
            row = {
                "variant": name,
                "args": VARIANTS[name],
                "minutes": args.minutes,
                "wall_s": round(time.monotonic() - started),
                "params_M": round(
                    sum(p.numel() for p in EDM2UNet2DModel.from_pretrained(run_dir / "unet").parameters()) / 1e6, 3
                ),
                "fd_by_step": score(run_dir, args.sigma_rel, args.num_inference_steps),
                "sigma_rel": args.sigma_rel,
                "num_inference_steps": args.num_inference_steps,
                "cpu": os.cpu_count(),
            }
            print(json.dumps(row), flush=True)
            with args.record.open("a") as record:
                record.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
