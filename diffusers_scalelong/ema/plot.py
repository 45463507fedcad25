"""PNG plot of reconstructed vs target power-function EMA profiles (what ``--dry-run`` reports as an error)."""

from __future__ import annotations

import os

import numpy as np

from ..atomic import atomic_path
from .reconstruct import ReconstructionPlan


def profile_values(tau: np.ndarray, time: float, gamma: float) -> np.ndarray:
    """``p_t(tau) = (gamma + 1) tau**gamma / t**(gamma + 1)`` on ``[0, t]``, zero after ``t``."""
    return np.where(tau <= time, (gamma + 1.0) * (tau / time) ** gamma / time, 0.0)


def plot_reconstruction(plan: ReconstructionPlan, path: str | os.PathLike) -> None:
    """Write a PNG with each target profile (dashed) and its reconstruction from the snapshots (solid)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tau = np.linspace(0.0, plan.target_time, 1000)
    fig, ax = plt.subplots(figsize=(7, 4))
    for j, (sigma_rel, gamma) in enumerate(zip(plan.target_sigma_rels, plan.target_gammas, strict=True)):
        mix = sum(
            x * profile_values(tau, info.time, info.gamma)
            for x, info in zip(plan.coefficients[:, j], plan.snapshots, strict=True)
        )
        (line,) = ax.plot(tau, mix, label=f"sigma_rel={sigma_rel:g} (error {plan.relative_errors[j]:.1e})")
        ax.plot(tau, profile_values(tau, plan.target_time, gamma), "--", color=line.get_color())
    ax.set_xlabel(f"training time ({plan.snapshots[-1].time_unit})")
    ax.set_ylabel("weight of the parameters at that time")
    ax.set_title("post-hoc EMA: target (dashed) and reconstruction (solid)")
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as temporary:
        fig.savefig(temporary, format="png", dpi=100)
    plt.close(fig)
