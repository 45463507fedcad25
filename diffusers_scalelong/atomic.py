"""Atomic file writes: a reader sees the old file or the complete new one, never a half-written file."""

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _default_file_mode() -> int:
    """The mode ``open()`` gives a new file: 0o666 minus the process umask (``mkstemp`` itself uses 0o600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write to; then fsync it and ``os.replace`` it onto ``path``.

    On any error the temporary file is removed and ``path`` is left as it was. The parent folder is created.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
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
