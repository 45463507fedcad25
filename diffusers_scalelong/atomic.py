"""Atomic writes and the temporaries they leave when a process is killed.

A reader sees the old file (or folder) or the complete new one, never a half-written one. Every temporary is a
hidden entry beside its target named ``.<label>.<pid>-<random>.tmp`` (``label``: the target's name, ``<name>.old``
for a folder moved aside while it is replaced). The process id lets a later run tell a leftover of a killed
process from the temporary of a write still in progress: :func:`clean_stale_temporaries` removes only entries whose
process is gone, and puts back a folder that was moved aside when the kill came before its replacement arrived.
"""

import fnmatch
import logging
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

TEMPORARY_SUFFIX = ".tmp"
ASIDE_SUFFIX = ".old"
_TEMPORARY = re.compile(r"^\.(?P<label>.+)\.(?P<pid>\d+)-[A-Za-z0-9_]+\.tmp$")
logger = logging.getLogger(__name__)


def _default_file_mode() -> int:
    """The mode ``open()`` gives a new file: 0o666 minus the process umask (``mkstemp`` itself uses 0o600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _prefix(label: str) -> str:
    return f".{label}.{os.getpid()}-"


def staging_folder(parent: str | os.PathLike, label: str) -> Path:
    """Create and return a new empty hidden folder in ``parent`` for building ``label`` before it is renamed."""
    return Path(tempfile.mkdtemp(dir=parent, prefix=_prefix(label), suffix=TEMPORARY_SUFFIX))


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write to; then fsync it and ``os.replace`` it onto ``path``.

    On any error the temporary file is removed and ``path`` is left as it was. The parent folder is created.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=_prefix(path.name), suffix=TEMPORARY_SUFFIX)
    os.close(handle)
    temporary = Path(name)
    try:
        yield temporary
        os.chmod(temporary, _default_file_mode())
        with open(temporary, "rb") as stream:
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_path(path) as temporary:
        temporary.write_text(text, encoding="utf-8")


def replace_path(source: str | os.PathLike, destination: str | os.PathLike) -> None:
    """Move ``source`` onto ``destination`` so that a kill at any moment leaves the complete old or the complete new.

    A file is replaced with one ``os.replace``. A folder cannot be, so the old folder is first renamed aside
    (``.<name>.old.<pid>-<random>.tmp``), the new one renamed into place, and only then the old one deleted; a kill
    between the two renames leaves the old folder aside, which :func:`clean_stale_temporaries` puts back.
    """
    source, destination = Path(source), Path(destination)
    if not destination.is_dir() or destination.is_symlink():
        os.replace(source, destination)
        return
    aside = destination.parent / f"{_prefix(destination.name + ASIDE_SUFFIX)}{uuid.uuid4().hex[:8]}{TEMPORARY_SUFFIX}"
    os.replace(destination, aside)
    try:
        os.replace(source, destination)
    except BaseException:
        os.replace(aside, destination)
        raise
    shutil.rmtree(aside)


def _process_gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie, killed but not yet reaped, counts as ended)."""
    if pid == os.getpid() or os.name != "posix":  # no cheap, safe liveness test elsewhere: keep everything
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("Z", "X")


def clean_stale_temporaries(folder: str | os.PathLike, labels: Iterable[str]) -> list[Path]:
    """Tidy the temporaries that killed processes left in ``folder``; returns the entries handled.

    Only temporaries whose label matches one of the ``fnmatch`` patterns in ``labels`` (the kinds the caller writes)
    and whose process is gone are touched. A folder moved aside by :func:`replace_path` is put back when its
    original name is free (the kill came before the new folder arrived) and deleted otherwise; every other stale
    temporary is deleted. Each action is logged as a warning naming the entry.
    """
    folder, patterns = Path(folder), tuple(labels)
    if not folder.is_dir():
        return []
    handled = []
    for entry in sorted(folder.iterdir()):
        match = _TEMPORARY.match(entry.name)
        if match is None or not any(fnmatch.fnmatchcase(match["label"], p) for p in patterns):
            continue
        if not _process_gone(int(match["pid"])):
            continue
        original = folder / match["label"].removesuffix(ASIDE_SUFFIX)
        if match["label"].endswith(ASIDE_SUFFIX) and entry.is_dir() and not original.exists():
            os.replace(entry, original)
            logger.warning("restored %s from %s, left by an interrupted replacement", original, entry.name)
        else:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            logger.warning("removed %s, left by an interrupted write", entry)
        handled.append(entry)
    return handled
