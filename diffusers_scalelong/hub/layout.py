"""Hub-native layout for a saved pipeline folder, its model card, and the package's push to the Hub.

``save_pretrained`` writes what diffusers writes: ``model_index.json`` names this package's components by module path
(e.g. ``["diffusers_scalelong.models.edm2_unet", "EDM2UNet2DModel"]``), which loads locally and by repo id once
``diffusers_scalelong`` is imported (see :mod:`.registration`). :func:`write_hub_layout` turns such a folder into one
that also loads **without** the import, with ``trust_remote_code=True``, adding the shim files (:mod:`.shims`)
beside ``model_index.json`` and pointing the entries at them:

- ``<component>/diffusers_scalelong_components.py`` and ``"<component>": ["diffusers_scalelong_components", Class]``
  for each component class from this package; a model component's ``config.json`` gains ``auto_map``
  (see :mod:`.auto_model`);
- ``<pipeline shim>.py`` at the root and ``"_class_name": ["<pipeline shim>", Class]`` for this package's pipelines.

Without the package installed, loading such a repo fails with the install command. diffusers runs a code file of the
repo only with ``trust_remote_code=True``, so a Hub-layout repo needs the flag even where the package is imported.
:func:`push_pipeline_to_hub` writes this layout and a model card; diffusers' own ``push_to_hub`` writes the plain one.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from diffusers import DiffusionPipeline
from huggingface_hub import HfApi, ModelCard

from ..atomic import atomic_write_text
from .access import reports_unreachable_hub
from .auto_model import write_auto_model_files
from .cards import build_card, card_data, markdown_table, weights_text
from .shims import COMPONENT_SHIM, PACKAGE, PIPELINE_SHIMS, render_shim, shim_folder

__all__ = ["model_card", "push_pipeline_to_hub", "render_shim", "shim_folder", "write_hub_layout"]


def write_hub_layout(folder: str | os.PathLike) -> dict[str, Any]:
    """Add the shim files to a ``save_pretrained`` folder of a pipeline and point ``model_index.json`` at them.

    Returns the new ``model_index.json`` content. Entries of diffusers' own classes are left unchanged, so a diffusers
    pipeline (e.g. ``DDPMPipeline``) with a ScaleLong UNet keeps its pipeline class and only the UNet gets a shim. A
    model folder (``config.json``, no ``model_index.json``) gets ``auto_map`` and the shim (``write_auto_model_files``).
    """
    folder = Path(folder)
    index_path = folder / "model_index.json"
    if not index_path.is_file():
        if (folder / "config.json").is_file():
            return write_auto_model_files(folder)
        raise ValueError(f"{folder} has no model_index.json: save the pipeline with save_pretrained first")
    index = json.loads(index_path.read_text(encoding="utf-8"))

    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2 or entry[0] is None:
            continue
        library, class_name = entry
        if library == PACKAGE or library.startswith(f"{PACKAGE}.") or library == COMPONENT_SHIM:
            atomic_write_text(folder / name / f"{COMPONENT_SHIM}.py", render_shim(COMPONENT_SHIM))
            if (folder / name / "config.json").is_file():
                write_auto_model_files(folder / name)
            index[name] = [COMPONENT_SHIM, class_name]

    pipeline_class = index.get("_class_name")
    if isinstance(pipeline_class, list):
        pipeline_class = pipeline_class[1]
    if pipeline_class in PIPELINE_SHIMS:
        shim = PIPELINE_SHIMS[pipeline_class]
        atomic_write_text(folder / f"{shim}.py", render_shim(shim))
        index["_class_name"] = [shim, pipeline_class]

    atomic_write_text(index_path, json.dumps(index, indent=2, sort_keys=True) + "\n")
    return index


def model_card(
    pipeline: DiffusionPipeline,
    repo_id: str,
    ema_sigma_rel: float | None = None,
    sampler_settings: dict[str, Any] | None = None,
    dataset: str | None = None,
    extra_text: str = "",
    license: str | None = None,
    *,
    ema: bool | None = None,
    base_model: str | None = None,
    datasets: Sequence[str] = (),
    hub_layout: bool = True,
) -> ModelCard:
    """A pipeline's model card: front matter (license, default the package's; ``dataset``/``datasets`` and
    ``base_model`` as Hub repo ids; tags), how to load, what the weights are (a power-function EMA of length
    ``ema_sigma_rel``, another EMA with ``ema=True``, raw with ``ema=False``), sampler settings and ``extra_text``
    (e.g. where converted weights come from). ``hub_layout``: the load code of a :func:`write_hub_layout` repo
    (``trust_remote_code=True``) or of a plain ``save_pretrained`` one (``import diffusers_scalelong``)."""
    unet = pipeline.unet
    conditional = getattr(unet.config, "num_class_embeds", None) is not None
    tags = ["diffusers", type(pipeline).__name__, type(unet).__name__]
    if "EDM2" in type(unet).__name__ or type(pipeline).__name__ == "EDM2Pipeline":
        tags.append("edm2")
    if getattr(unet.config, "lsc_method", "none") != "none":
        tags.append("scalelong")
    if ema_sigma_rel is not None or ema:
        tags.append("ema")
    tags.append("class-conditional-image-generation" if conditional else "unconditional-image-generation")
    data = card_data(
        tags,
        license=license,
        datasets=[*([dataset] if dataset else []), *datasets],
        base_model=base_model,
        library_name="diffusers",
        pipeline_tag="unconditional-image-generation",
    )
    scheduler = pipeline.scheduler
    settings = {"scheduler": type(scheduler).__name__, **(sampler_settings or {})}
    for key in ("sigma_min", "sigma_max", "sigma_data", "rho", "S_churn", "S_min", "S_max", "S_noise"):
        if key in scheduler.config and key not in settings:
            settings[key] = scheduler.config[key]
    call = "pipe(class_labels=[0, 1, 2, 3])" if conditional else "pipe(batch_size=4)"
    scaled = f" (long skips scaled with `{unet.config.lsc_method}`)" if "scalelong" in tags else ""
    if hub_layout:
        load_code = (
            "from diffusers import DiffusionPipeline\n\n"
            f'pipe = DiffusionPipeline.from_pretrained("{repo_id}", trust_remote_code=True)\n'
        )
        how = (
            "`trust_remote_code=True` lets diffusers import the small code files in this repo; they only re-export "
            "classes of the installed `diffusers_scalelong` package (read them before trusting them)."
        )
    else:
        load_code = (
            "import diffusers_scalelong  # lets diffusers find the package's classes\n"
            "from diffusers import DiffusionPipeline\n\n"
            f'pipe = DiffusionPipeline.from_pretrained("{repo_id}")\n'
        )
        how = ""
    sections: list[tuple[str | None, str]] = [
        (None, how),
        ("Weights", weights_text(ema_sigma_rel, ema)),
        ("Sampler settings", markdown_table(("setting", "value"), settings.items())),
    ]
    if extra_text:
        sections.append((None, extra_text))
    return build_card(
        data,
        title=repo_id,
        summary=f"A `{type(pipeline).__name__}` with a `{type(unet).__name__}`{scaled}, built with diffusers-scalelong.",
        load_code=load_code + f"images = {call}.images",
        sections=sections,
    )


@reports_unreachable_hub
def push_pipeline_to_hub(
    pipeline: DiffusionPipeline,
    repo_id: str,
    commit_message: str = "Upload pipeline",
    private: bool | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    ema_sigma_rel: float | None = None,
    sampler_settings: dict[str, Any] | None = None,
    dataset: str | None = None,
    safe_serialization: bool = True,
    variant: str | None = None,
    extra_text: str = "",
    license: str | None = None,
    *,
    ema: bool | None = None,
    base_model: str | None = None,
    datasets: Sequence[str] = (),
    max_shard_size: int | str | None = None,
    create_pr: bool = False,
) -> str:
    """``save_pretrained`` (with ``variant``, ``max_shard_size``) -> `write_hub_layout` -> model card ->
    ``upload_folder`` (a pull request with ``create_pr``); returns the commit URL.

    The card arguments (``ema_sigma_rel``, ``ema``, ``dataset``, ``datasets``, ``base_model``, ``license``,
    ``sampler_settings``, ``extra_text``) are those of `model_card`.
    """
    if not safe_serialization:
        raise ValueError("safe_serialization must be True: push_pipeline_to_hub writes safetensors weights only")
    card = model_card(
        pipeline, repo_id, ema_sigma_rel, sampler_settings, dataset, extra_text, license,
        ema=ema, base_model=base_model, datasets=datasets,
    )  # fmt: skip
    api = HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        pipeline.save_pretrained(tmp, safe_serialization=True, variant=variant, max_shard_size=max_shard_size)
        write_hub_layout(tmp)
        atomic_write_text(Path(tmp) / "README.md", str(card))
        commit = api.upload_folder(repo_id=repo_id, folder_path=tmp, commit_message=commit_message, create_pr=create_pr)
    return str(commit)
