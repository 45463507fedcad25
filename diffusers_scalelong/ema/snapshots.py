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

The JSON object also holds ``content_sha256``, the checksum of the tensor data (``diffusers_scalelong.integrity``),
verified whenever the tensors are read for a reconstruction, and ``header_sha256``, the SHA-256 of the canonical
JSON (sorted keys, no spaces) of every other field above, verified whenever the header is read. The tensors are
checked finite before a snapshot is written.

Every header is also cross-checked, so that metadata which changes a reconstruction cannot be edited unnoticed,
even in files written before ``header_sha256`` existed (read without it): ``gamma`` must be the exponent of
``sigma_rel`` (recomputed), ``copied_keys`` must name tensors of the file, the averaged tensors must be stored in
``dtype``, and for a recorded ``model_class`` the class built from ``model_config`` on the ``meta`` device must have
exactly the file's tensors and buffers (``diffusers_scalelong.ema.model_check``) before any real model is built.

Files are written to a temporary name in the target folder and renamed into place, so a reader never sees a
half-written snapshot. ``list_snapshots`` reads only the safetensors headers, checks that each file's name
agrees with the time and sigma_rel in its header, and refuses a snapshot that is a symbolic link leading out of
the folder.

For tools that move snapshots (e.g. to and from a Hub repository): the file name alone gives the time and the
(rounded) sigma_rel (``parse_snapshot_filename``), so a reconstruction at time ``T`` needs exactly the files with
time ``<= T``; the reconstruction functions accept a folder or any list of ``SnapshotInfo``; a reconstructed model
folder carries ``phema.json`` (sigma_rel, gamma, time, time_unit, dtype, relative_profile_error, the snapshots and
their coefficients, library_version) for model cards. The names and the metadata keys above are stable.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .._version import __version__
from ..integrity import DIGEST_KEY, IntegrityError, check_finite, save_safetensors
from .profiles import sigma_rel_to_gamma

SNAPSHOT_FORMAT = "diffusers_scalelong.phema-snapshot"
SNAPSHOT_FORMAT_VERSION = 1
METADATA_KEY = "phema"
FILENAME_PATTERN = re.compile(r"^phema-(\d{10})-(\d+\.\d+)\.safetensors$")
STORAGE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
HEADER_DIGEST_KEY = "header_sha256"
TIME_UNITS = ("steps", "images")
_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# The stored gamma and the one recomputed from sigma_rel agree to float64 round-off (the cubic's root is polished
# with Newton steps: ~1e-15 relative, whatever the platform's LAPACK); 1e-9 leaves room for that and still refuses
# any edit that would move a weight (a 1e-9 change of gamma moves the profile by ~1e-9 of its width).
_GAMMA_RTOL = 1e-9
# Longest header record read: a diffusers config is a few KB and copied_keys ~80 characters per tensor, so 4 MiB
# holds the record of a model with tens of thousands of tensors; a longer one is refused before it is parsed.
_MAX_METADATA_CHARS = 4 << 20


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
    metadata[HEADER_DIGEST_KEY] = header_sha256(metadata)
    save_safetensors(tensors, final_path, METADATA_KEY, metadata)
    return str(final_path)


def header_sha256(meta: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of a snapshot header's fields, without the two checksum fields."""
    fields = {key: value for key, value in meta.items() if key not in (DIGEST_KEY, HEADER_DIGEST_KEY)}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def parse_snapshot_metadata(header: dict[str, str], where: str) -> dict[str, Any]:
    """The one reader of a snapshot's ``"phema"`` header metadata (from a local file or a remote header read).

    Returns the fields of the format above with their types, after checking ``header_sha256`` (when present) and
    that ``gamma`` is the exponent of ``sigma_rel``; raises ``ValueError`` naming ``where``
    (:class:`~diffusers_scalelong.integrity.IntegrityError` for an edited header).
    """
    if METADATA_KEY not in header:
        raise ValueError(f"snapshot file {where} has no '{METADATA_KEY}' metadata (not written by PowerFunctionEMA?)")
    if len(header[METADATA_KEY]) > _MAX_METADATA_CHARS:
        raise ValueError(
            f"snapshot file {where} has a '{METADATA_KEY}' record of {len(header[METADATA_KEY])} characters, more than "
            f"the {_MAX_METADATA_CHARS} a snapshot header may hold"
        )
    try:
        meta = json.loads(header[METADATA_KEY])
        if not isinstance(meta, dict):
            raise TypeError("the metadata is not a JSON object")
        if meta.get("format") != SNAPSHOT_FORMAT:
            raise ValueError(f"format is {meta.get('format')!r}")
        if int(meta["format_version"]) > SNAPSHOT_FORMAT_VERSION:
            raise ValueError(f"format_version {meta['format_version']} is newer than this library supports")
        fields = {
            "time": _integer(meta["time"], "time"),
            "time_unit": _choice(meta["time_unit"], TIME_UNITS, "time_unit"),
            "sigma_rel": float(meta["sigma_rel"]),
            "gamma": float(meta["gamma"]),
            "dtype": _choice(meta["dtype"], tuple(STORAGE_DTYPES), "dtype"),
            "copied_keys": _string_tuple(meta["copied_keys"], "copied_keys"),
            "model_class": _optional_str(meta["model_class"], "model_class"),
            "model_config": meta["model_config"],
            "library_version": str(meta["library_version"]),
            "run_id": _optional_str(meta.get("run_id"), "run_id"),
            "content_sha256": _optional_str(meta.get(DIGEST_KEY), DIGEST_KEY),
        }
        if not (fields["model_config"] is None or isinstance(fields["model_config"], dict)):
            raise TypeError(f"model_config must be a JSON object or null, got {type(fields['model_config']).__name__}")
        recorded = _optional_str(meta.get(HEADER_DIGEST_KEY), HEADER_DIGEST_KEY)
        expected_gamma = sigma_rel_to_gamma(fields["sigma_rel"])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"snapshot file {where} has invalid '{METADATA_KEY}' metadata: {error!r}") from None
    if recorded is not None and recorded != header_sha256(meta):
        raise IntegrityError(
            f"snapshot file {where}: its header metadata was changed after it was written (the fields no longer match "
            f"its {HEADER_DIGEST_KEY})"
        )
    if not math.isclose(fields["gamma"], expected_gamma, rel_tol=_GAMMA_RTOL, abs_tol=0.0):
        raise ValueError(
            f"snapshot file {where} records gamma={fields['gamma']!r}, but the profile of sigma_rel="
            f"{fields['sigma_rel']!r} has gamma={expected_gamma!r}; the header was edited or the file is damaged"
        )
    return fields


def _integer(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def _choice(value: Any, choices: tuple[str, ...], name: str) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def _string_tuple(value: Any, name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value) or len(set(value)) != len(value):
        raise TypeError(f"{name} must be a list of distinct strings")
    return tuple(value)


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

    A file named like a snapshot must carry the time and sigma_rel its name says; its header is cross-checked
    against its tensors (see the module docstring); ``ValueError`` otherwise.
    """
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            slices = {k: f.get_slice(k) for k in f.keys()}
            shapes = {k: tuple(s.get_shape()) for k, s in slices.items()}
            dtypes = {k: s.get_dtype() for k, s in slices.items()}
    except Exception as error:  # safetensors raises its own error types for truncated/corrupt headers
        raise ValueError(f"snapshot file {path} is truncated or corrupt: {error}") from None
    info = SnapshotInfo(path=path, shapes=shapes, **parse_snapshot_metadata(header, str(path)))
    check_filename_matches(path.name, info.time, info.sigma_rel, str(path))
    _check_tensors(info, dtypes)
    return info


def _check_tensors(info: SnapshotInfo, dtypes: dict[str, str]) -> None:
    """The header's ``copied_keys``, ``dtype`` and model against the file's tensors (see the module docstring)."""
    where = f"snapshot file {info.path}"
    unknown = [key for key in info.copied_keys if key not in info.shapes]
    if unknown:
        raise ValueError(f"{where}: copied_keys name {unknown[0]!r}, which the file does not hold")
    averaged = [key for key in info.shapes if key not in set(info.copied_keys)]
    if not averaged:
        raise ValueError(f"{where}: copied_keys name every tensor, so nothing would be averaged")
    stored = [key for key in averaged if _SAFETENSORS_DTYPES.get(dtypes[key]) != info.dtype]
    if stored:
        raise ValueError(
            f"{where}: the averaged tensor {stored[0]!r} is stored as {dtypes[stored[0]]}, but the header says "
            f"dtype={info.dtype} (copied_keys was edited, or the file is damaged)"
        )
    if info.model_class is not None:
        from .model_check import check_model_matches

        check_model_matches(info.model_class, info.model_config, info.shapes, info.copied_keys, where)


def list_snapshots(folder: str | os.PathLike) -> list[SnapshotInfo]:
    """All snapshots in ``folder`` sorted by (time, sigma_rel), from their headers only.

    Files not named ``phema-*.safetensors`` (including temporary files of writes in progress) are ignored; a
    snapshot file with a bad header, or a ``phema-*.safetensors`` file whose name does not follow the pattern (it
    would otherwise be left out silently), or one that is a symbolic link leading out of ``folder``, raises
    ``ValueError`` naming it. An empty folder gives an empty list.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"snapshot folder {folder} does not exist or is not a folder")
    root = folder.resolve()
    names = sorted(path.name for path in folder.iterdir())
    for name in names:
        if name.startswith("phema-") and name.endswith(".safetensors") and not FILENAME_PATTERN.match(name):
            raise ValueError(
                f"{folder / name} is not named like a snapshot (phema-<10-digit time>-<sigma_rel>.safetensors); "
                "rename or remove it"
            )
        if FILENAME_PATTERN.match(name) and (folder / name).resolve().parent != root:
            raise ValueError(
                f"{folder / name} is a symbolic link to {(folder / name).resolve()}, outside {folder}; only files "
                "inside the snapshot folder are read (copy the file in instead)"
            )
    infos = [read_snapshot_info(folder / name) for name in names if FILENAME_PATTERN.match(name)]
    return sorted(infos, key=lambda info: (info.time, info.sigma_rel))
