"""Throughput of the metric's feature extraction (both feature spaces) and of the data loading it relies on.

    python benchmarks/bench_metrics.py [--repeats 3] [--threads 2]

Cases run interleaved (round-robin over repeats) so that a shared machine's load affects them alike; the median
is reported. Results go to benchmarks/results/metrics.md.
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

from diffusers_scalelong import data, metrics
from diffusers_scalelong.metrics import fd_kid

RESULTS = Path(__file__).parent / "results" / "metrics.md"


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    images = metrics.load_reference_images(num_images=2000, seed=0)
    fmnist = metrics.get_feature_extractor("fmnist-classifier")
    effnet = metrics.EfficientNetLite0Features(resolution=128)
    effnet_64 = metrics.EfficientNetLite0Features(resolution=64)
    upsampled = torch.nn.functional.interpolate(images, size=(32, 32), mode="bilinear")

    def load_dataset_cold():
        data._dataset_cached.cache_clear()
        data._load_arrays_cached.cache_clear()
        data.load_default_dataset()

    def reference_cold():
        fd_kid._reference_features.cache_clear()
        metrics.compute_fd_kid(upsampled[:1000], kid_subsets=10)

    cases = {  # name: (function, number of images processed)
        "FMNISTNet features, 28x28 input": (lambda: fmnist(images), len(images)),
        "FMNISTNet features, 32x32 input (resized)": (lambda: fmnist(upsampled), len(upsampled)),
        "EfficientNet-Lite0 features at 64 px": (lambda: effnet_64(images[:128]), 128),
        "EfficientNet-Lite0 features at 128 px": (lambda: effnet(images[:64]), 64),
        "load_default_dataset (decode IDX + build Dataset, cold)": (load_dataset_cold, 10_000),
        "compute_fd_kid, 1k images at 32 px, 10k reference (cold cache)": (reference_cold, 1000),
    }
    seconds = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, (fn, _count) in cases.items():
            seconds[name].append(timed(fn))

    lines = [
        "# Metric feature extraction throughput",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} threads, "
        "no GPU; the machine was shared with other jobs during the run",
        f"- command: `python benchmarks/bench_metrics.py --repeats {args.repeats} --threads {args.threads}`",
        f"- median of {args.repeats} interleaved repeats",
        "",
        "| case | images | median s | images/s |",
        "|---|---:|---:|---:|",
    ]
    for name, (_fn, count) in cases.items():
        median = statistics.median(seconds[name])
        lines.append(f"| {name} | {count} | {median:.3f} | {count / median:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=args.output.parent, delete=False, suffix=".tmp") as tmp:
        tmp.write(text)
    os.replace(tmp.name, args.output)


if __name__ == "__main__":
    sys.exit(main())
