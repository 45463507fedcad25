"""Which training run an output folder belongs to, who may write into it, and how ``overwrite_output_dir``
replaces an earlier run.

A fresh run gets a random run id (``uuid4().hex``), recorded in every checkpoint's ``training_state.json`` and in
every post-hoc EMA snapshot's header; a resumed run continues with the id of its checkpoint. Files written before
run ids existed read as one unnamed run (``None``).

Rules (:func:`start_run`):

* one writer per folder: the main process locks the folder for the whole run (:mod:`.folder_lock`); a second run
  into it is refused, naming the first one's pid and host;
* a fresh run refuses a folder that already holds checkpoints or snapshots unless ``overwrite_output_dir``;
  a resume refuses a folder whose checkpoints or snapshots come from more than one run;
* ``overwrite_output_dir`` replaces, never deletes first: :meth:`RunStart.set_aside` moves the earlier run's
  checkpoints, snapshots and sample grids into one hidden folder ``.set-aside-<new run id>`` once every check has
  passed; they are deleted when the new run has written its first checkpoint (or its final pipeline), and put back
  when it stops before. A set-aside folder left by a killed run is settled by the same rule at the next start.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
import weakref
from pathlib import Path

from ..atomic import atomic_write_text
from ..ema.snapshots import list_snapshots
from .checkpoint import CHECKPOINT_PATTERN, Checkpoint
from .folder_lock import LOCK_FILE, FolderLock, lock_folder

SNAPSHOT_FOLDER = "ema_snapshots"
SAMPLES_FOLDER = "samples"
SET_ASIDE_PREFIX = ".set-aside-"
SET_ASIDE_RECORD = "set_aside.json"
PIPELINE_INDEX = "model_index.json"
_FAILED = ".failed"  # inside a set-aside folder: what a run that stopped before its first checkpoint had written
_OLD_DISCARD_PREFIX = ".discarded-"  # left by earlier versions, which deleted the earlier run at once
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


def run_entries(output_dir: str | os.PathLike) -> list[Path]:
    """A run's entries in ``output_dir``: its ``checkpoint-<step>`` folders, snapshot folder and sample grids."""
    output_dir = Path(output_dir)
    entries = sorted(path for path in output_dir.iterdir() if CHECKPOINT_PATTERN.match(path.name))
    return entries + [path for path in (output_dir / SNAPSHOT_FOLDER, output_dir / SAMPLES_FOLDER) if path.exists()]


def _check_single_run(runs: dict[str | None, list[Path]], run_id: str | None, where: str) -> None:
    """Raise ``ValueError`` naming both run ids and a file of each when ``runs`` holds a run other than ``run_id``."""
    for other, files in runs.items():
        if other != run_id:
            mine = runs.get(run_id, [where])
            raise ValueError(
                f"the output folder mixes two training runs: {mine[0]} belongs to run {_run_name(run_id)}, but "
                f"{files[0]} (and {len(files) - 1} more) to run {_run_name(other)}; move the other run's files away "
                "or train into another output_dir"
            )


# ------------------------------------------------------------------------------------------------ set aside


def _signature(path: Path) -> list[int] | None:
    """``[inode, size, mtime_ns]`` of a file, or None: tells whether a file was replaced since."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    return [info.st_ino, info.st_size, info.st_mtime_ns]


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def set_aside(output_dir: Path, entries: list[Path], run_id: str) -> Path:
    """Move ``entries`` of ``output_dir`` into the hidden folder ``.set-aside-<run_id>``; returns that folder.

    Its record (the new run's id, the names moved, the final pipeline's index file as it was) is written before
    anything moves, so a kill at any point leaves every entry either in place or in the folder, with the record.
    """
    aside = output_dir / f"{SET_ASIDE_PREFIX}{run_id}"
    aside.mkdir()
    record = {"run_id": run_id, "moved": [e.name for e in entries], "pipeline": _signature(output_dir / PIPELINE_INDEX)}
    atomic_write_text(aside / SET_ASIDE_RECORD, json.dumps(record))
    for entry in entries:
        os.replace(entry, aside / entry.name)
    return aside


def _new_run_took_over(output_dir: Path, record: dict) -> str | None:
    """What shows that the run which set the earlier one aside got going, or None: its first complete checkpoint
    or its final pipeline (``model_index.json`` replaced)."""
    for checkpoint in Checkpoint.find_all(output_dir):
        try:
            if checkpoint.read_state()["run_id"] == record["run_id"]:
                return checkpoint.path.name
        except ValueError:
            continue
    if _signature(output_dir / PIPELINE_INDEX) != record["pipeline"]:
        return "its final pipeline"
    return None


def delete_set_aside(aside: Path) -> None:
    """Delete a set-aside folder: its record first, so that a kill midway leaves a folder known to be doomed."""
    (aside / SET_ASIDE_RECORD).unlink(missing_ok=True)
    shutil.rmtree(aside)


def settle_set_aside(output_dir: Path, aside: Path) -> None:
    """Settle a set-aside folder whose run has stopped (or was killed).

    The new run took over (its first checkpoint or final pipeline exists): the earlier run is deleted. Otherwise the
    earlier run is put back: what the stopped run had written in its place (snapshots, sample grids, unfinished
    checkpoints) is moved into the set-aside folder, the earlier entries are moved back, then the folder is deleted.
    Every step can be killed and repeated; a folder without its record was being deleted and is deleted.
    """
    try:
        record = json.loads((aside / SET_ASIDE_RECORD).read_text(encoding="utf-8"))
        run_id, moved = str(record["run_id"]), [str(name) for name in record["moved"]]
    except FileNotFoundError:
        shutil.rmtree(aside)
        return
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{aside / SET_ASIDE_RECORD} cannot be read ({error}); it holds an earlier run set aside by "
            "overwrite_output_dir: move its entries back into the output folder or delete it"
        ) from error
    evidence = _new_run_took_over(output_dir, record)
    if evidence is not None:
        delete_set_aside(aside)
        logger.warning("deleted the earlier run set aside in %s: run %s has written %s", aside, run_id, evidence)
        return
    failed = aside / _FAILED
    failed.mkdir(exist_ok=True)
    displaced = []
    for entry in run_entries(output_dir):
        if entry.name not in moved or (aside / entry.name).exists():  # written by the stopped run
            _remove(failed / entry.name)
            os.replace(entry, failed / entry.name)
            displaced.append(entry.name)
    restored = [name for name in moved if (aside / name).exists()]
    for name in restored:
        os.replace(aside / name, output_dir / name)
    delete_set_aside(aside)
    logger.warning(
        "run %s stopped before its first checkpoint: put the earlier run back (%s)%s",
        run_id,
        ", ".join(restored) or "nothing left to move",
        f"; deleted what it had written ({', '.join(displaced)})" if displaced else "",
    )


def recover_set_aside(output_dir: str | os.PathLike) -> None:
    """Settle what killed runs left in ``output_dir`` (set-aside folders; an earlier version's half-deleted
    ``.discarded-*`` folders). Call only while holding the folder's lock."""
    output_dir = Path(output_dir)
    for aside in sorted(output_dir.glob(f"{SET_ASIDE_PREFIX}*")):
        settle_set_aside(output_dir, aside)
    for leftover in output_dir.glob(f"{_OLD_DISCARD_PREFIX}*"):
        shutil.rmtree(leftover)
        logger.warning("removed %s, left half-deleted by an interrupted overwrite_output_dir", leftover)


# ------------------------------------------------------------------------------------------------ the run


class _Hold:
    """The main process's hold on its output folder: the lock and the earlier run set aside (if any)."""

    def __init__(self, output_dir: Path | None, lock: FolderLock | None):
        self.output_dir, self.lock, self.aside = output_dir, lock, None

    def restore(self) -> None:
        aside, self.aside = self.aside, None
        if aside is not None and aside.exists():
            settle_set_aside(self.output_dir, aside)

    def close(self) -> None:
        try:
            self.restore()
        finally:
            if self.lock is not None:
                self.lock.release()


class RunStart:
    """How a training run starts and what it holds while it runs.

    Attributes: ``run_id``; ``resume_from`` (the checkpoint resumed, or ``None``); ``discard``: the earlier run's
    entries that ``overwrite_output_dir`` replaces (empty on other processes than the main one).

    The main process's instance holds the output folder's lock until :meth:`close` (or the ``with`` block ends, or
    the object is garbage-collected, or the process ends). Closing settles an earlier run set aside and not yet
    dropped: put back unless this run has written a checkpoint or its final pipeline.
    """

    def __init__(
        self,
        run_id: str | None,
        resume_from: Checkpoint | None,
        discard: tuple[Path, ...] = (),
        output_dir: str | os.PathLike | None = None,
        lock: FolderLock | None = None,
        options: tuple[str | None, bool] = (None, False),
        is_main_process: bool = True,
    ):
        self.run_id = run_id
        self.resume_from = resume_from
        self.discard = tuple(discard)
        self._options = options  # (resume, overwrite): to decide again under the lock (hold_folder)
        self._main = is_main_process
        self._hold = _Hold(None if output_dir is None else Path(output_dir), lock)
        self._close = weakref.finalize(self, self._hold.close)

    @property
    def holds_lock(self) -> bool:
        return self._hold.lock is not None and self._hold.lock.held

    def hold_folder(self, output_dir: str | os.PathLike | None = None) -> None:
        """Lock the output folder now, for a run decided while the folder did not exist yet (or with ``start_run(...,
        hold=False)``); call once the folder is created (a no-op on other processes than the main one, or when held).
        The start is decided again under the lock: ``ValueError`` when the folder is in use or now holds what would
        have changed the decision."""
        if self._hold.lock is not None or not self._main:
            return
        output_dir = Path(output_dir if output_dir is not None else self._hold.output_dir)
        held = start_run(output_dir, *self._options, is_main_process=True)
        now = (held.resume_from and held.resume_from.path, sorted(held.discard))
        if now != (self.resume_from and self.resume_from.path, sorted(self.discard)):
            held.close()
            raise ValueError(
                f"output_dir {str(output_dir)!r} changed while this run was being set up (another run wrote into "
                "it); start again"
            )
        held._close.detach()
        self._hold.output_dir, self._hold.lock = output_dir, held._hold.lock
        self.discard = held.discard

    def set_aside(self) -> Path | None:
        """Move :attr:`discard` into ``.set-aside-<run_id>``; call once every check has passed, just before the
        run first writes. Returns the folder (None when there is nothing to replace, e.g. on other processes)."""
        present = [path for path in self.discard if path.exists()]
        if not present or self._hold.aside is not None:
            return self._hold.aside
        self._hold.aside = set_aside(self._hold.output_dir, present, self.run_id)
        logger.warning(
            "overwrite_output_dir: moved the earlier run's %s into %s; it is deleted once this run writes its "
            "first checkpoint, and put back if it stops before",
            ", ".join(path.name for path in present),
            self._hold.aside.name,
        )
        return self._hold.aside

    def drop_set_aside(self) -> None:
        """Delete the earlier run set aside; call once this run's first checkpoint is complete (or it finished)."""
        aside, self._hold.aside = self._hold.aside, None
        if aside is not None and aside.exists():
            delete_set_aside(aside)
            logger.warning("overwrite_output_dir: deleted the earlier run (%s)", aside.name)

    def restore_set_aside(self) -> None:
        """The run is stopping on an error: put the earlier run back (unless this run has already written a
        checkpoint or its final pipeline; then the earlier run is deleted)."""
        self._hold.restore()

    def close(self) -> None:
        """Settle what is set aside as :meth:`restore_set_aside` does, then release the folder's lock."""
        self._close()

    def __enter__(self) -> RunStart:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def clear_discarded(self, output_dir: str | os.PathLike | None = None) -> None:
        """Deprecated: :meth:`hold_folder` then :meth:`set_aside` (the earlier run is settled when the run closes).
        Main process only."""
        self.hold_folder(output_dir)
        self.set_aside()


def _is_main_process_from_env() -> bool:
    """Whether this is the main process by ``RANK`` (set by ``torchrun`` and ``accelerate launch``; unset: one process)."""
    return os.environ.get("RANK", "0") == "0"


def start_run(
    output_dir: str | os.PathLike,
    resume: str | None,
    overwrite: bool,
    is_main_process: bool | None = None,
    hold: bool = True,
) -> RunStart:
    """Decide how a run starts from ``resume_from_checkpoint`` (``resume``) and ``overwrite_output_dir``.

    On the main process (``is_main_process``; ``None``: from the ``RANK`` environment variable) an existing folder
    is locked first and what killed runs left is settled (:func:`recover_set_aside`); other processes only read.
    A folder that does not exist yet (or ``hold=False``) is only read, not created: the main process then calls
    :meth:`RunStart.hold_folder` once it has created it. Nothing of the earlier run moves here (see
    :meth:`RunStart.set_aside`). Raises ``ValueError`` naming the options, files, run ids or the other run holding
    the folder when it may not be used (the lock is then released).
    """
    output_dir = Path(output_dir)
    if overwrite and resume is not None:
        raise ValueError("pass either resume_from_checkpoint or overwrite_output_dir, not both")
    main = _is_main_process_from_env() if is_main_process is None else is_main_process
    lock = lock_folder(output_dir) if main and hold and output_dir.is_dir() else None
    try:
        if lock is not None:
            recover_set_aside(output_dir)
        run_id, resume_from, discard = _decide(output_dir, resume, overwrite)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return RunStart(run_id, resume_from, discard if main else (), output_dir, lock, (resume, overwrite), main)


def _decide(output_dir: Path, resume: str | None, overwrite: bool) -> tuple[str | None, Checkpoint | None, tuple]:
    """``(run id, checkpoint resumed, entries to replace)``; reads only (a missing folder holds no run)."""
    if not output_dir.is_dir():
        if resume not in (None, "latest"):
            raise ValueError(f"resume_from_checkpoint {resume!r}: output_dir {str(output_dir)!r} does not exist")
        return new_run_id(), None, ()
    resume_from = Checkpoint.resolve(resume, output_dir)
    runs = recorded_runs(output_dir)
    if resume_from is not None:
        run_id = resume_from.read_state()["run_id"]
        _check_single_run(runs, run_id, str(resume_from.path))
        return run_id, resume_from, ()
    existing = sorted(path for path in output_dir.iterdir() if CHECKPOINT_PATTERN.match(path.name))
    snapshots = output_dir / SNAPSHOT_FOLDER
    existing += [path for files in runs.values() for path in files if path.parent == snapshots]
    if existing and not overwrite:
        names = ", ".join(str(path.relative_to(output_dir)) for path in existing[:3])
        ids = ", ".join(_run_name(run_id) for run_id in runs) or "unknown"
        found = f"({names}{', ...' if len(existing) > 3 else ''}; run {ids})"
        if resume is None:
            raise ValueError(
                f"output_dir {str(output_dir)!r} already holds another training run's checkpoints or snapshots "
                f"{found}; continue it with resume_from_checkpoint latest, choose another output_dir, or pass "
                "overwrite_output_dir to replace them (they are deleted once the new run writes its first "
                "checkpoint)"
            )
        raise ValueError(
            f"resume_from_checkpoint latest: {str(output_dir)!r} holds no checkpoint to resume, but another "
            f"training run's snapshots {found}; to start afresh, pass overwrite_output_dir instead (it replaces "
            "them) or choose another output_dir"
        )
    return new_run_id(), None, tuple(run_entries(output_dir)) if overwrite else ()


__all__ = [
    "LOCK_FILE",
    "RunStart",
    "SAMPLES_FOLDER",
    "SNAPSHOT_FOLDER",
    "new_run_id",
    "recorded_runs",
    "recover_set_aside",
    "run_entries",
    "start_run",
]
