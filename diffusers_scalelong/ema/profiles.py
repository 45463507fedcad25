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
#: The narrowest profile accepted. ``gamma ~ 1 / sigma_rel`` for narrow profiles, so this is ``gamma ~ 1e4``: the
#: cubic below and the inner products stay well inside float64 range (``sigma_rel = 1e-300`` would divide by zero),
#: and a narrower EMA averages less than one step of a 10^4-step run, i.e. it is the raw weights.
MIN_SIGMA_REL = 1e-4


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """Exponent ``gamma`` of the power-function profile with relative width ``sigma_rel``.

    ``gamma`` is the largest real root of ``g**3 + 7 g**2 + (16 - s**-2) g + (12 - s**-2) = 0``, solved in float64
    and polished with Newton steps. Valid input: ``1e-4 <= sigma_rel < sqrt(1/12) ~ 0.2887`` (``MIN_SIGMA_REL``,
    ``MAX_SIGMA_REL``).
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
    try:
        g = float(gamma)
    except (TypeError, ValueError):
        raise ValueError(f"gamma must be a number, got {gamma!r}") from None
    if not math.isfinite(g) or g <= 0.0:
        raise ValueError(f"gamma must be a finite number > 0 (sigma_rel < sqrt(1/12)), got {gamma!r}")
    return math.sqrt((g + 1.0) / ((g + 2.0) ** 2 * (g + 3.0)))


def _check_sigma_rel(sigma_rel: float, name: str = "sigma_rel") -> float:
    if isinstance(sigma_rel, bool):
        raise ValueError(f"{name} must be a number, got {sigma_rel!r}")
    try:
        s = float(sigma_rel)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name} must be a number, got {sigma_rel!r}") from None
    if not (MIN_SIGMA_REL <= s < MAX_SIGMA_REL):  # also False for NaN
        raise ValueError(
            f"{name} must satisfy {MIN_SIGMA_REL:g} <= sigma_rel < sqrt(1/12) = {MAX_SIGMA_REL:.4f} "
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


#: Largest relative profile error ``||sum_i x_i p_i - p_target|| / ||p_target||`` of a reconstruction made without
#: ``allow_inexact``. Why 0.1: the exact profiles of two EMAs whose sigma_rel differ by 10% lie 0.07 (sigma_rel
#: 0.02-0.05) to 0.085 (sigma_rel 0.1) apart in this measure, by 20%: 0.13 to 0.16. A reconstruction within 0.1 is
#: thus about as close to the requested profile as the exact profile of an EMA roughly 12% longer or shorter, and
#: still stands for the requested length; further out the least-squares weights grow and the result averages
#: another trajectory than the one asked for (e.g. sigma_rel 0.01 from profiles 0.05 and 0.10: 48% off).
MAX_PROFILE_ERROR = 0.1
_GRID_POINTS = 241  # log-spaced sigma_rel over [MIN_SIGMA_REL, MAX_SIGMA_REL): ~3.4% apart
_EDGE_POINTS = 65  # a second grid between the last reachable and the first unreachable point: ~0.05% apart


def reachable_interval(
    snapshot_times: Sequence[float],
    snapshot_gammas: Sequence[float],
    target_time: float,
    max_error: float = MAX_PROFILE_ERROR,
) -> tuple[float, float] | None:
    """``(lowest, highest)`` sigma_rel whose profile at ``target_time`` the snapshot profiles reconstruct within
    ``max_error`` (relative L2, as :func:`solve_profile_coefficients` reports), or ``None`` if none is.

    The interval is the connected run of reachable sigma_rel around the best-fitting one, found on a log grid and
    refined between its last reachable and first unreachable points (to ~0.05% of sigma_rel); three batched solves.
    """
    if not (isinstance(max_error, (int, float)) and 0.0 < max_error < 1.0):
        raise ValueError(f"max_error must be a number in (0, 1), got {max_error!r}")
    tracked = [gamma_to_sigma_rel(g) for t, g in zip(snapshot_times, snapshot_gammas, strict=True) if t == target_time]
    grid = np.union1d(np.geomspace(MIN_SIGMA_REL, MAX_SIGMA_REL * (1 - 1e-9), _GRID_POINTS), tracked)
    errors = _errors_on(snapshot_times, snapshot_gammas, target_time, grid)
    best = int(np.argmin(errors))
    if errors[best] > max_error:
        return None
    low = high = best
    while low > 0 and errors[low - 1] <= max_error:
        low -= 1
    while high < len(grid) - 1 and errors[high + 1] <= max_error:
        high += 1
    ends = []
    for inside, outside in ((low, low - 1), (high, high + 1)):
        if outside < 0 or outside >= len(grid):
            ends.append(float(grid[inside]))
            continue
        fine = np.geomspace(grid[inside], grid[outside], _EDGE_POINTS)
        fine_errors = _errors_on(snapshot_times, snapshot_gammas, target_time, fine)
        last = int(np.argmax(fine_errors > max_error)) - 1  # fine[0] is reachable, fine[-1] is not
        ends.append(float(fine[max(last, 0)]))
    return ends[0], ends[1]


def _errors_on(
    times: Sequence[float], gammas: Sequence[float], target_time: float, sigma_rels: np.ndarray
) -> np.ndarray:
    target_gammas = [sigma_rel_to_gamma(s) for s in sigma_rels]
    return solve_profile_coefficients(times, gammas, [target_time] * len(target_gammas), target_gammas)[1]
