"""Content checksums and finiteness checks for the files the project writes.

Two kinds of checksum, both SHA-256 (with the SHA extensions of current x86-64 CPUs it hashes faster than BLAKE2b;
see ``benchmarks/results/checksums.md``):

- a safetensors file written by the project holds one header metadata entry, a JSON object (the snapshot or state
  record) whose field ``"content_sha256"`` is the checksum of the file's tensors: ``sha256`` over one line
  ``<name> <dtype> <shape> <sha256 of the raw bytes>`` per tensor in name order. It does not depend on the file
  layout, so it can be computed from the tensors before writing and verified while streaming them back in any order
  (:class:`TensorDigest`). One entry, not two: safetensors writes several metadata entries in an arbitrary order, and
  the same content must give the same bytes;
- a folder written by other libraries (accelerate, diffusers ``save_pretrained``) gets a manifest
  ``{relative path: sha256 of the file's bytes}`` in a record file written last (:func:`folder_manifest`).

Verification is on by default wherever the project reads what it wrote; a mismatch raises :class:`IntegrityError`
naming the file and both checksums. Files written before checksums existed carry none and are read unverified.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .atomic import atomic_path

DIGEST_KEY = "content_sha256"


class IntegrityError(ValueError):
    """A file's content differs from the checksum recorded for it, or a record disagrees with what it describes."""


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's data as stored by safetensors (contiguous, little-endian), without a copy when possible."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def data_sha256(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's raw bytes as stored (hashing releases the GIL: it can overlap other work)."""
    return hashlib.sha256(_raw_bytes(tensor)).hexdigest()


class TensorDigest:
    """Accumulates the content checksum of a set of named tensors, added in any order."""

    def __init__(self) -> None:
        self._lines: dict[str, str] = {}

    def add(self, name: str, tensor: torch.Tensor, raw_sha256: str | None = None) -> None:
        """Add ``tensor`` under ``name`` (``raw_sha256``: :func:`data_sha256` of it, if already computed)."""
        data = raw_sha256 or data_sha256(tensor)
        dtype = str(tensor.dtype).removeprefix("torch.")
        self._lines[name] = f"{name} {dtype} {list(tensor.shape)} {data}\n"

    def hexdigest(self) -> str:
        digest = hashlib.sha256()
        for name in sorted(self._lines):
            digest.update(self._lines[name].encode())
        return digest.hexdigest()


def tensors_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """The content checksum of ``tensors`` (see the module docstring); tensors are hashed on several threads
    (``hashlib`` releases the GIL while hashing)."""
    names = list(tensors)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        hashes = pool.map(lambda name: data_sha256(tensors[name]), names)
        digest = TensorDigest()
        for name, data in zip(names, hashes, strict=True):
            digest.add(name, tensors[name], data)
    return digest.hexdigest()


def check_recorded_digest(recorded: str | None, actual: str, where: str) -> None:
    """Raise :class:`IntegrityError` naming ``where`` unless ``actual`` equals ``recorded`` (``None``: unrecorded)."""
    if recorded is not None and recorded != actual:
        raise IntegrityError(
            f"{where} is damaged: its tensor data has sha256 {actual}, but the file records {recorded}"
        )


def check_finite(tensors: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise ``ValueError`` naming ``what`` and the first tensor holding NaN or Inf (non-float tensors pass).

    Fast path: a finite sum proves every element finite (a NaN or Inf element makes the sum NaN or Inf); only a
    non-finite sum, which a large but finite tensor can also give by overflow, is checked element by element.
    """
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            continue
        total = tensor.detach().sum(dtype=torch.float64 if tensor.dtype == torch.float64 else torch.float32)
        if bool(torch.isfinite(total)):
            continue
        bad = int((~torch.isfinite(tensor)).sum())
        if bad:
            raise ValueError(f"{what}: tensor {name!r} holds {bad} NaN or infinite values; refusing to save it")


def save_safetensors(
    tensors: Mapping[str, torch.Tensor], path: str | os.PathLike, key: str, record: Mapping[str, Any]
) -> None:
    """Write ``tensors`` as a safetensors file atomically; the header metadata is ``{key: JSON of record}`` with
    the tensors' content checksum added to ``record`` as ``"content_sha256"``."""
    metadata = {key: json.dumps({**record, DIGEST_KEY: tensors_sha256(tensors)})}
    with atomic_path(path) as temporary:
        save_file(dict(tensors), str(temporary), metadata=metadata)


def load_verified(path: str | os.PathLike, key: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """All tensors of a file written by :func:`save_safetensors` and its record (the JSON under ``key``), the
    recorded content checksum verified (records without one are returned unverified).

    Raises ``ValueError`` naming the file when it cannot be read, :class:`IntegrityError` when it is damaged.
    """
    try:
        with safe_open(str(path), framework="pt") as handle:
            record = json.loads((handle.metadata() or {})[key])
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        if not isinstance(record, dict):
            raise TypeError(f"metadata {key!r} is not a JSON object")
    except Exception as error:  # safetensors raises its own error types for truncated or corrupt files
        raise ValueError(f"{path} is not a readable safetensors file with a {key!r} record: {error!r}") from None
    check_recorded_digest(record.get(DIGEST_KEY), tensors_sha256(tensors), str(path))
    return tensors, record


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes, read in chunks."""
    with open(path, "rb") as stream:
        return hashlib.file_digest(stream, "sha256").hexdigest()


def folder_files(folder: str | os.PathLike, exclude: Iterable[str] = ()) -> list[str]:
    """Relative POSIX paths of every file under ``folder``, sorted, without those in ``exclude``."""
    folder, skip = Path(folder), set(exclude)
    found = (path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file())
    return sorted(name for name in found if name not in skip)


def folder_manifest(folder: str | os.PathLike, exclude: Iterable[str] = ()) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``folder`` except those in ``exclude``."""
    return {name: file_sha256(Path(folder) / name) for name in folder_files(folder, exclude)}


def verify_manifest(folder: str | os.PathLike, manifest: Mapping[str, str], exclude: Iterable[str] = ()) -> None:
    """Raise :class:`IntegrityError` naming the first file of ``folder`` that is missing, unrecorded or changed."""
    folder = Path(folder)
    present = folder_files(folder, exclude)
    missing = sorted(set(manifest) - set(present))
    if missing:
        raise IntegrityError(f"{folder / missing[0]} is missing ({len(missing)} recorded files are missing)")
    unrecorded = sorted(set(present) - set(manifest))
    if unrecorded:
        raise IntegrityError(f"{folder / unrecorded[0]} is not in the folder's recorded file list")
    for name, recorded in sorted(manifest.items()):
        actual = file_sha256(folder / name)
        if actual != recorded:
            raise IntegrityError(f"{folder / name} is damaged: its sha256 is {actual}, but {recorded} was recorded")


__all__ = [
    "DIGEST_KEY",
    "IntegrityError",
    "TensorDigest",
    "check_finite",
    "check_recorded_digest",
    "data_sha256",
    "file_sha256",
    "load_verified",
    "save_safetensors",
    "folder_files",
    "folder_manifest",
    "tensors_sha256",
    "verify_manifest",
]
