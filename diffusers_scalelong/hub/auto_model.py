"""Saved model folders that diffusers' ``AutoModel`` loads without this package imported.

diffusers' ``AutoModel.from_pretrained(folder, trust_remote_code=True)`` reads ``config.json``'s
``auto_map = {"AutoModel": "<module file>.<Class>"}`` and imports ``<module file>.py`` from the folder (diffusers'
own ``register_for_auto_class`` writes the same key, naming the class's module). ``save_pretrained`` of this
package's models therefore writes the component shim file (it imports the installed package, or fails with the
install line) beside the weights and points ``auto_map`` at it.
"""

import json
import os
from pathlib import Path

from ..atomic import atomic_write_text
from .layout import COMPONENT_SHIM, render_shim

AUTO_MAP_KEY = "auto_map"


class AutoModelFilesMixin:
    """``save_pretrained`` that adds ``auto_map`` and the component shim file; loading ignores ``auto_map``.

    Put this mixin before ``ModelMixin`` in the bases.
    """

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs) -> None:
        super().save_pretrained(save_directory, *args, **kwargs)
        if not kwargs.get("is_main_process", True):
            return
        folder = Path(save_directory)
        config_path = folder / "config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config[AUTO_MAP_KEY] = {"AutoModel": f"{COMPONENT_SHIM}.{type(self).__name__}"}
        atomic_write_text(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")
        atomic_write_text(folder / f"{COMPONENT_SHIM}.py", render_shim(COMPONENT_SHIM))

    @classmethod
    def extract_init_dict(cls, config_dict: dict, **kwargs):
        """diffusers' ``extract_init_dict`` without ``auto_map`` (a loading hint, not a constructor argument)."""
        return super().extract_init_dict({k: v for k, v in config_dict.items() if k != AUTO_MAP_KEY}, **kwargs)
