"""Snapshot files of power-function EMA profiles: atomic writing, metadata-only listing.

One file per profile and time stamp, named ``phema-<time:010d>-<sigma_rel>.safetensors`` (e.g.
``phema-0000001000-0.050.safetensors``; sigma_rel with 3 decimals, or 6 when 3 would round it), so that a
lexical sort orders by time. The file is a plain safetensors file holding the model's ``state_dict`` (averaged
parameters plus copied buffers) and, in the header metadata under the key ``"phema"``, a JSON object:

    format          "diffusers_scalelong.phema-snapshot"
    format_version  1
    time            exact integer time stamp (training steps or images) of the average
    time_unit       "steps" or "images"
    sigma_rel       float, relative width of the profile
    gamma           float, exponent of the profile
    dtype           storage dtype of the averaged tensors ("float32", "float16" or "bfloat16")
    copied_keys     state-dict keys that are copied from the live model, not averaged (buffers)
    model_class     "module.ClassName" of a diffusers ConfigMixin model, or null
    model_config    its JSON config (``to_json_string``), or null
    library_version diffusers_scalelong.__version__ of the writer
    run_id          the training run that wrote it (a hex string), or null; absent in files written before it existed

The JSON object also holds ``content_sha256``, the checksum of the tensor data (``diffusers_scalelong.integrity``);
it is verified whenever the tensors are read for a reconstruction. The tensors
are checked finite before a snapshot is written.

Files are written to a temporary name in the target folder and renamed into place, so a reader never sees a
half-written snapshot. ``list_snapshots`` reads only the safetensors headers, and checks that each file's name
agrees with the time and sigma_rel in its header.

For tools that move snapshots (e.g. to and from a Hub repository): the file name alone gives the time and the
(rounded) sigma_rel (``parse_snapshot_filename``), so a reconstruction at time ``T`` needs exactly the files with
time ``<= T``; the reconstruction functions accept a folder or any list of ``SnapshotInfo``; a reconstructed model
folder carries ``phema.json`` (sigma_rel, gamma, time, time_unit, dtype, relative_profile_error, the snapshots and
their coefficients, library_version) for model cards. The names and the metadata keys above are stable.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .._version import __version__
from ..integrity import DIGEST_KEY, check_finite, save_safetensors

SNAPSHOT_FORMAT = "diffusers_scalelong.phema-snapshot"
SNAPSHOT_FORMAT_VERSION = 1
METADATA_KEY = "phema"
FILENAME_PATTERN = re.compile(r"^phema-(\d{10})-(\d+\.\d+)\.safetensors$")
STORAGE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class SnapshotInfo:
    """Metadata of one snapshot file, read from its header only."""

    path: Path
    time: int
    time_unit: str
    sigma_rel: float
    gamma: float
    dtype: str
    copied_keys: tuple[str, ...]
    model_class: str | None
    model_config: dict[str, Any] | None
    library_version: str
    shapes: dict[str, tuple[int, ...]] = field(repr=False)
    run_id: str | None = None
    content_sha256: str | None = None


def snapshot_filename(time: int, sigma_rel: float) -> str:
    """``phema-<time:010d>-<sigma_rel>.safetensors``."""
    label = f"{sigma_rel:.3f}"
    if float(label) != sigma_rel:
        label = f"{sigma_rel:.6f}"
    return f"phema-{int(time):010d}-{label}.safetensors"


def parse_snapshot_filename(name: str) -> tuple[int, float] | None:
    """``(time, sigma_rel)`` encoded in a snapshot file name (sigma_rel rounded as in the name), else ``None``.

    Lets a caller choose which files to fetch (e.g. those with ``time <= target``) before reading any of them.
    """
    match = FILENAME_PATTERN.match(Path(name).name)
    return None if match is None else (int(match.group(1)), float(match.group(2)))


def storage_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """Resolve a storage dtype given as a torch dtype or a name (``fp16``/``float16``/``bf16``/...)."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype) and dtype in STORAGE_DTYPES.values():
        return dtype
    aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
    name = aliases.get(str(dtype), str(dtype).removeprefix("torch."))
    if name not in STORAGE_DTYPES:
        raise ValueError(f"dtype must be one of float32, float16, bfloat16 (or fp32/fp16/bf16), got {dtype!r}")
    return STORAGE_DTYPES[name]


def write_snapshot(
    folder: str | os.PathLike,
    state_dict: dict[str, torch.Tensor],
    *,
    time: int,
    sigma_rel: float,
    gamma: float,
    time_unit: str,
    copied_keys: list[str],
    model_class: str | None,
    model_config: dict[str, Any] | None,
    dtype: torch.dtype | str | None = None,
    run_id: str | None = None,
) -> str:
    """Atomically write one snapshot; averaged float tensors are stored in ``dtype``, copied ones unchanged.

    Raises ``ValueError`` (and writes nothing) when a tensor holds NaN or Inf.
    """
    dtype = storage_dtype(dtype)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    copied = set(copied_keys)
    tensors: dict[str, torch.Tensor] = {}
    seen_storage: set[int] = set()
    for key, value in state_dict.items():
        tensor = value.detach().to("cpu", dtype=value.dtype if key in copied else dtype).contiguous()
        if tensor.untyped_storage().data_ptr() in seen_storage:  # tied weights: safetensors needs own storage
            tensor = tensor.clone()
        seen_storage.add(tensor.untyped_storage().data_ptr())
        tensors[key] = tensor
    final_path = folder / snapshot_filename(time, sigma_rel)
    check_finite(tensors, f"snapshot {final_path}")
    metadata = {
        "format": SNAPSHOT_FORMAT,
        "format_version": SNAPSHOT_FORMAT_VERSION,
        "time": int(time),
        "time_unit": time_unit,
        "sigma_rel": float(sigma_rel),
        "gamma": float(gamma),
        "dtype": str(dtype).removeprefix("torch."),
        "copied_keys": list(copied_keys),
        "model_class": model_class,
        "model_config": model_config,
        "library_version": __version__,
        "run_id": run_id,
    }
    save_safetensors(tensors, final_path, METADATA_KEY, metadata)
    return str(final_path)


def parse_snapshot_metadata(header: dict[str, str], where: str) -> dict[str, Any]:
    """The one reader of a snapshot's ``"phema"`` header metadata (from a local file or a remote header read).

    Returns the fields of the format above with their types; raises ``ValueError`` naming ``where``.
    """
    if METADATA_KEY not in header:
        raise ValueError(f"snapshot file {where} has no '{METADATA_KEY}' metadata (not written by PowerFunctionEMA?)")
    try:
        meta = json.loads(header[METADATA_KEY])
        if meta.get("format") != SNAPSHOT_FORMAT:
            raise ValueError(f"format is {meta.get('format')!r}")
        if int(meta["format_version"]) > SNAPSHOT_FORMAT_VERSION:
            raise ValueError(f"format_version {meta['format_version']} is newer than this library supports")
        return {
            "time": int(meta["time"]),
            "time_unit": str(meta["time_unit"]),
            "sigma_rel": float(meta["sigma_rel"]),
            "gamma": float(meta["gamma"]),
            "dtype": str(meta["dtype"]),
            "copied_keys": tuple(meta["copied_keys"]),
            "model_class": meta["model_class"],
            "model_config": meta["model_config"],
            "library_version": str(meta["library_version"]),
            "run_id": _optional_str(meta.get("run_id"), "run_id"),
            "content_sha256": _optional_str(meta.get(DIGEST_KEY), DIGEST_KEY),
        }
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"snapshot file {where} has invalid '{METADATA_KEY}' metadata: {error!r}") from None


def _optional_str(value: Any, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {value!r}")
    return value


def check_filename_matches(name: str, time: int, sigma_rel: float, where: str, record: str = "its header") -> None:
    """Raise ``ValueError`` when a snapshot file's ``name`` disagrees with the time and sigma_rel that ``record``
    (its header, or an index entry) gives for it."""
    expected = snapshot_filename(time, sigma_rel)
    if FILENAME_PATTERN.match(name) and name != expected:
        raise ValueError(
            f"snapshot file {where} is named {name!r} but {record} records time {time} and sigma_rel {sigma_rel} "
            f"(file name {expected!r})"
        )


def read_snapshot_info(path: str | os.PathLike) -> SnapshotInfo:
    """Read a snapshot's header (metadata and tensor shapes) without loading tensor data.

    A file named like a snapshot must carry the time and sigma_rel its name says (``ValueError`` otherwise).
    """
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as error:  # safetensors raises its own error types for truncated/corrupt headers
        raise ValueError(f"snapshot file {path} is truncated or corrupt: {error}") from None
    info = SnapshotInfo(path=path, shapes=shapes, **parse_snapshot_metadata(header, str(path)))
    check_filename_matches(path.name, info.time, info.sigma_rel, str(path))
    return info


def list_snapshots(folder: str | os.PathLike) -> list[SnapshotInfo]:
    """All snapshots in ``folder`` sorted by (time, sigma_rel), from their headers only.

    Files not named ``phema-*.safetensors`` (including temporary files of writes in progress) are ignored; a
    snapshot file with a bad header, or a ``phema-*.safetensors`` file whose name does not follow the pattern (it
    would otherwise be left out silently), raises ``ValueError`` naming it. An empty folder gives an empty list.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"snapshot folder {folder} does not exist or is not a folder")
    names = sorted(path.name for path in folder.iterdir())
    for name in names:
        if name.startswith("phema-") and name.endswith(".safetensors") and not FILENAME_PATTERN.match(name):
            raise ValueError(
                f"{folder / name} is not named like a snapshot (phema-<10-digit time>-<sigma_rel>.safetensors); "
                "rename or remove it"
            )
    infos = [read_snapshot_info(folder / name) for name in names if FILENAME_PATTERN.match(name)]
    return sorted(infos, key=lambda info: (info.time, info.sigma_rel))
