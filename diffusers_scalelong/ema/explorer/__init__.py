"""Choose the EMA length by looking: an interactive post-hoc EMA explorer (``scalelong-ema-explorer``).

``source`` (where snapshots come from, which targets they reach), ``session`` (snapshots in memory, the cached
weighted sum per target, the fixed-seed grid, saving), ``app`` (the Gradio page: :func:`build_app`, :func:`launch`;
needs the ``explorer`` extra) and ``cli``. The Gradio parts are imported on first use.
"""

from __future__ import annotations

from typing import Any

from .session import Explorer, Grid
from .source import SnapshotSource

__all__ = ["Explorer", "Grid", "SnapshotSource", "build_app", "launch"]


def __getattr__(name: str) -> Any:
    if name in ("build_app", "launch"):
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
