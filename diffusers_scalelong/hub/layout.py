"""Hub-native layout for a saved pipeline folder, its model card, and push to the Hub.

``save_pretrained`` names this package's classes in ``model_index.json`` by module path (e.g.
``["diffusers_scalelong.models.edm2_unet", "EDM2UNet2DModel"]``). That loads locally once ``diffusers_scalelong``
is imported, but loading **by repo id** needs files in the repo that diffusers can import. `write_hub_layout` adds
the shim files of the project's top-level ``pipelines/`` folder (inside the package: ``diffusers_scalelong/hub_shims``,
a link to it in the source tree and a copy in a wheel) beside ``model_index.json`` and points the entries at them:

- ``<component>/diffusers_scalelong_components.py`` and ``"<component>": ["diffusers_scalelong_components", Class]``
  for each component class from this package;
- ``<pipeline shim>.py`` at the root and ``"_class_name": ["<pipeline shim>", Class]`` for this package's pipelines.

The result loads with ``DiffusionPipeline.from_pretrained(repo_id, trust_remote_code=True)``.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from diffusers import DiffusionPipeline
from huggingface_hub import HfApi, ModelCard, ModelCardData

from ..atomic import atomic_write_text
from .access import reports_unreachable_hub
from .cards import INSTALL, build_card, markdown_table

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


def write_hub_layout(folder: str | os.PathLike) -> dict[str, Any]:
    """Add the shim files to a ``save_pretrained`` folder and point ``model_index.json`` at them.

    Returns the new ``model_index.json`` content. Entries of diffusers' own classes are left unchanged, so a diffusers
    pipeline (e.g. ``DDPMPipeline``) with a ScaleLong UNet keeps its pipeline class and only the UNet gets a shim.
    """
    folder = Path(folder)
    index_path = folder / "model_index.json"
    if not index_path.is_file():
        raise ValueError(f"{folder} has no model_index.json: save the pipeline with save_pretrained first")
    index = json.loads(index_path.read_text(encoding="utf-8"))

    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2 or entry[0] is None:
            continue
        library, class_name = entry
        if library == PACKAGE or library.startswith(f"{PACKAGE}."):
            atomic_write_text(folder / name / f"{COMPONENT_SHIM}.py", render_shim(COMPONENT_SHIM))
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
) -> ModelCard:
    """A model card: tags, how to load, sampler settings, when given the EMA length ``sigma_rel``, extra text (e.g.
    where converted weights come from) and the weights' license identifier (e.g. ``cc-by-nc-sa-4.0``)."""
    unet = pipeline.unet
    conditional = getattr(unet.config, "num_class_embeds", None) is not None
    tags = ["diffusers", "diffusers-scalelong", type(pipeline).__name__, type(unet).__name__]
    if "EDM2" in type(unet).__name__ or type(pipeline).__name__ == "EDM2Pipeline":
        tags.append("edm2")
    if getattr(unet.config, "lsc_method", "none") != "none":
        tags.append("scalelong")
    tags.append("class-conditional-image-generation" if conditional else "unconditional-image-generation")
    data = ModelCardData(
        library_name="diffusers",
        pipeline_tag="unconditional-image-generation",
        tags=tags,
        datasets=[dataset] if dataset else None,
        license=license,
    )
    scheduler = pipeline.scheduler
    settings = {"scheduler": type(scheduler).__name__, **(sampler_settings or {})}
    for key in ("sigma_min", "sigma_max", "sigma_data", "rho", "S_churn", "S_min", "S_max", "S_noise"):
        if key in scheduler.config and key not in settings:
            settings[key] = scheduler.config[key]
    call = "pipe(class_labels=[0, 1, 2, 3])" if conditional else "pipe(batch_size=4)"
    scaled = f" (long skips scaled with `{unet.config.lsc_method}`)" if "scalelong" in tags else ""
    sections: list[tuple[str | None, str]] = [
        (
            None,
            "`trust_remote_code=True` lets diffusers import the small code files in this repo; they only re-export "
            "classes of the installed `diffusers_scalelong` package (read them before trusting them).",
        ),
        ("Sampler settings", markdown_table(("setting", "value"), settings.items())),
    ]
    if ema_sigma_rel is not None:
        sections.append(("EMA", f"Weights are a power-function EMA with relative length sigma_rel = {ema_sigma_rel}."))
    if extra_text:
        sections.append((None, extra_text))
    return build_card(
        data,
        title=repo_id,
        summary=f"A `{type(pipeline).__name__}` with a `{type(unet).__name__}`{scaled}, built with diffusers-scalelong.",
        load_code=(
            "from diffusers import DiffusionPipeline\n\n"
            f'pipe = DiffusionPipeline.from_pretrained("{repo_id}", trust_remote_code=True)\n'
            f"images = {call}.images"
        ),
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
) -> str:
    """``save_pretrained`` -> `write_hub_layout` -> model card -> ``upload_folder``; returns the commit URL.

    ``extra_text`` and ``license`` go to the model card (see `model_card`).
    """
    if not safe_serialization:
        raise ValueError("push_pipeline_to_hub writes safetensors weights only (safe_serialization=True)")
    api = HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        pipeline.save_pretrained(tmp, safe_serialization=True, variant=variant)
        write_hub_layout(tmp)
        card = model_card(pipeline, repo_id, ema_sigma_rel, sampler_settings, dataset, extra_text, license)
        atomic_write_text(Path(tmp) / "README.md", str(card))
        commit = api.upload_folder(repo_id=repo_id, folder_path=tmp, commit_message=commit_message)
    return str(commit)
