"""Post-hoc EMA (EDM2): power-function EMA tracking, snapshot files and reconstruction of any EMA length.

Typical use::

    ema = PowerFunctionEMA(model, sigma_rels=(0.05, 0.10))
    for step in range(1, num_steps + 1):
        ...  # optimizer step
        ema.update(model, step)
        if step % 1000 == 0:
            ema.save_snapshots("phema", accelerator=accelerator)
    models = reconstruct_ema("phema", target_sigma_rels=[0.07, 0.12])
    low, high = reachable_sigma_rel_range("phema")  # targets outside are refused unless allow_inexact=True

Snapshot file format and naming: see ``diffusers_scalelong.ema.snapshots``. Modules: ``profiles`` (the power
profiles, the least-squares solve and the reachable range), ``tracker`` (:class:`PowerFunctionEMA`),
``snapshots`` (files and their one header reader), ``model_check`` (a header's model against the file's tensors,
built on ``meta`` first), ``reconstruct`` (target-time selection, plan, streaming reconstruction), ``hub_transfer``
(snapshot sets and reconstructed models through the Hub), ``cli`` (``scalelong-reconstruct-ema``) and ``plot``.
"""

from .hub_transfer import (
    RemoteSnapshot,
    list_remote_snapshots,
    pull_snapshots,
    push_reconstruction,
    push_snapshots,
    reconstruct_from_hub,
)
from .profiles import (
    MAX_PROFILE_ERROR,
    MAX_SIGMA_REL,
    MIN_SIGMA_REL,
    gamma_to_sigma_rel,
    profile_inner_products,
    sigma_rel_to_gamma,
    solve_profile_coefficients,
)
from .reconstruct import (
    MAX_TARGETS,
    InexactReconstructionWarning,
    ReconstructionPlan,
    fit_error,
    plan_reconstruction,
    reachable_sigma_rel_range,
    reconstruct_ema,
    resolve_model_class,
    save_planned_models,
    save_reconstructed_models,
    select_for_target,
)
from .snapshots import (
    SnapshotInfo,
    list_snapshots,
    parse_snapshot_filename,
    parse_snapshot_metadata,
    read_snapshot_info,
    snapshot_filename,
)
from .tracker import PowerFunctionEMA, check_sigma_rels, unwrap_model

__all__ = [
    "MAX_PROFILE_ERROR",
    "MAX_SIGMA_REL",
    "MAX_TARGETS",
    "MIN_SIGMA_REL",
    "InexactReconstructionWarning",
    "PowerFunctionEMA",
    "ReconstructionPlan",
    "RemoteSnapshot",
    "SnapshotInfo",
    "check_sigma_rels",
    "fit_error",
    "gamma_to_sigma_rel",
    "list_remote_snapshots",
    "list_snapshots",
    "parse_snapshot_filename",
    "parse_snapshot_metadata",
    "plan_reconstruction",
    "profile_inner_products",
    "pull_snapshots",
    "push_reconstruction",
    "push_snapshots",
    "reachable_sigma_rel_range",
    "read_snapshot_info",
    "reconstruct_ema",
    "reconstruct_from_hub",
    "resolve_model_class",
    "save_planned_models",
    "save_reconstructed_models",
    "select_for_target",
    "sigma_rel_to_gamma",
    "snapshot_filename",
    "solve_profile_coefficients",
    "unwrap_model",
]
