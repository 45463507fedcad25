"""Power-function EMA profiles (EDM2, arXiv 2312.02696, section 3 and appendix C).

A power-function EMA with exponent ``gamma`` averages the training trajectory up to time ``t`` with the
weight profile

    p_t(tau) = (gamma + 1) * tau**gamma / t**(gamma + 1),    0 <= tau <= t,

whose relative standard deviation is ``sigma_rel = sqrt((gamma + 1) / ((gamma + 2)**2 * (gamma + 3)))``.
This module converts between ``sigma_rel`` and ``gamma``, computes inner products of profiles and solves
for the coefficients that combine stored profiles into a new one (Algorithm 3 of the paper).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

#: ``sigma_rel`` of the uniform average (gamma = 0); valid profiles lie strictly below it.
MAX_SIGMA_REL = math.sqrt(1.0 / 12.0)


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """Exponent ``gamma`` of the power-function profile with relative width ``sigma_rel``.

    ``gamma`` is the largest real root of ``g**3 + 7 g**2 + (16 - s**-2) g + (12 - s**-2) = 0``, solved in float64
    and polished with Newton steps. Valid input: ``0 < sigma_rel < sqrt(1/12) ~ 0.2887``.
    """
    s = _check_sigma_rel(sigma_rel)
    inv_s2 = 1.0 / (s * s)
    coefficients = np.array([1.0, 7.0, 16.0 - inv_s2, 12.0 - inv_s2], dtype=np.float64)
    roots = np.roots(coefficients)
    gamma = float(max(r.real for r in roots if abs(r.imag) <= 1e-7 * max(1.0, abs(r.real))))
    for _ in range(3):  # Newton polish of the root in float64
        value = ((gamma + 7.0) * gamma + 16.0 - inv_s2) * gamma + 12.0 - inv_s2
        slope = (3.0 * gamma + 14.0) * gamma + 16.0 - inv_s2
        if slope == 0.0:
            break
        gamma -= value / slope
    return gamma


def gamma_to_sigma_rel(gamma: float) -> float:
    """Relative width ``sqrt((g + 1) / ((g + 2)**2 (g + 3)))`` of the profile with exponent ``gamma > 0``."""
    g = float(gamma)
    if not math.isfinite(g) or g <= 0.0:
        raise ValueError(f"gamma must be a finite number > 0 (sigma_rel < sqrt(1/12)), got {gamma!r}")
    return math.sqrt((g + 1.0) / ((g + 2.0) ** 2 * (g + 3.0)))


def _check_sigma_rel(sigma_rel: float) -> float:
    try:
        s = float(sigma_rel)
    except (TypeError, ValueError):
        raise ValueError(f"sigma_rel must be a number, got {sigma_rel!r}") from None
    if not math.isfinite(s) or s <= 0.0 or s >= MAX_SIGMA_REL:
        raise ValueError(
            f"sigma_rel must satisfy 0 < sigma_rel < sqrt(1/12) = {MAX_SIGMA_REL:.4f} "
            f"(sigma_rel = sqrt(1/12) is a uniform average, gamma = 0), got {sigma_rel!r}"
        )
    return s


def profile_inner_products(
    times_a: Sequence[float], gammas_a: Sequence[float], times_b: Sequence[float], gammas_b: Sequence[float]
) -> np.ndarray:
    """Matrix of ``<p_a, p_b> = integral of p_a(tau) p_b(tau) dtau`` over all pairs, in float64.

    Closed form: ``(ga + 1)(gb + 1) (ta / tb)**e / ((ga + gb + 1) max(ta, tb))`` with ``e = gb`` if
    ``ta < tb`` else ``-ga``.
    """
    ta = np.asarray(times_a, dtype=np.float64)[:, None]
    ga = np.asarray(gammas_a, dtype=np.float64)[:, None]
    tb = np.asarray(times_b, dtype=np.float64)[None, :]
    gb = np.asarray(gammas_b, dtype=np.float64)[None, :]
    exponent = np.where(ta < tb, gb, -ga)
    return (ga + 1.0) * (gb + 1.0) * (ta / tb) ** exponent / ((ga + gb + 1.0) * np.maximum(ta, tb))


def solve_profile_coefficients(
    snapshot_times: Sequence[float],
    snapshot_gammas: Sequence[float],
    target_times: Sequence[float],
    target_gammas: Sequence[float],
) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares weights that combine snapshot profiles into target profiles (EDM2 Algorithm 3).

    Solves ``A X = B`` with ``A_ij = <p_i, p_j>`` over the snapshots and ``B_ij = <p_i, p_target_j>`` in float64
    (``A`` is badly conditioned), then rescales each column of ``X`` to sum to 1 so that a constant trajectory is
    reproduced exactly. Returns ``(X, relative_errors)`` where ``X`` has shape ``(num_snapshots, num_targets)`` and
    ``relative_errors[j] = ||sum_i X_ij p_i - p_target_j|| / ||p_target_j||`` (L2 norms of the profiles, from the same
    inner products). Times are rescaled by their maximum first, which leaves the solution unchanged.
    """
    scale = float(max(max(snapshot_times), max(target_times)))
    ts = np.asarray(snapshot_times, dtype=np.float64) / scale
    tr = np.asarray(target_times, dtype=np.float64) / scale
    if np.any(ts <= 0.0) or np.any(tr <= 0.0):
        raise ValueError("snapshot and target times must be > 0")
    a = profile_inner_products(ts, snapshot_gammas, ts, snapshot_gammas)
    b = profile_inner_products(ts, snapshot_gammas, tr, target_gammas)
    x = np.linalg.lstsq(a, b, rcond=None)[0]
    x = x / x.sum(axis=0, keepdims=True)
    target_norm2 = np.diag(profile_inner_products(tr, target_gammas, tr, target_gammas))
    error2 = np.einsum("ij,ik,kj->j", x, a, x) - 2.0 * np.einsum("ij,ij->j", x, b) + target_norm2
    relative_errors = np.sqrt(np.clip(error2, 0.0, None) / target_norm2)
    return x, relative_errors
