"""One writer per output folder: an exclusive, non-blocking ``flock`` on ``<folder>/.run.lock`` held for a whole run.

The operating system drops the lock when the process holding it ends, however it ends, so a killed run never leaves
a stale lock behind. The lock file records the holder's process id, host and start time, which a refused run names.
``flock`` works on local file systems and on NFS (Linux emulates it there with POSIX record locks). Where ``fcntl``
does not exist (Windows) the folder is not locked and a warning says so.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import socket
import time
import weakref
from pathlib import Path

try:
    import fcntl
except ImportError:  # not a POSIX system
    fcntl = None

LOCK_FILE = ".run.lock"
_SELF = "; that is this process: an earlier run in it is still open (close it)"
logger = logging.getLogger(__name__)


class FolderLock:
    """The exclusive lock on one folder (``descriptor`` is ``None`` where locks are not available)."""

    def __init__(self, folder: Path, descriptor: int | None):
        self.folder = folder
        self._close = weakref.finalize(self, os.close, descriptor) if descriptor is not None else None

    @property
    def held(self) -> bool:
        return self._close is not None and self._close.alive

    def release(self) -> None:
        """Let another run write into the folder (closing the file drops the lock; so does garbage collection of
        this object). Safe to call twice."""
        if self._close is not None:
            self._close()

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


def _holder(path: Path) -> str:
    """The recorded holder of a lock file, in words."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        pid, host, since = int(record["pid"]), str(record["host"]), str(record["since"])
    except (OSError, ValueError, KeyError, TypeError):  # not written yet, or by something else
        return "its holder is not recorded"
    mine = pid == os.getpid() and host == socket.gethostname()
    return f"pid {pid} on host {host}, since {since}" + (_SELF if mine else "")


def _lock_or_collect(descriptor: int, path: Path) -> None:
    """``flock`` without waiting; when this very process is the holder, collect garbage and try once more: a lock
    whose owner is unreachable (e.g. kept by a reference cycle through an exception's traceback) is released by the
    owner's finalizer, while one still in use stays held."""
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        if not _holder(path).endswith(_SELF):
            raise
        gc.collect()
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)


def lock_folder(folder: str | os.PathLike, option: str = "output_dir") -> FolderLock:
    """Take the exclusive lock on ``folder`` (which must exist) without waiting.

    Raises ``ValueError`` naming ``option``, the folder and the other run's pid and host when another process holds
    it, or when the lock file cannot be opened or locked.
    """
    folder = Path(folder)
    if fcntl is None:
        logger.warning("%s %s is not locked against a second run: this system has no fcntl.flock", option, folder)
        return FolderLock(folder, None)
    path = folder / LOCK_FILE
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as error:
        raise ValueError(f"{option} {str(folder)!r}: cannot open the lock file {LOCK_FILE}: {error}") from error
    try:
        _lock_or_collect(descriptor, path)
    except BlockingIOError:
        os.close(descriptor)
        raise ValueError(
            f"{option} {str(folder)!r} is in use by another training run ({_holder(path)}); wait for it to end or "
            f"choose another {option}"
        ) from None
    except OSError as error:  # e.g. ENOLCK: a file system without locks
        os.close(descriptor)
        raise ValueError(f"{option} {str(folder)!r} cannot be locked against a second run: {error}") from error
    record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, json.dumps(record).encode(), 0)
    return FolderLock(folder, descriptor)


__all__ = ["LOCK_FILE", "FolderLock", "lock_folder"]
