"""Atomic file writes and output-folder checks used by the training scripts."""

import os
import shutil
import tempfile
from pathlib import Path

from PIL import Image

from ..atomic import atomic_path


def ensure_writable_dir(path: str | os.PathLike, option: str = "--output_dir") -> Path:
    """Create ``path`` if needed and prove it is writable by writing and removing a temporary file.

    Raises ``ValueError`` naming ``option`` when the folder cannot be created or written.
    """
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
    except OSError as error:
        raise ValueError(f"{option} {str(folder)!r} is not a writable folder: {error.strerror or error}") from error
    return folder


def save_image_atomic(image: Image.Image, path: str | os.PathLike) -> None:
    """Write a PNG through a temporary file in the same folder, then ``os.replace`` it into place."""
    with atomic_path(path) as temporary:
        image.save(temporary, format="PNG")


def replace_folder_contents(source: str | os.PathLike, target: str | os.PathLike, last: tuple[str, ...] = ()) -> None:
    """Move every entry of ``source`` into ``target``, replacing entries of the same name.

    Each entry is swapped in with ``os.replace``; names in ``last`` (e.g. ``model_index.json``) are moved after all
    others so that a reader never sees an index that points at half-written components.
    """
    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    names = sorted(os.listdir(source), key=lambda name: (name in last, name))
    for name in names:
        destination = target / name
        old = None
        if destination.is_dir() and not destination.is_symlink():
            old = target / f".{name}.old-{os.getpid()}"
            os.replace(destination, old)
        os.replace(source / name, destination)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
