"""Files of "a local folder or a Hub repo", the one way every loader of this package reads them.

A source is a local folder when one exists at that path; otherwise a string ``namespace/name`` is a Hub repo, whose
files are downloaded into the Hub cache (``huggingface_hub`` honours ``HF_ENDPOINT``, ``HF_HUB_OFFLINE`` and the
cache settings).
"""

from __future__ import annotations

import os
from pathlib import Path


def is_hub_repo(source: str | os.PathLike) -> bool:
    """Whether ``source`` names a Hub repo (``namespace/name``) rather than something on this machine."""
    return not Path(source).exists() and str(source).count("/") == 1


def fetch_file(source: str | os.PathLike, name: str, revision: str | None = None) -> Path | None:
    """The file ``name`` (a path inside the folder or repo) of ``source`` at ``revision``; None where there is none.

    A revision the repo lacks raises ``ValueError`` naming it.
    """
    local = Path(source)
    if local.is_dir():
        return local / name if (local / name).is_file() else None
    if not is_hub_repo(source):
        return None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return Path(hf_hub_download(str(source), name, revision=revision))
    except RevisionNotFoundError:
        raise ValueError(f"{source!s}: revision {revision} not found") from None
    except (EntryNotFoundError, RepositoryNotFoundError):
        return None


def fetch_folder(source: str | os.PathLike, patterns: list[str], revision: str | None = None) -> Path:
    """A local folder as it is, or the files of Hub repo ``source`` (at ``revision``) that match ``patterns``,
    downloaded into the Hub cache; the folder holding them."""
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(source), allow_patterns=patterns, revision=revision))
