"""Official raw post-hoc EMA snapshots of EDM2 -> this project's ``phema-*.safetensors`` snapshot files.

The official training runs (and NVIDIA's released ``raw-snapshots/edm2-*`` series) save, every few million images,
one network pickle per tracked EMA profile, named ``<prefix>-<kimg:07d>-<sigma_rel:.3f>.pkl``: the power-function
EMA of width ``sigma_rel`` at ``kimg`` thousand training images (exactly the multiple of 1024 that rounds down to
it). Each becomes one snapshot file of the UNet (``EDM2UNet2DModel``; the uncertainty head is not needed for
sampling) with ``time`` in images, ``time_unit="images"``, ``sigma_rel`` and its exponent ``gamma``, the averaged
tensors in float16 as in the official files, buffers as copied keys, and the model class and config. The folder
then works with ``scalelong-reconstruct-ema``, ``reconstruct_ema`` and, once pushed, ``reconstruct_from_hub``.
``edm2_snapshots.json`` beside them lists the source files, their SHA-256 and the license (CC BY-NC-SA 4.0).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..atomic import atomic_write_text
from ..ema import sigma_rel_to_gamma, snapshot_filename
from ..ema.snapshots import write_snapshot
from ..ema.tracker import model_class_and_config
from .edm2_official import (
    EDM2_LICENSE,
    EDM2_LICENSE_URL,
    kimg_to_images,
    networks_from_pickle,
    parse_official_name,
    read_edm2_pickle,
)

__all__ = ["SNAPSHOT_SOURCES", "convert_edm2_snapshots", "list_official_snapshots"]

SNAPSHOT_SOURCES = "edm2_snapshots.json"


def list_official_snapshots(
    folder: str | os.PathLike, prefix: str | None = None, sigma_rels: list[float] | None = None
) -> list[tuple[Path, str, int, float]]:
    """``(path, prefix, images, sigma_rel)`` of the official snapshot pickles in ``folder``, by time then width.

    Raises ValueError when the folder holds none, or several runs (prefixes) and ``prefix`` does not choose one.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"snapshot folder {folder} does not exist or is not a folder")
    found = []
    for path in sorted(folder.iterdir()):
        parsed = parse_official_name(path.name)
        if parsed is None or (prefix is not None and parsed[0] != prefix):
            continue
        if sigma_rels is not None and parsed[2] not in sigma_rels:
            continue
        found.append((path, parsed[0], kimg_to_images(parsed[1]), parsed[2]))
    prefixes = sorted({entry[1] for entry in found})
    if not found:
        raise ValueError(f"no official snapshot pickles (<prefix>-<kimg>-<sigma_rel>.pkl) in {folder}")
    if len(prefixes) > 1:
        raise ValueError(f"{folder} holds snapshots of several runs {prefixes}: choose one with prefix / --prefix")
    return sorted(found, key=lambda entry: (entry[2], entry[3]))


def convert_edm2_snapshots(
    input_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    prefix: str | None = None,
    sigma_rels: list[float] | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> list[Path]:
    """Convert every official snapshot pickle in ``input_dir`` into a snapshot file in ``output_dir``.

    Files already converted are kept (so an interrupted conversion resumes) unless ``overwrite``. One network is in
    memory at a time. Returns the snapshot paths, oldest first. Two source files that would write one snapshot
    file (``...-8-0.05.pkl`` beside ``...-0000008-0.050.pkl``) raise ValueError before anything is written.
    """
    entries = list_official_snapshots(input_dir, prefix, sigma_rels)
    sources_of: dict[str, Path] = {}
    for path, _, images, sigma_rel in entries:
        name = snapshot_filename(images, sigma_rel)
        if name in sources_of:
            raise ValueError(f"{sources_of[name].name} and {path.name} both convert to {name}: keep only one of them")
        sources_of[name] = path
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    written, sources = [], []
    for path, _, images, sigma_rel in tqdm(entries, desc="snapshots", disable=not progress):
        target = output_dir / snapshot_filename(images, sigma_rel)
        source = read_edm2_pickle(path) if overwrite or not target.exists() else None
        if source is not None:
            unet, _, _ = networks_from_pickle(source.network)
            averaged = {name for name, parameter in unet.named_parameters() if parameter.is_floating_point()}
            model_class, model_config = model_class_and_config(unet)
            write_snapshot(
                output_dir,
                unet.state_dict(),
                time=images,
                sigma_rel=sigma_rel,
                gamma=sigma_rel_to_gamma(sigma_rel),
                time_unit="images",
                copied_keys=[key for key in unet.state_dict() if key not in averaged],
                model_class=model_class,
                model_config=model_config,
                dtype="float16",
            )
        sources.append(_source_entry(path, target, source.sha256 if source is not None else None))
        written.append(target)
    _write_sources(output_dir, sources)
    return written


def _source_entry(path: Path, target: Path, sha256: str | None) -> dict[str, Any]:
    return {"source_file": path.name, "sha256": sha256, "snapshot": target.name}


def _write_sources(output_dir: Path, sources: list[dict[str, Any]]) -> None:
    """Merge this run's sources into ``edm2_snapshots.json`` (keeping the hashes recorded by earlier runs)."""
    path = output_dir / SNAPSHOT_SOURCES
    previous = json.loads(path.read_text(encoding="utf-8"))["snapshots"] if path.is_file() else []
    by_snapshot = {entry["snapshot"]: entry for entry in previous}
    for entry in sources:
        if entry["sha256"] is not None or entry["snapshot"] not in by_snapshot:
            by_snapshot[entry["snapshot"]] = entry
    record = {
        "license": EDM2_LICENSE,
        "license_url": EDM2_LICENSE_URL,
        "copyright": "NVIDIA CORPORATION & AFFILIATES (EDM2 models)",
        "time_unit": "images (official file names give kimg = images // 1000; images are multiples of 1024)",
        "snapshots": sorted(by_snapshot.values(), key=lambda entry: entry["snapshot"]),
    }
    atomic_write_text(path, json.dumps(record, indent=2) + "\n")
