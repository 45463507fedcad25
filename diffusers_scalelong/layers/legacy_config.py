"""Saved configs of older versions: ``auto_map`` in ``config.json`` is dropped when a model is loaded.

Earlier versions of this package wrote ``auto_map = {"AutoModel": "diffusers_scalelong_components.<Class>"}`` (a hint for diffusers'
``AutoModel`` with ``trust_remote_code=True``) into every saved model's ``config.json``. It is no constructor
argument: kept, diffusers would warn about it and copy it into the loaded model's config, and every later save would
carry a pointer to a code file it does not write.
"""

AUTO_MAP_KEY = "auto_map"


class LegacyAutoMapMixin:
    """Loading drops ``auto_map`` from the config; saving is diffusers' own. Put it before ``ConfigMixin`` in the bases."""

    @classmethod
    def extract_init_dict(cls, config_dict: dict, **kwargs):
        """diffusers' ``extract_init_dict`` on the config without ``auto_map``."""
        return super().extract_init_dict({k: v for k, v in config_dict.items() if k != AUTO_MAP_KEY}, **kwargs)
