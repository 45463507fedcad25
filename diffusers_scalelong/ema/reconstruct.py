"""Post-hoc reconstruction of EMA profiles from snapshot files (EDM2 Algorithm 3), streaming over snapshots.

For targets ``(t_r, gamma_r)`` the coefficients ``X`` solve ``A X = B`` in float64 with ``A_ij = <p_i, p_j>`` over
the snapshots at times ``0 < t_i <= t_r`` and ``B_ij = <p_i, p_target_j>``; each column is rescaled to sum to 1.
The reconstructed weights are ``theta_j = sum_i X_ij theta_i``. Snapshots are read one tensor at a time and added
into one accumulator per target, so memory is one tensor plus the outputs, whatever the number of snapshots.
Buffers are not averaged: they are taken from the newest snapshot used.

Reach: a target whose best combination is off by more than ``MAX_PROFILE_ERROR`` (relative L2 distance of the
profiles, see ``profiles``) is refused, naming the reachable sigma_rel range, unless ``allow_inexact=True``, which
reconstructs it with a warning. :func:`fit_error` and :func:`reachable_sigma_rel_range` answer the same question
for tools (e.g. a slider), from local or remote snapshot metadata. At most ``MAX_TARGETS`` targets per call: each
holds a full copy of the model in memory.

Integrity: the snapshots must come from one training run (one ``run_id``); every tensor read is hashed on the way
and each file's checksum compared with the one in its header before the result is used; the result is checked
finite before it is saved. A saved folder's ``phema.json`` (written last) records the SHA-256 of every other file.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .._version import __version__
from ..atomic import clean_stale_temporaries, replace_path, staging_folder
from ..integrity import (
    TensorDigest,
    check_finite,
    check_recorded_digest,
    data_sha256,
    folder_manifest,
    verify_manifest,
)
from ..validation import check_number_sequence
from .model_check import ALLOWED_MODEL_PACKAGES, check_model_matches, resolve_model_class  # noqa: F401 - re-exported
from .profiles import MAX_PROFILE_ERROR, reachable_interval, sigma_rel_to_gamma, solve_profile_coefficients
from .snapshots import SnapshotInfo, list_snapshots, snapshot_filename, storage_dtype

#: Most targets reconstructed in one call: each holds a full float32 copy of the model until it is written.
MAX_TARGETS = 64
PROVENANCE_FILENAME = "phema.json"


class InexactReconstructionWarning(UserWarning):
    """A target reconstructed with ``allow_inexact=True`` although its profile error exceeds ``MAX_PROFILE_ERROR``."""


ACCUMULATE_DTYPES = {"float32": torch.float32, "float64": torch.float64}
T = TypeVar("T")


@dataclass(frozen=True)
class ReconstructionPlan:
    """Which snapshots are combined, with which coefficients, into which target profiles."""

    target_time: int
    target_sigma_rels: tuple[float, ...]
    target_gammas: tuple[float, ...]
    snapshots: tuple[SnapshotInfo, ...]
    coefficients: np.ndarray  # (num_snapshots, num_targets), float64, columns sum to 1
    relative_errors: np.ndarray  # (num_targets,) ||reconstructed profile - target profile|| / ||target profile||

    def describe(self) -> str:
        """A text table of the coefficients and the expected relative profile error per target."""
        unit = self.snapshots[-1].time_unit
        header = f"{'snapshot':>38} | " + " | ".join(f"sigma_rel={s:<8.4g}" for s in self.target_sigma_rels)
        lines = [f"target time {self.target_time} {unit}, {len(self.snapshots)} snapshots", header, "-" * len(header)]
        for info, row in zip(self.snapshots, self.coefficients, strict=True):
            lines.append(f"{info.path.name:>38} | " + " | ".join(f"{x:>+18.6f}" for x in row))
        lines.append("-" * len(header))
        lines.append(f"{'relative profile error':>38} | " + " | ".join(f"{e:>18.3e}" for e in self.relative_errors))
        return "\n".join(lines)


def _comparable_config(config: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if config is None else {k: v for k, v in config.items() if not k.startswith("_")}


def _check_consistent(snapshots: Sequence[SnapshotInfo]) -> None:
    first = snapshots[0]
    seen: set[tuple[int, float]] = set()
    for info in snapshots:
        if (info.time, info.sigma_rel) in seen:
            raise ValueError(f"two snapshots for time {info.time} and sigma_rel {info.sigma_rel} (e.g. {info.path})")
        seen.add((info.time, info.sigma_rel))
        if info.model_class != first.model_class or _comparable_config(info.model_config) != _comparable_config(
            first.model_config
        ):
            raise ValueError(f"snapshots come from different model configs: {first.path} and {info.path}")
        if info.shapes != first.shapes or info.copied_keys != first.copied_keys:
            diff = sorted(k for k in set(info.shapes) | set(first.shapes) if info.shapes.get(k) != first.shapes.get(k))
            raise ValueError(
                f"snapshots have different tensors/shapes: {first.path} and {info.path} (first differing keys: {diff[:3]})"
            )
        if info.time_unit != first.time_unit:
            raise ValueError(f"snapshots count time in different units: {first.path} and {info.path}")
        if info.run_id != first.run_id:
            raise ValueError(
                f"snapshots come from different training runs: {first.path} (run {first.run_id or 'unnamed'}) and "
                f"{info.path} (run {info.run_id or 'unnamed'}); reconstruct from one run's snapshots only"
            )


def _as_snapshots(snapshots: str | os.PathLike | Sequence[SnapshotInfo]) -> list[SnapshotInfo]:
    if isinstance(snapshots, (str, os.PathLike)):
        folder = snapshots
        snapshots = list_snapshots(folder)
        if not snapshots:
            raise ValueError(f"no snapshot files (phema-*.safetensors) in {folder}")
    snapshots = sorted(snapshots, key=lambda info: (info.time, info.sigma_rel))
    if not snapshots:
        raise ValueError("no snapshots given")
    return snapshots


def select_for_target(snapshots: Sequence[T], target_time: int | None = None) -> tuple[int, list[T]]:
    """The one choice of snapshots for a reconstruction at ``target_time``: ``(target_time, those with 0 < time <=
    target_time)``, for anything with a ``.time`` (local ``SnapshotInfo`` or remote index entries).

    ``target_time`` must be one of the snapshot times (default: the newest); raises ``ValueError`` otherwise.
    """
    times = sorted({snapshot.time for snapshot in snapshots if snapshot.time > 0})
    if not times:
        raise ValueError("all snapshots are at time 0; nothing to reconstruct from")
    if target_time is None:
        target_time = times[-1]
    if isinstance(target_time, bool) or not isinstance(target_time, (int, np.integer)) or target_time <= 0:
        raise ValueError(f"target_time must be a positive integer, got {target_time!r}")
    if target_time > times[-1]:
        raise ValueError(f"target_time={target_time} is later than the newest snapshot (time {times[-1]})")
    if target_time not in times:
        raise ValueError(f"no snapshot at target_time={target_time}; snapshot times: {times}")
    return int(target_time), [snapshot for snapshot in snapshots if 0 < snapshot.time <= target_time]


def plan_reconstruction(
    snapshots: str | os.PathLike | Sequence[SnapshotInfo],
    target_sigma_rels: Sequence[float],
    target_time: int | None = None,
    *,
    allow_inexact: bool = False,
) -> ReconstructionPlan:
    """Validate the snapshots (a folder or ``list_snapshots`` output) and solve for the coefficients.

    ``target_time`` must be one of the snapshot times (default: the newest). Snapshots at time 0 and newer than
    the target are excluded. Raises ``ValueError`` for an empty set, mixed models, a bad target, more than
    ``MAX_TARGETS`` targets, or a target the snapshots reconstruct only with a relative profile error above
    ``MAX_PROFILE_ERROR`` (the message names the reachable range); ``allow_inexact=True`` accepts such a target
    with an :class:`InexactReconstructionWarning` instead.
    """
    target_sigma_rels = _check_targets(target_sigma_rels)
    snapshots = _as_snapshots(snapshots)
    target_gammas = tuple(sigma_rel_to_gamma(s) for s in target_sigma_rels)
    _check_consistent(snapshots)
    last = snapshots[-1]
    if last.model_class is not None:  # the header's model against the tensors, before any model is built (cached)
        check_model_matches(last.model_class, last.model_config, last.shapes, last.copied_keys, str(last.path))
    target_time, used = select_for_target(snapshots, target_time)
    times, gammas = [info.time for info in used], [info.gamma for info in used]
    coefficients, errors = solve_profile_coefficients(
        times, gammas, [target_time] * len(target_sigma_rels), target_gammas
    )
    inexact = [(s, float(e)) for s, e in zip(target_sigma_rels, errors, strict=True) if e > MAX_PROFILE_ERROR]
    if inexact:
        message = _unreachable_message(inexact, times, gammas, target_time)
        if not allow_inexact:
            raise ValueError(f"{message}; pass allow_inexact=True (--allow_inexact) to reconstruct it anyway")
        warnings.warn(f"reconstructed anyway (allow_inexact): {message}", InexactReconstructionWarning, stacklevel=2)
    return ReconstructionPlan(target_time, target_sigma_rels, target_gammas, tuple(used), coefficients, errors)


def _check_targets(target_sigma_rels: Sequence[float]) -> tuple[float, ...]:
    target_sigma_rels = check_number_sequence("target_sigma_rels", target_sigma_rels)
    if not target_sigma_rels:
        raise ValueError("give at least one target sigma_rel")
    if len(target_sigma_rels) > MAX_TARGETS:
        raise ValueError(
            f"target_sigma_rels holds {len(target_sigma_rels)} values, at most {MAX_TARGETS} are reconstructed at "
            "once (each holds a full copy of the model in memory); split them into several calls, or use fit_error "
            "to compare many targets without reconstructing them"
        )
    return target_sigma_rels


def _unreachable_message(
    inexact: list[tuple[float, float]], times: list[int], gammas: list[float], target_time: int
) -> str:
    sigma_rel, error = max(inexact, key=lambda pair: pair[1])
    reach = reachable_interval(times, gammas, target_time, MAX_PROFILE_ERROR)
    where = f"sigma_rel {reach[0]:.4g} to {reach[1]:.4g}" if reach else "none"
    others = f" ({len(inexact) - 1} more targets too)" if len(inexact) > 1 else ""
    return (
        f"target sigma_rel={sigma_rel:g} cannot be reconstructed from these snapshots at time {target_time}: the best "
        f"combination's profile is off by {error:.1%} (relative L2; at most {MAX_PROFILE_ERROR:.0%} accepted){others}; "
        f"reachable at that time: {where}"
    )


def fit_error(
    snapshots: str | os.PathLike | Sequence[Any], target_sigma_rels: Sequence[float], target_time: int | None = None
) -> np.ndarray:
    """Relative profile error ``||sum_i x_i p_i - p_target|| / ||p_target||`` of the best reconstruction of each
    target at ``target_time`` (default: the newest snapshot time), from snapshot metadata only.

    ``snapshots``: a folder, ``SnapshotInfo``s, or remote index entries (anything with ``time`` and ``gamma``), so
    a tool can tell which targets are reachable (error ``<= MAX_PROFILE_ERROR``) before anything is downloaded.
    """
    target_sigma_rels = check_number_sequence("target_sigma_rels", target_sigma_rels)
    gammas = [sigma_rel_to_gamma(s) for s in target_sigma_rels]
    target_time, used = select_for_target(_as_snapshots(snapshots), target_time)
    if not gammas:
        return np.zeros(0)
    times = [info.time for info in used]
    return solve_profile_coefficients(times, [info.gamma for info in used], [target_time] * len(gammas), gammas)[1]


def reachable_sigma_rel_range(
    snapshots: str | os.PathLike | Sequence[Any],
    target_time: int | None = None,
    *,
    max_error: float = MAX_PROFILE_ERROR,
) -> tuple[float, float] | None:
    """``(lowest, highest)`` sigma_rel reconstructable at ``target_time`` (default: the newest snapshot time) with a
    relative profile error of at most ``max_error`` (``None`` if none is), e.g. the ends of a slider.

    Accepts what :func:`fit_error` accepts; the range is the connected one around the best-fitting target, to
    ~0.05% of sigma_rel (:func:`~diffusers_scalelong.ema.profiles.reachable_interval`).
    """
    target_time, used = select_for_target(_as_snapshots(snapshots), target_time)
    return reachable_interval([info.time for info in used], [info.gamma for info in used], target_time, max_error)


def _accumulate(
    plan: ReconstructionPlan, accumulate_dtype: torch.dtype, dtype: torch.dtype, progress: bool
) -> list[dict[str, torch.Tensor]]:
    """Stream over the plan's snapshots, one tensor at a time, into one accumulator per target."""
    last = plan.snapshots[-1]
    copied = set(last.copied_keys)
    averaged_keys = [k for k in last.shapes if k not in copied]
    outputs: list[dict[str, torch.Tensor]] = [
        {k: torch.zeros(last.shapes[k], dtype=accumulate_dtype) for k in averaged_keys} for _ in plan.target_sigma_rels
    ]
    with ThreadPoolExecutor(max_workers=1) as hasher:  # hashes each tensor while it is added into the outputs
        for info, row in zip(
            tqdm(plan.snapshots, desc="reconstructing EMA", unit="snapshot", disable=not progress),
            plan.coefficients.tolist(),
            strict=True,
        ):
            digest = TensorDigest()
            try:
                with safe_open(str(info.path), framework="pt") as f:
                    for key in averaged_keys:
                        stored = f.get_tensor(key)
                        hashed = hasher.submit(data_sha256, stored)
                        # convert once for several targets; with one target the mixed-dtype add is faster
                        tensor = stored.to(accumulate_dtype) if len(outputs) > 1 else stored
                        for output, weight in zip(outputs, row, strict=True):
                            output[key].add_(tensor, alpha=weight)
                        digest.add(key, stored, hashed.result())
                    copies = {k: f.get_tensor(k) for k in info.copied_keys}
            except (OSError, RuntimeError, ValueError) as error:
                raise ValueError(f"could not read snapshot file {info.path}: {error}") from None
            for key, tensor in copies.items():
                digest.add(key, tensor)
            check_recorded_digest(info.content_sha256, digest.hexdigest(), f"snapshot file {info.path}")
            if info is last:
                buffers = copies
    results = []
    for output in outputs:
        state = {k: v.to(dtype) for k, v in output.items()}
        state.update({k: v.clone() for k, v in buffers.items()})
        results.append({k: state[k] for k in last.shapes})  # the snapshot's key order
    return results


def _accumulate_dtype(name: torch.dtype | str) -> torch.dtype:
    if isinstance(name, torch.dtype) and name in ACCUMULATE_DTYPES.values():
        return name
    key = str(name).removeprefix("torch.")
    if key not in ACCUMULATE_DTYPES:
        raise ValueError(f"accumulate_dtype must be float32 or float64, got {name!r}")
    return ACCUMULATE_DTYPES[key]


def reconstruct_ema(
    snapshots: str | os.PathLike | Sequence[SnapshotInfo],
    target_sigma_rels: Sequence[float],
    target_time: int | None = None,
    *,
    dtype: torch.dtype | str = torch.float32,
    accumulate_dtype: torch.dtype | str = torch.float32,
    progress: bool = False,
    allow_inexact: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """Reconstructed model ``state_dict``s, one per target sigma_rel, at ``target_time`` (default: newest).

    A target the snapshots cannot reach within ``MAX_PROFILE_ERROR`` is refused unless ``allow_inexact=True``
    (see :func:`plan_reconstruction`).

    Examples:
        >>> import tempfile
        >>> import torch
        >>> from diffusers_scalelong import PowerFunctionEMA, reconstruct_ema
        >>> model = torch.nn.Linear(2, 1)
        >>> ema = PowerFunctionEMA(model, sigma_rels=(0.05, 0.10))
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     for step in range(1, 101):
        ...         with torch.no_grad():
        ...             _ = model.weight.fill_(step / 100)  # stands for an optimiser step
        ...         ema.update(model, step)
        ...         if step % 20 == 0:  # a snapshot of both profiles every 20 steps
        ...             _ = ema.save_snapshots(folder, step, is_main_process=True)
        ...     short, long = reconstruct_ema(folder, target_sigma_rels=[0.04, 0.15])
        >>> sorted(short)  # a state_dict for the model
        ['bias', 'weight']
        >>> bool(long["weight"][0, 0] < short["weight"][0, 0] < 1)  # a longer EMA lags further behind the weights
        True
    """
    plan = plan_reconstruction(snapshots, target_sigma_rels, target_time, allow_inexact=allow_inexact)
    return _accumulate(plan, _accumulate_dtype(accumulate_dtype), storage_dtype(dtype), progress)


def reconstruction_dirname(time: int, sigma_rel: float) -> str:
    """Folder name of a reconstructed model: ``phema-<time:010d>-<sigma_rel>``."""
    return snapshot_filename(time, sigma_rel).removesuffix(".safetensors")


def save_reconstructed_models(
    snapshots: str | os.PathLike | Sequence[SnapshotInfo],
    output_dir: str | os.PathLike,
    target_sigma_rels: Sequence[float],
    target_time: int | None = None,
    *,
    dtype: torch.dtype | str = torch.float32,
    accumulate_dtype: torch.dtype | str = torch.float32,
    progress: bool = False,
    overwrite: bool = False,
    allow_inexact: bool = False,
) -> list[Path]:
    """Reconstruct and write one folder per target under ``output_dir``; returns the folders.

    Diffusers models (snapshots that record a ``model_class``) are written with ``save_pretrained`` and load with
    ``from_pretrained``; other models as ``model.safetensors``. Each folder also gets ``phema.json`` (sigma_rel,
    gamma, time, snapshots, coefficients, expected profile error). All checks run before anything is written, and
    each folder appears at once (renamed from a temporary folder). ``allow_inexact``: see :func:`plan_reconstruction`.
    """
    plan = plan_reconstruction(snapshots, target_sigma_rels, target_time, allow_inexact=allow_inexact)
    return save_planned_models(
        plan, output_dir, dtype=dtype, accumulate_dtype=accumulate_dtype, progress=progress, overwrite=overwrite
    )


def save_planned_models(
    plan: ReconstructionPlan,
    output_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | str = torch.float32,
    accumulate_dtype: torch.dtype | str = torch.float32,
    progress: bool = False,
    overwrite: bool = False,
) -> list[Path]:
    """:func:`save_reconstructed_models` for a plan already solved (e.g. one that was printed first)."""
    dtype, accumulate_dtype = storage_dtype(dtype), _accumulate_dtype(accumulate_dtype)
    info = plan.snapshots[-1]
    model_class = resolve_model_class(info.model_class) if info.model_class else None
    if model_class is not None:
        extra = check_model_matches(info.model_class, info.model_config, info.shapes, info.copied_keys, str(info.path))
        if extra:
            raise ValueError(
                f"the snapshots hold {len(extra)} tensors that a {model_class.__name__} built from their config lacks "
                f"(e.g. {extra[0]!r}: added after it was built, as apply_lsc adds LS gates); use reconstruct_ema and "
                "load the state_dicts into such a model"
            )
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"output_dir {output_dir} exists and is not a folder")
    clean_stale_temporaries(output_dir, ("phema-*",))  # an earlier run killed mid-write: its folders put right
    destinations = [output_dir / reconstruction_dirname(plan.target_time, s) for s in plan.target_sigma_rels]
    if len(set(destinations)) != len(destinations):
        raise ValueError(f"target sigma_rels must be distinct, got {plan.target_sigma_rels}")
    links = [str(d) for d in destinations if d.is_symlink()]
    if links:
        raise ValueError(
            f"output folders are symbolic links (only real folders inside output_dir are written): {links}"
        )
    existing = [str(d) for d in destinations if d.exists()]
    if existing and not overwrite:
        raise ValueError(f"output folders already exist (use overwrite): {existing}")

    states = _accumulate(plan, accumulate_dtype, dtype, progress)
    for state, sigma_rel in zip(states, plan.target_sigma_rels, strict=True):
        check_finite(state, f"the reconstruction for sigma_rel={sigma_rel} at time {plan.target_time}")
    created_output_dir = not output_dir.exists()
    output_dir.mkdir(parents=True, exist_ok=True)
    staging: list[Path] = []
    try:
        for state, sigma_rel, gamma, column, error, destination in zip(
            states,
            plan.target_sigma_rels,
            plan.target_gammas,
            plan.coefficients.T,
            plan.relative_errors,
            destinations,
            strict=True,
        ):
            folder = staging_folder(output_dir, destination.name)
            staging.append(folder)
            if model_class is not None:
                model = model_class.from_config(info.model_config)
                model.load_state_dict(state, strict=True)
                torch.nn.Module.to(model, dtype)  # plain cast: every tensor in the requested dtype
                model.save_pretrained(folder, safe_serialization=True)
            else:
                save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
            record = _provenance(plan, sigma_rel, gamma, column, error, dtype)
            record["files"] = folder_manifest(folder)
            (folder / PROVENANCE_FILENAME).write_text(json.dumps(record, indent=2) + "\n")
        for folder, destination in zip(staging, destinations, strict=True):
            replace_path(folder, destination)  # the old folder moved aside first: a kill leaves old or new
    except BaseException:
        for folder in staging:
            shutil.rmtree(folder, ignore_errors=True)
        if created_output_dir and not any(output_dir.iterdir()):
            output_dir.rmdir()
        raise
    return destinations


def read_reconstruction_record(model_folder: str | os.PathLike) -> dict[str, Any]:
    """A reconstructed folder's ``phema.json``, after checking every file it lists against its recorded SHA-256.

    Raises ``ValueError`` naming the file (:class:`~diffusers_scalelong.integrity.IntegrityError` for damaged
    content); records written before checksums existed are returned unverified.
    """
    path = Path(model_folder) / PROVENANCE_FILENAME
    try:
        record = json.loads(path.read_text())
        files = record.get("files")
        if not (files is None or (isinstance(files, dict) and all(isinstance(v, str) for v in files.values()))):
            raise TypeError("'files' must map file names to SHA-256 strings")
    except (OSError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"{path} is not a valid reconstruction record: {error!r}") from None
    if files is not None:
        verify_manifest(model_folder, files, exclude=(PROVENANCE_FILENAME, "README.md"))
    return record


def _provenance(
    plan: ReconstructionPlan, sigma_rel: float, gamma: float, column: np.ndarray, error: float, dtype: torch.dtype
) -> dict[str, Any]:
    return {
        "sigma_rel": sigma_rel,
        "gamma": gamma,
        "time": plan.target_time,
        "time_unit": plan.snapshots[-1].time_unit,
        "run_id": plan.snapshots[-1].run_id,
        "dtype": str(dtype).removeprefix("torch."),
        "relative_profile_error": float(error),
        "snapshots": [
            {"file": info.path.name, "time": info.time, "sigma_rel": info.sigma_rel, "coefficient": float(x)}
            for info, x in zip(plan.snapshots, column, strict=True)
        ],
        "library_version": __version__,
    }
