"""A Hugging Face Space folder that serves the post-hoc EMA explorer for a Hub repo of snapshots.

``write_space(folder, repo_id)`` writes ``app.py`` (builds the explorer with
:func:`diffusers_scalelong.ema.explorer.build_app`; snapshots are downloaded on first use, only those a target
needs), ``requirements.txt`` and ``README.md`` with the Space front matter (``sdk: gradio``). Push the folder as a
Space (``HfApi().upload_folder(repo_id=..., repo_type="space", folder_path=folder)``).
"""

from __future__ import annotations

import os
from pathlib import Path

from .._version import __version__
from ..atomic import replace_path, staging_folder
from .explorer.source import SnapshotSource
from .hub_transfer import DEFAULT_PATH_IN_REPO

# The Gradio release the Space runs when no Gradio is installed here to name its own version.
FALLBACK_GRADIO_VERSION = "5.49.1"

APP_TEMPLATE = '''"""Post-hoc EMA explorer for the snapshots in {repo_id} (written by scalelong-ema-explorer --write_space)."""

from diffusers_scalelong.ema.explorer import build_app

demo = build_app({repo_id!r}, path_in_repo={path_in_repo!r}, revision={revision!r})

if __name__ == "__main__":
    demo.queue(default_concurrency_limit=1).launch()
'''

README_TEMPLATE = """---
title: {title}
emoji: 🎚️
colorFrom: indigo
colorTo: gray
sdk: gradio
sdk_version: {gradio_version}
app_file: app.py
pinned: false
models:
- {repo_id}
tags:
- post-hoc-ema
- edm2
- diffusers-scalelong
short_description: Choose the EMA length of {short_name} by looking
---

# Post-hoc EMA explorer: {repo_id}

Move the `sigma_rel` slider to reconstruct any EMA length from the power-function EMA snapshots in
[{repo_id}](https://huggingface.co/{repo_id}) (EDM2, arXiv 2312.02696, section 3) and look at a fixed-seed sample
grid of it. The page also shows the target's averaging profile and its least-squares fit from the stored profiles,
and "save this EMA" writes the chosen network as a pipeline folder.

Run it locally with `pip install "diffusers-scalelong[explorer]"` and
`scalelong-ema-explorer {repo_id} --path_in_repo {path_in_repo}`.
"""


def _gradio_version() -> str:
    try:
        import gradio

        return gradio.__version__
    except ImportError:
        return FALLBACK_GRADIO_VERSION


def write_space(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    path_in_repo: str = DEFAULT_PATH_IN_REPO,
    revision: str | None = None,
    title: str | None = None,
    endpoint: str | None = None,
    token: str | bool | None = None,
) -> Path:
    """Write the Space files into ``folder`` (new or empty) for the snapshots in ``repo_id``; returns the folder.

    The repo is read first (its snapshot index, through ``endpoint``): a repo without snapshots, or of two runs,
    or an unreachable Hub raises and writes nothing. The folder appears complete (renamed from a temporary one).
    """
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"write_space folder {folder} exists and is not an empty folder")
    SnapshotSource(repo_id, path_in_repo=path_in_repo, revision=revision, endpoint=endpoint, token=token)
    files = {
        "app.py": APP_TEMPLATE.format(repo_id=repo_id, path_in_repo=path_in_repo, revision=revision),
        "requirements.txt": f"diffusers-scalelong[explorer]=={__version__}\n",
        "README.md": README_TEMPLATE.format(
            title=title or f"EMA explorer {repo_id.split('/')[-1]}"[:60],
            gradio_version=_gradio_version(),
            repo_id=repo_id,
            short_name=repo_id.split("/")[-1][:30],
            path_in_repo=path_in_repo,
        ),
    }
    folder.parent.mkdir(parents=True, exist_ok=True)
    stage = staging_folder(folder.parent, folder.name)
    for name, text in files.items():
        (stage / name).write_text(text, encoding="utf-8")
    if folder.exists():
        folder.rmdir()
    replace_path(stage, folder)
    return folder
