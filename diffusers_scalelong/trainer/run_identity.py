"""Which training run an output folder belongs to, and whether a new run may write into it.

A fresh run gets a random run id (``uuid4().hex``), recorded in every checkpoint's ``training_state.json`` and in
every post-hoc EMA snapshot's header; a resumed run continues with the id of its checkpoint. Files written before
run ids existed read as one unnamed run (``None``).

Rules (:func:`start_run`): a fresh run refuses an output folder that already holds checkpoints or snapshots unless
``--overwrite_output_dir`` is given, which clears them first (moved aside into one hidden folder, then deleted, so a
kill in between leaves either the old files or none, never a half-deleted checkpoint); a resume refuses a folder
whose checkpoints or snapshots come from more than one run.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..ema.snapshots import list_snapshots
from .checkpoint import CHECKPOINT_PATTERN, Checkpoint

SNAPSHOT_FOLDER = "ema_snapshots"
SAMPLES_FOLDER = "samples"
DISCARD_PREFIX = ".discarded-"
logger = logging.getLogger(__name__)


def new_run_id() -> str:
    """A fresh random run id (32 hex digits)."""
    return uuid.uuid4().hex


def _run_name(run_id: str | None) -> str:
    return run_id or "unnamed (written before run ids)"


def recorded_runs(output_dir: str | os.PathLike) -> dict[str | None, list[Path]]:
    """``{run id: files}`` for the complete, readable checkpoints and the snapshots in ``output_dir``.

    A checkpoint whose record cannot be read is left out here (a resume skips or refuses it as damaged).
    """
    runs: dict[str | None, list[Path]] = {}
    for checkpoint in Checkpoint.find_all(output_dir):
        try:
            run_id = checkpoint.read_state()["run_id"]
        except ValueError:
            continue
        runs.setdefault(run_id, []).append(checkpoint.path)
    snapshots = Path(output_dir) / SNAPSHOT_FOLDER
    if snapshots.is_dir():
        for info in list_snapshots(snapshots):
            runs.setdefault(info.run_id, []).append(info.path)
    return runs


def _check_single_run(runs: dict[str | None, list[Path]], run_id: str | None, where: str) -> None:
    """Raise ``ValueError`` naming both run ids and a file of each when ``runs`` holds a run other than ``run_id``."""
    for other, files in runs.items():
        if other != run_id:
            mine = runs.get(run_id, [where])
            raise ValueError(
                f"the output folder mixes two training runs: {mine[0]} belongs to run {_run_name(run_id)}, but "
                f"{files[0]} (and {len(files) - 1} more) to run {_run_name(other)}; move the other run's files away "
                "or train into another --output_dir"
            )


@dataclass(frozen=True)
class RunStart:
    """How a training run starts: its run id, the checkpoint it resumes (or ``None``), and what
    ``--overwrite_output_dir`` clears before anything is written."""

    run_id: str | None
    resume_from: Checkpoint | None
    discard: tuple[Path, ...] = ()

    def clear_discarded(self, output_dir: str | os.PathLike) -> None:
        """Move everything in :attr:`discard` into one hidden folder of ``output_dir``, then delete that folder
        (and the leftovers of earlier clearings that were killed). Call on the main process only."""
        output_dir = Path(output_dir)
        aside = output_dir / f"{DISCARD_PREFIX}{uuid.uuid4().hex[:12]}"
        present = [path for path in self.discard if path.exists()]
        if present:
            aside.mkdir()
            for path in present:
                os.replace(path, aside / path.name)
            logger.warning("--overwrite_output_dir: deleted %s", ", ".join(str(path) for path in present))
        for leftover in output_dir.glob(f"{DISCARD_PREFIX}*"):
            shutil.rmtree(leftover, ignore_errors=True)


def start_run(output_dir: str | os.PathLike, resume: str | None, overwrite: bool) -> RunStart:
    """Decide how a run starts from ``--resume_from_checkpoint`` (``resume``) and ``--overwrite_output_dir``.

    Reads only; raises ``ValueError`` naming the options, files and run ids when the folder may not be used.
    """
    output_dir = Path(output_dir)
    if overwrite and resume is not None:
        raise ValueError("pass either --resume_from_checkpoint or --overwrite_output_dir, not both")
    resume_from = Checkpoint.resolve(resume, output_dir)
    runs = recorded_runs(output_dir)
    if resume_from is not None:
        run_id = resume_from.read_state()["run_id"]
        _check_single_run(runs, run_id, str(resume_from.path))
        return RunStart(run_id, resume_from)
    existing = sorted(path for path in output_dir.iterdir() if CHECKPOINT_PATTERN.match(path.name))
    snapshots = output_dir / SNAPSHOT_FOLDER
    existing += [path for files in runs.values() for path in files if path.parent == snapshots]
    if existing and not overwrite:
        names = ", ".join(str(path.relative_to(output_dir)) for path in existing[:3])
        ids = ", ".join(_run_name(run_id) for run_id in runs) or "unknown"
        found = f"({names}{', ...' if len(existing) > 3 else ''}; run {ids})"
        if resume is None:
            raise ValueError(
                f"--output_dir {str(output_dir)!r} already holds another training run's checkpoints or snapshots "
                f"{found}; continue it with --resume_from_checkpoint latest, choose another --output_dir, or pass "
                "--overwrite_output_dir to delete them first"
            )
        raise ValueError(
            f"--resume_from_checkpoint latest: {str(output_dir)!r} holds no checkpoint to resume, but another "
            f"training run's snapshots {found}; to start afresh, pass --overwrite_output_dir instead (it deletes "
            "them first) or choose another --output_dir"
        )
    discard = tuple(path for path in output_dir.iterdir() if CHECKPOINT_PATTERN.match(path.name))
    discard += tuple(path for path in (snapshots, output_dir / SAMPLES_FOLDER) if path.exists())
    return RunStart(new_run_id(), None, discard if overwrite else ())


__all__ = ["RunStart", "SNAPSHOT_FOLDER", "new_run_id", "recorded_runs", "start_run"]
