"""Where post-hoc EMA snapshots come from, and which targets ``(time, sigma_rel)`` they can reach.

A source is a training output folder (snapshots in ``ema_snapshots/`` or ``train/ema_snapshots/``), a snapshot
folder, or a Hub repository of snapshots (``namespace/name``; only the index is read up front, and only the
snapshots a target needs are downloaded, as :func:`~diffusers_scalelong.ema.reconstruct_from_hub` does).

A target at time ``T`` combines the snapshots with ``0 < t_i <= T`` (EDM2 Algorithm 3); its fit error is the
relative L2 distance ``||sum_i x_i p_i - p_target|| / ||p_target||`` between the combined and the wanted profile.
A target is *reachable* when that error is at most ``MAX_PROFILE_ERROR`` (0.1, the bound
:func:`~diffusers_scalelong.ema.plan_reconstruction` applies; see ``profiles``); further out the least-squares
weights grow large and the reconstruction no longer averages the trajectory it claims to.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..hub_transfer import DEFAULT_PATH_IN_REPO, list_remote_snapshots, pull_snapshots
from ..profiles import MAX_PROFILE_ERROR, reachable_interval, sigma_rel_to_gamma, solve_profile_coefficients
from ..reconstruct import ReconstructionPlan, plan_reconstruction
from ..snapshots import SnapshotInfo, list_snapshots

SNAPSHOT_SUBFOLDERS = ("", "ema_snapshots", "train/ema_snapshots")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def find_snapshot_folder(folder: Path) -> Path:
    """The folder holding the snapshots of ``folder`` (itself, ``ema_snapshots/`` or ``train/ema_snapshots/``)."""
    for sub in SNAPSHOT_SUBFOLDERS:
        candidate = folder / sub if sub else folder
        if candidate.is_dir() and any(candidate.glob("phema-*.safetensors")):
            return candidate
    raise ValueError(
        f"no snapshot files (phema-*.safetensors) in {folder} nor in its ema_snapshots/ or train/ema_snapshots/; "
        "train with --ema_sigma_rels (post-hoc EMA) or point at a snapshot folder"
    )


class SnapshotSource:
    """The snapshots of one training run, local or on the Hub, with the planning of targets over them.

    ``entries`` carry each snapshot's ``time``, ``sigma_rel``, ``gamma``, ``run_id``, ``model_class`` and
    ``model_config`` (local ``SnapshotInfo`` or remote index entries). Raises ``ValueError`` naming the problem for
    a folder without snapshots, snapshots of two runs or models, and ``HubAccessError`` for an unreachable Hub.
    """

    def __init__(
        self,
        source: str | os.PathLike,
        *,
        path_in_repo: str = DEFAULT_PATH_IN_REPO,
        revision: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        endpoint: str | None = None,
        token: str | bool | None = None,
    ) -> None:
        self.hub_options = dict(
            path_in_repo=path_in_repo, revision=revision, cache_dir=cache_dir, endpoint=endpoint, token=token
        )
        path = Path(source)
        if path.exists():
            if not path.is_dir():
                raise ValueError(f"source {path} is not a folder")
            self.repo_id = None
            self.folder = find_snapshot_folder(path)
            self.entries: list[Any] = list_snapshots(self.folder)
            self.description = str(self.folder)
        elif _REPO_ID.match(str(source)):
            self.repo_id, self.folder = str(source), None
            self.entries = list_remote_snapshots(
                self.repo_id, path_in_repo=path_in_repo, revision=revision, cache_dir=cache_dir, endpoint=endpoint,
                token=token,
            )  # fmt: skip
            self.description = f"{self.repo_id} (Hub, {path_in_repo or '/'})"
        else:
            raise ValueError(f"source {source!r} is neither an existing folder nor a Hub repo id (namespace/name)")
        self.entries = [entry for entry in self.entries if entry.time > 0]
        if not self.entries:
            raise ValueError(f"all snapshots in {self.description} are at time 0; nothing to reconstruct from")
        self._check_one_run()
        self.times = sorted({entry.time for entry in self.entries})
        self.time_unit = self.entries[-1].time_unit
        self.model_class: str | None = self.entries[-1].model_class
        self.model_config: dict[str, Any] | None = self.entries[-1].model_config
        self._pulled: dict[int, list[SnapshotInfo]] = {}

    def _check_one_run(self) -> None:
        first = self.entries[0]
        for entry in self.entries:
            if entry.run_id != first.run_id:
                raise ValueError(
                    f"{self.description} holds snapshots of two training runs: {_name(first)} (run "
                    f"{first.run_id or 'unnamed'}) and {_name(entry)} (run {entry.run_id or 'unnamed'}); "
                    "keep one run's snapshots per folder"
                )
            if (entry.model_class, entry.model_config) != (first.model_class, first.model_config):
                raise ValueError(f"{self.description} holds snapshots of two models: {_name(first)} and {_name(entry)}")
        if self.folder is not None:  # the package's own checks (shapes, duplicates, units) on the local headers
            newest = self.entries[-1]  # its own profile: reachable exactly
            plan_reconstruction(self.entries, [newest.sigma_rel], newest.time)

    @property
    def tracked_sigma_rels(self) -> list[float]:
        return sorted({entry.sigma_rel for entry in self.entries})

    @property
    def time_step(self) -> int:
        """The greatest common divisor of the snapshot times: a time slider with this step lands on each of them."""
        return functools.reduce(math.gcd, self.times)

    def _used(self, time: int) -> list[Any]:
        if isinstance(time, bool) or not isinstance(time, (int, np.integer)):
            raise ValueError(f"time must be an integer training time, got {time!r}")
        if not self.times[0] <= time <= self.times[-1]:
            raise ValueError(
                f"time={time} is outside the snapshots' range: {self.times[0]} to {self.times[-1]} {self.time_unit}"
            )
        return [entry for entry in self.entries if entry.time <= time]

    def plan(self, sigma_rel: float, time: int, snapshots: Sequence[Any] | None = None) -> ReconstructionPlan:
        """The least-squares combination for one target; ``ValueError`` when the snapshots cannot reach it.

        ``snapshots`` (default: this source's entries up to ``time``) may be the local copies of those entries.
        """
        gamma = sigma_rel_to_gamma(sigma_rel)
        used = sorted(snapshots if snapshots is not None else self._used(time), key=lambda e: (e.time, e.sigma_rel))
        with np.errstate(invalid="ignore", divide="ignore"):  # a target no snapshot overlaps: NaN, refused below
            coefficients, errors = solve_profile_coefficients(
                [e.time for e in used], [e.gamma for e in used], [time], [gamma]
            )
        if not errors[0] <= MAX_PROFILE_ERROR:
            reach = self.reachable_range(time)
            where = f"reachable at time {time}: {reach[0]:.3f} to {reach[1]:.3f}" if reach else "none at that time"
            raise ValueError(
                f"sigma_rel={sigma_rel:g} at time {time} is out of reach of the snapshots: the best fit of its profile "
                f"is off by {errors[0]:.1%} (at most {MAX_PROFILE_ERROR:.0%} allowed; {where})"
            )
        return ReconstructionPlan(int(time), (float(sigma_rel),), (gamma,), tuple(used), coefficients, errors)

    @functools.lru_cache(maxsize=64)  # noqa: B019 - one source per app; the cache lives as long as it does
    def reachable_range(self, time: int) -> tuple[float, float] | None:
        """``(lowest, highest)`` sigma_rel (3 decimals, rounded inwards) reachable at ``time``, or ``None``."""
        used = self._used(time)
        with np.errstate(invalid="ignore", divide="ignore"):  # between snapshot times some targets fit nothing
            span = reachable_interval([e.time for e in used], [e.gamma for e in used], time)
        if span is None:
            return None
        low, high = math.ceil(span[0] * 1000) / 1000, math.floor(span[1] * 1000) / 1000
        return (low, high) if low <= high else None

    def local_snapshots(self, time: int) -> list[SnapshotInfo]:
        """Local files of the snapshots up to ``time`` (from the Hub: downloaded through its cache, once)."""
        used = self._used(time)
        if self.folder is not None:
            return used
        newest = max(entry.time for entry in used)
        if newest not in self._pulled:
            self._pulled[newest] = pull_snapshots(self.repo_id, target_time=newest, **self.hub_options)
        return self._pulled[newest]


def _name(entry: Any) -> str:
    return entry.path.name if hasattr(entry, "path") else entry.filename


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``SOURCE`` argument and the Hub options shared by the explorer and the sweep commands."""
    parser.add_argument(
        "source",
        nargs="?",
        help="a training output folder, a folder of phema-*.safetensors snapshots, or a Hub repo id of snapshots",
    )
    hub = parser.add_argument_group("snapshots on the Hub")
    hub.add_argument("--path_in_repo", default=DEFAULT_PATH_IN_REPO, help="snapshot folder inside the repo")
    hub.add_argument("--revision", default=None, help="branch, tag or commit of the repo")
    hub.add_argument("--endpoint", default=None, help="Hub endpoint (default: HF_ENDPOINT or the Hub)")
    hub.add_argument("--cache_dir", default=None, help="Hub cache folder for the downloaded snapshots")


def source_from_args(args: argparse.Namespace) -> SnapshotSource:
    if not args.source:
        raise ValueError("give SOURCE: a training output folder, a snapshot folder or a Hub repo id")
    return SnapshotSource(
        args.source,
        path_in_repo=args.path_in_repo,
        revision=args.revision,
        cache_dir=args.cache_dir,
        endpoint=args.endpoint,
    )
