"""Frechet distance between Gaussians fitted to two sets of features."""

from __future__ import annotations

import numpy as np
import torch


def gaussian_stats(features: torch.Tensor | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean ``[D]`` and unbiased covariance ``[D, D]`` (float64) of features ``[N, D]``, ``N >= 2``."""
    x = np.asarray(features.detach().cpu() if isinstance(features, torch.Tensor) else features, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"features must be [N, D] with N >= 2, got shape {x.shape}")
    return x.mean(axis=0), np.cov(x, rowvar=False)


def _psd_sqrt(matrix: np.ndarray) -> np.ndarray:
    """Symmetric square root of a symmetric positive semi-definite matrix by eigendecomposition."""
    eigenvalues, eigenvectors = np.linalg.eigh((matrix + matrix.T) / 2)
    return (eigenvectors * np.sqrt(np.clip(eigenvalues, 0, None))) @ eigenvectors.T


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray) -> float:
    """``d^2 = |mu1 - mu2|^2 + tr(S1) + tr(S2) - 2 tr((S1 S2)^(1/2))`` (Dowson & Landau 1982).

    ``tr((S1 S2)^(1/2))`` is computed as the sum of the square roots of the eigenvalues of the symmetric PSD
    matrix ``S1^(1/2) S2 S1^(1/2)``, which has the same spectrum as ``S1 S2`` and is numerically stable even when
    the covariances are singular.
    """
    mu1, mu2 = np.asarray(mu1, np.float64), np.asarray(mu2, np.float64)
    sigma1, sigma2 = np.asarray(sigma1, np.float64), np.asarray(sigma2, np.float64)
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape or sigma1.shape != mu1.shape * 2:
        raise ValueError(f"mismatched shapes: mu {mu1.shape}/{mu2.shape}, sigma {sigma1.shape}/{sigma2.shape}")
    root1 = _psd_sqrt(sigma1)
    middle = root1 @ sigma2 @ root1
    trace_sqrt = np.sqrt(np.clip(np.linalg.eigvalsh((middle + middle.T) / 2), 0, None)).sum()
    distance = np.sum((mu1 - mu2) ** 2) + np.trace(sigma1) + np.trace(sigma2) - 2 * trace_sqrt
    return float(max(distance, 0.0))
