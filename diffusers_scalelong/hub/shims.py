"""The Hub shim files: small code files a Hub repo carries so that diffusers can load it with
``trust_remote_code=True``.

They live in the project's top-level ``pipelines/`` folder (inside the package: ``diffusers_scalelong/hub_shims``, a
link to it in the source tree and a copy in a wheel). Each only re-exports classes of the installed package; without
the package its import fails with :data:`~diffusers_scalelong.hub.cards.INSTALL`, filled in by :func:`render_shim`.
"""

import re
from pathlib import Path

from .cards import INSTALL

PACKAGE = "diffusers_scalelong"
COMPONENT_SHIM = "diffusers_scalelong_components"
PIPELINE_SHIMS = {"EDM2Pipeline": "edm2_pipeline"}
SHIM_FOLDER = Path(__file__).resolve().parents[1] / "hub_shims"


def shim_folder() -> Path:
    """The folder holding the shim files: ``diffusers_scalelong/hub_shims`` (the top-level ``pipelines/`` folder)."""
    if not (SHIM_FOLDER / f"{COMPONENT_SHIM}.py").is_file():
        raise FileNotFoundError(
            f"the Hub shim files ({COMPONENT_SHIM}.py, ...) are missing from {SHIM_FOLDER}; they ship in the "
            "project's top-level pipelines/ folder, which the package includes as diffusers_scalelong/hub_shims"
        )
    return SHIM_FOLDER


def render_shim(name: str) -> str:
    """The text of shim file ``name`` (e.g. ``"edm2_pipeline"``) for a repo: its ``INSTALL_COMMAND`` line set to
    :data:`~diffusers_scalelong.hub.cards.INSTALL`, the line its import error gives when the package is missing."""
    text = (shim_folder() / f"{name}.py").read_text(encoding="utf-8")
    rendered, count = re.subn(r"^INSTALL_COMMAND = .*$", f"INSTALL_COMMAND = {INSTALL!r}", text, flags=re.MULTILINE)
    if count != 1:
        raise ValueError(f"shim file {name}.py must hold one INSTALL_COMMAND line, found {count}")
    return rendered
