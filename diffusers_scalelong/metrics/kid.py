"""Kernel Inception Distance (Binkowski et al. 2018) in any feature space: unbiased MMD^2, cubic polynomial kernel."""

from __future__ import annotations

import numpy as np
import torch


def polynomial_kernel(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``k(x, y) = (x . y / d + 1)^3`` for all pairs of rows; ``d`` is the feature dimension."""
    return (x @ y.T / x.shape[1] + 1.0) ** 3


def mmd2_unbiased(x: np.ndarray, y: np.ndarray) -> float:
    """Unbiased MMD^2 estimate between samples ``x [m, d]`` and ``y [n, d]`` (diagonal terms excluded).

    ``sum_{i != j} k(x_i, x_j) / (m (m-1)) + sum_{i != j} k(y_i, y_j) / (n (n-1)) - 2 sum_{i,j} k(x_i, y_j) / (m n)``
    """
    m, n = len(x), len(y)
    k_xx, k_yy, k_xy = polynomial_kernel(x, x), polynomial_kernel(y, y), polynomial_kernel(x, y)
    return float(
        (k_xx.sum() - np.trace(k_xx)) / (m * (m - 1))
        + (k_yy.sum() - np.trace(k_yy)) / (n * (n - 1))
        - 2 * k_xy.sum() / (m * n)
    )


def kernel_distance(
    features_x: torch.Tensor | np.ndarray,
    features_y: torch.Tensor | np.ndarray,
    num_subsets: int = 100,
    subset_size: int = 1000,
    seed: int = 0,
) -> tuple[float, float]:
    """KID: mean and standard deviation of the unbiased MMD^2 over ``num_subsets`` random subsets.

    Each subset draws ``min(subset_size, len(x), len(y))`` rows without replacement from each set, with a
    ``numpy`` generator seeded by ``seed`` (the same inputs and seed give the same numbers).
    """
    x, y = (
        np.asarray(f.detach().cpu() if isinstance(f, torch.Tensor) else f, np.float64) for f in (features_x, features_y)
    )
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"features must be [N, D] with the same D, got {x.shape} and {y.shape}")
    size = min(subset_size, len(x), len(y))
    if size < 2:
        raise ValueError(f"KID needs at least 2 samples per set, got {len(x)} and {len(y)}")
    if num_subsets < 1:
        raise ValueError(f"num_subsets must be >= 1, got {num_subsets}")
    rng = np.random.default_rng(seed)
    values = [
        mmd2_unbiased(x[rng.choice(len(x), size, replace=False)], y[rng.choice(len(y), size, replace=False)])
        for _ in range(num_subsets)
    ]
    return float(np.mean(values)), float(np.std(values))
