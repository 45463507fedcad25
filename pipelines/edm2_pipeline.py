"""Custom-pipeline file for diffusers-scalelong's EDM2Pipeline.

diffusers loads this file for a Hub repo whose ``model_index.json`` names ``["edm2_pipeline", "EDM2Pipeline"]``
(``DiffusionPipeline.from_pretrained(repo_id, trust_remote_code=True)``), or when it is passed as
``custom_pipeline=``. The implementation lives in the installed ``diffusers_scalelong`` package; without it, the
import below fails with the install command (filled in when the file is written into a repo).
"""

import importlib

INSTALL_COMMAND = "(see the package's README)"

try:
    _package = importlib.import_module("diffusers_scalelong")
except ModuleNotFoundError as error:
    if error.name != "diffusers_scalelong":
        raise
    raise ImportError(
        f"This repository's pipeline is EDM2Pipeline of the diffusers-scalelong package, which is not installed. "
        f"Install it with: {INSTALL_COMMAND}"
    ) from error

EDM2Pipeline = _package.EDM2Pipeline

__all__ = ["EDM2Pipeline"]
