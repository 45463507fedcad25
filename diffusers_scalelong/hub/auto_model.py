"""A saved model folder that diffusers' ``AutoModel`` loads with ``trust_remote_code=True``, on request only.

diffusers' ``AutoModel.from_pretrained(folder, trust_remote_code=True)`` reads ``config.json``'s
``auto_map = {"AutoModel": "<module file>.<Class>"}`` and imports ``<module file>.py`` from the folder (diffusers'
own ``register_for_auto_class`` writes the same key). :func:`write_auto_model_files` adds both to a folder written by
``save_pretrained``: the component shim file (it imports the installed package, or fails with the install line) and
``auto_map`` naming it. ``save_pretrained`` itself writes no code; the models drop ``auto_map`` when they load.
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

from ..atomic import atomic_write_text
from .shims import COMPONENT_SHIM, render_shim, shim_folder

AUTO_MAP_KEY = "auto_map"


def shim_class_names() -> tuple[str, ...]:
    """The classes the component shim file re-exports (its ``__all__``)."""
    tree = ast.parse((shim_folder() / f"{COMPONENT_SHIM}.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise ValueError(f"{COMPONENT_SHIM}.py has no __all__")


def write_auto_model_files(folder: str | os.PathLike) -> dict:
    """Add ``auto_map`` and the component shim file to a model folder written by ``save_pretrained``.

    Returns the new ``config.json`` content. Raises ``ValueError`` when ``folder`` holds no ``config.json`` of one of
    the package's model classes.
    """
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"folder {str(folder)!r} has no config.json: save the model with save_pretrained first")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    class_name = config.get("_class_name")
    if class_name not in shim_class_names():
        raise ValueError(
            f"folder {str(folder)!r} holds a {class_name}, not a model of diffusers_scalelong "
            f"({', '.join(shim_class_names())})"
        )
    config[AUTO_MAP_KEY] = {"AutoModel": f"{COMPONENT_SHIM}.{class_name}"}
    atomic_write_text(folder / f"{COMPONENT_SHIM}.py", render_shim(COMPONENT_SHIM))
    atomic_write_text(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return config
