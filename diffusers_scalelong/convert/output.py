"""Converted folders are written whole: built in a hidden sibling folder, then swapped in for the target."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..atomic import ASIDE_SUFFIX, clean_stale_temporaries, replace_path, staging_folder

__all__ = ["replaced_folder"]


@contextmanager
def replaced_folder(output_dir: str | os.PathLike, overwrite: bool) -> Iterator[Path]:
    """Yield an empty folder beside ``output_dir`` to write into; when the block succeeds it replaces
    ``output_dir`` as a whole (nothing of an old folder is left), when it fails it is removed and ``output_dir``
    is untouched.

    Raises ValueError if ``output_dir`` exists, is not an empty folder and ``overwrite`` is false.
    """
    output_dir = Path(output_dir)
    if output_dir.exists() and not overwrite and (not output_dir.is_dir() or any(output_dir.iterdir())):
        raise ValueError(
            f"output_dir {output_dir} exists and is not empty: pass overwrite=True / --overwrite to replace it"
        )
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temporaries(output_dir.parent, [output_dir.name, output_dir.name + ASIDE_SUFFIX])
    staging = staging_folder(output_dir.parent, output_dir.name)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # the mode mkdir would give, not mkdtemp's 0o700
    try:
        yield staging
        replace_path(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
