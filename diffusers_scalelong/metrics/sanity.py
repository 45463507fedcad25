"""Sanity table of the metric on real images: real vs real, and real vs real degraded by Gaussian noise and blur.

    python -m diffusers_scalelong.metrics.sanity --num_samples 5000

Two disjoint random halves of the embedded test split are compared ("A" is degraded, "B" is the reference);
the train split (IDX files, when installed) gives a second real-vs-real row.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..data import FASHION_MNIST_SEARCH_PATHS
from .fd_kid import fd_kid_from_features, load_reference_images
from .features import get_feature_extractor

NOISE_LEVELS = (0.1, 0.2, 0.4)
BLUR_SIGMAS = (0.5, 1.0, 1.5)


def gaussian_noise(images: torch.Tensor, std: float, seed: int = 0) -> torch.Tensor:
    """``clamp(x + std * eps, -1, 1)`` with seeded standard normal ``eps`` (``std`` on the [-1, 1] scale)."""
    eps = torch.randn(images.shape, generator=torch.Generator().manual_seed(seed))
    return (images + std * eps).clamp(-1, 1)


def gaussian_blur(images: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur with standard deviation ``sigma`` pixels (radius 3 sigma, replicate padding)."""
    radius = max(1, int(3 * sigma + 0.5))
    taps = torch.exp(-0.5 * (torch.arange(-radius, radius + 1, dtype=images.dtype) / sigma) ** 2)
    taps = taps / taps.sum()
    channels = images.shape[1]
    x = F.pad(images, (radius,) * 4, mode="replicate")
    x = F.conv2d(x, taps.view(1, 1, 1, -1).expand(channels, 1, 1, -1), groups=channels)
    return F.conv2d(x, taps.view(1, 1, -1, 1).expand(channels, 1, -1, 1), groups=channels)


def sanity_rows(
    num_samples: int = 5000, seed: int = 0, feature_space: str = "fmnist-classifier", kid_subsets: int = 100
) -> list[tuple[str, dict]]:
    """``(description, metric dict)`` for every comparison of the table (reference: test half B)."""
    extractor = get_feature_extractor(feature_space)
    images = load_reference_images("fashion-mnist-test", num_images=2 * num_samples, seed=seed)
    a, reference = images[:num_samples], extractor(images[num_samples:])

    def score(candidates: torch.Tensor) -> dict:
        return fd_kid_from_features(extractor(candidates), reference, extractor.name, seed, kid_subsets)

    comparisons = [("real test A vs real test B", lambda: a)]
    if any(Path(folder, "train-images-idx3-ubyte.gz").is_file() for folder in FASHION_MNIST_SEARCH_PATHS):
        comparisons.append(
            ("real train vs real test B", lambda: load_reference_images("fashion-mnist-train", num_samples, seed))
        )
    comparisons += [(f"test A + Gaussian noise std {s}", partial(gaussian_noise, a, s, seed)) for s in NOISE_LEVELS]
    comparisons += [(f"test A blurred sigma {s} px", partial(gaussian_blur, a, s)) for s in BLUR_SIGMAS]
    return [(name, score(make())) for name, make in tqdm(comparisons, desc="comparisons", unit="row")]


def format_table(rows: list[tuple[str, dict]]) -> str:
    name = next(key for key in rows[0][1] if key.startswith("FD-"))[3:]
    lines = [f"| comparison | FD-{name} | KID-{name} (mean +- std over subsets) |", "|---|---:|---:|"]
    for description, result in rows:
        lines.append(
            f"| {description} | {result[f'FD-{name}']:.4f} | {result[f'KID-{name}']:.5f} +- {result[f'KID-{name}-std']:.5f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_samples", type=int, default=5000, help="images per set (at most 5000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--feature_space", default="fmnist-classifier", choices=["fmnist-classifier", "efficientnet-lite0"]
    )
    parser.add_argument("--kid_subsets", type=int, default=100)
    args = parser.parse_args(argv)
    if not 2 <= args.num_samples <= 5000:
        parser.error("--num_samples must be between 2 and 5000")
    rows = sanity_rows(args.num_samples, args.seed, args.feature_space, args.kid_subsets)
    print(f"{args.num_samples} images per set, seed {args.seed}, feature space {args.feature_space}\n")
    print(format_table(rows))


if __name__ == "__main__":
    main()
