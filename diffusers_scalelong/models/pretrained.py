"""Upgrade a pretrained UNet to ScaleLong: load it (local folder or Hub repo) with long-skip scaling added.

A vanilla diffusers ``UNet2DModel`` / ``UNet2DConditionModel`` is loaded into its ``ScaleLong*`` subclass, which
records ``lsc_method`` in its config, so the scaling survives ``save_pretrained``.
"""

import inspect
import json
import os
from pathlib import Path

import diffusers
from diffusers.models.modeling_utils import ModelMixin

from ..sources import fetch_file

# Loading a vanilla diffusers UNet for fine-tuning with ScaleLong swaps in the subclass that records the method.
SCALELONG_SUBCLASS = {
    "UNet2DModel": "ScaleLongUNet2DModel",
    "ScaleLongUNet2DModel": "ScaleLongUNet2DModel",
    "UNet2DConditionModel": "ScaleLongUNet2DConditionModel",
    "ScaleLongUNet2DConditionModel": "ScaleLongUNet2DConditionModel",
}


def load_model_config(
    path: str | os.PathLike, subfolder: str | None = None, revision: str | None = None
) -> tuple[dict, str | None]:
    """The ``config.json`` of a pretrained UNet in a local folder or Hub repo (at ``revision``), and the subfolder
    holding it.

    A pipeline folder (``model_index.json``) is searched for its ``unet`` component.
    """
    if subfolder is None and fetch_file(path, "model_index.json", revision) is not None:
        subfolder = "unet"
    config_name = "config.json" if subfolder is None else f"{subfolder}/config.json"
    config_path = fetch_file(path, config_name, revision)
    if config_path is None:
        raise ValueError(
            f"pretrained_model_name_or_path {str(path)!r} holds neither model_index.json nor a UNet config.json"
        )
    return json.loads(Path(config_path).read_text()), subfolder


def model_class_by_name(name: str) -> type[ModelMixin]:
    """A model class of this package or of diffusers, by its ``_class_name``."""
    from .. import models as plugin_models  # this package (imported on first use: it imports this module)

    cls = getattr(plugin_models, name, None) or getattr(diffusers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, ModelMixin)):
        raise ValueError(f"model class {name!r} is neither a diffusers model nor one of diffusers_scalelong.models")
    return cls


def load_pretrained_unet(
    path: str | os.PathLike,
    lsc_method: str,
    lsc_kappa: float,
    subfolder: str | None = None,
    revision: str | None = None,
    variant: str | None = None,
) -> ModelMixin:
    """Load a pretrained UNet for fine-tuning, with ScaleLong long-skip scaling ``lsc_method`` added.

    A diffusers ``UNet2DModel`` / ``UNet2DConditionModel`` is loaded into its ``ScaleLong*`` subclass, so the method is
    stored in the saved config; models that carry ``lsc_method`` in their own config (EDM2, U-ViT) get it replaced;
    any other model accepts only ``lsc_method="none"`` (a scaling it cannot record would be lost when saved). The
    options are checked by the model's own scaling module (:func:`~.coefficients.validate_lsc_options`).
    ``revision`` (Hub branch, tag or commit) and ``variant`` (e.g. ``fp16``) go to ``from_pretrained``.
    """
    config, subfolder = load_model_config(path, subfolder, revision)
    class_name = config.get("_class_name", "")
    kwargs = dict(revision=revision, variant=variant)
    if subfolder:
        kwargs["subfolder"] = subfolder
    if class_name in SCALELONG_SUBCLASS:
        cls = model_class_by_name(SCALELONG_SUBCLASS[class_name])
        return cls.from_pretrained(path, lsc_method=lsc_method, lsc_kappa=float(lsc_kappa), **kwargs)
    cls = model_class_by_name(class_name)
    if "lsc_method" in inspect.signature(cls.__init__).parameters:
        return cls.from_pretrained(
            path, lsc_method=lsc_method, lsc_kappa=float(lsc_kappa), low_cpu_mem_usage=False, **kwargs
        )
    if lsc_method != "none":
        raise ValueError(f"{class_name} has no lsc_method option; lsc {lsc_method} cannot be saved with it")
    return cls.from_pretrained(path, **kwargs)
