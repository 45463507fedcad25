"""Read network pickles of the official EDM2 code as plain data, running nothing from the file.

The official code pickles its networks with ``pickle.dump``. Each class decorated by its ``persistence`` module
reduces to ``torch_utils.persistence._reconstruct_persistent_obj(meta)``, where ``meta`` holds ``type``,
``version``, ``module_src`` (the source of the class's module, which the official loader executes),
``class_name`` and ``state`` (the object's ``__dict__``: for a ``torch.nn.Module`` its ``_parameters``,
``_buffers``, ``_modules`` and plain attributes, plus ``_init_args`` / ``_init_kwargs``). Tensors reduce to
``torch._utils._rebuild_tensor_v2`` over a storage given as ``torch.storage._load_from_bytes(bytes)``, a small
legacy ``torch.save`` file.

:class:`RestrictedUnpickler` resolves globals from an explicit allow-list only (``find_class`` is the single
entry point through which a pickle reaches any callable) and raises :class:`UnsafePickleError` naming any other
global. On the list are torch's own ``weights_only`` globals (tensor rebuilding, dtypes, ``OrderedDict``), data
records standing in for the persistence wrapper, ``dnnlib``'s ``EasyDict`` and torch's container modules, a
storage reader that loads the storage bytes with ``torch.load(weights_only=True)``, and numpy arrays and scalars
of non-object dtypes. The embedded module source is never executed: only its SHA-256 is kept.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch._weights_only_unpickler import _get_allowed_globals

__all__ = [
    "EasyDict",
    "ModuleRecord",
    "PersistentObject",
    "RestrictedUnpickler",
    "UnsafePickleError",
    "load_restricted_pickle",
    "module_tensors",
]


class UnsafePickleError(pickle.UnpicklingError):
    """The pickle names a global outside the allow-list (or a construct this reader refuses)."""


@dataclass
class PersistentObject:
    """An object of a persistence-decorated class: its class name and recorded state, as plain data.

    ``state`` is the object's ``__dict__`` as pickled; ``source_sha256`` identifies the module source that the
    official loader would execute (the source itself is dropped).
    """

    class_name: str
    version: int | None
    state: dict[str, Any] = field(repr=False)
    source_sha256: str = ""

    def __getitem__(self, key: str) -> Any:
        return self.state[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.state.get(key, default)


class ModuleRecord:
    """Stand-in for a ``torch.nn`` container (``ModuleDict``, ``ModuleList``, ...): its pickled ``__dict__``."""

    class_path = "torch.nn.modules.module.Module"

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise UnsafePickleError(f"{self.class_path}: expected a dict state, got {type(state).__name__}")
        self.state = state

    def __getitem__(self, key: str) -> Any:
        return self.state[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.state.get(key, default)

    def __repr__(self) -> str:
        return f"ModuleRecord({self.class_path})"


class EasyDict(dict):
    """Stand-in for ``dnnlib.EasyDict``: a dict whose keys read as attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setstate__(self, state: dict[str, Any] | None) -> None:
        if state:
            self.update(state)


def _persistent_object(meta: dict[str, Any]) -> PersistentObject:
    """The data of ``_reconstruct_persistent_obj(meta)``, without executing ``meta["module_src"]``."""
    if not isinstance(meta, dict) or meta.get("type") != "class":
        raise UnsafePickleError("persistent object: meta must be a dict with type='class'")
    source, class_name, state = meta.get("module_src"), meta.get("class_name"), meta.get("state")
    if not isinstance(source, str) or not isinstance(class_name, str):
        raise UnsafePickleError("persistent object: meta needs module_src and class_name strings")
    if state is None:
        state = {}
    if not isinstance(state, dict):
        raise UnsafePickleError(f"persistent object {class_name}: state must be a dict, got {type(state).__name__}")
    digest = hashlib.sha256(source.encode("utf-8")).hexdigest()
    return PersistentObject(class_name, meta.get("version"), dict(state), digest)


def _storage_from_bytes(data: bytes) -> torch.storage.TypedStorage:
    """A storage saved by ``torch.save`` into bytes, read with torch's ``weights_only`` unpickler."""
    if not isinstance(data, bytes):
        raise UnsafePickleError(f"storage: expected bytes, got {type(data).__name__}")
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def _plain_dtype(spec: Any, *args: Any) -> np.dtype:
    """``numpy.dtype(spec)`` for dtypes without Python objects (``align`` / ``copy`` flags are irrelevant here)."""
    if not isinstance(spec, str):
        raise UnsafePickleError(f"numpy.dtype: expected a type code string, got {type(spec).__name__}")
    dtype = np.dtype(spec)
    if dtype.hasobject:
        raise UnsafePickleError(f"numpy.dtype: object dtype {spec!r} is refused")
    return dtype


def _empty_array(subtype: Any, shape: Any, dtype_code: Any) -> np.ndarray:
    """Target of numpy's ``_reconstruct``: an empty plain ndarray that BUILD then fills."""
    if subtype is not np.ndarray:
        raise UnsafePickleError(f"numpy array: only numpy.ndarray is allowed, got {subtype!r}")
    return np.ndarray.__new__(np.ndarray, (0,), dtype="b")


def _numpy_scalar(dtype: Any, data: Any = None) -> Any:
    """A numpy scalar of a non-object dtype from its raw bytes."""
    if not isinstance(dtype, np.dtype) or dtype.hasobject or not isinstance(data, bytes):
        raise UnsafePickleError("numpy scalar: need a plain dtype and raw bytes")
    return np.frombuffer(data, dtype=dtype)[0]


def _module_record_class(class_path: str) -> type[ModuleRecord]:
    return type(class_path.rsplit(".", 1)[1], (ModuleRecord,), {"class_path": class_path})


_CONTAINERS = [
    "torch.nn.modules.container.ModuleDict",
    "torch.nn.modules.container.ModuleList",
    "torch.nn.modules.container.Sequential",
    "torch.nn.modules.module.Module",
]

#: Globals this reader resolves besides torch's own ``weights_only`` allow-list: "module.name" -> stand-in.
EDM2_GLOBALS: dict[str, Callable[..., Any]] = {
    "torch_utils.persistence._reconstruct_persistent_obj": _persistent_object,
    "dnnlib.util.EasyDict": EasyDict,
    "dnnlib.EasyDict": EasyDict,
    "torch.storage._load_from_bytes": _storage_from_bytes,
    "numpy.ndarray": np.ndarray,
    "numpy.dtype": _plain_dtype,
    "numpy.core.multiarray._reconstruct": _empty_array,
    "numpy._core.multiarray._reconstruct": _empty_array,
    "numpy.core.multiarray.scalar": _numpy_scalar,
    "numpy._core.multiarray.scalar": _numpy_scalar,
    **{path: _module_record_class(path) for path in _CONTAINERS},
}


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` answers only from an allow-list; anything else is refused.

    ``extra_globals`` maps ``"module.name"`` to the object to use; torch's ``weights_only`` globals are always
    allowed. Persistent ids are refused (plain ``pickle.dump`` files have none).
    """

    def __init__(self, file: io.BufferedIOBase, extra_globals: dict[str, Callable[..., Any]] | None = None):
        super().__init__(file)
        self._allowed = {**_get_allowed_globals(), **(EDM2_GLOBALS if extra_globals is None else extra_globals)}

    def find_class(self, module: str, name: str) -> Any:
        path = f"{module}.{name}"
        if path not in self._allowed:
            raise UnsafePickleError(
                f"refusing to load global {path!r}: it is not on the allow-list of this reader (the file is not an "
                "EDM2 network pickle, or it carries code)"
            )
        return self._allowed[path]

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"refusing persistent id {pid!r}: plain network pickles carry none")


def load_restricted_pickle(path: str | os.PathLike) -> Any:
    """Unpickle ``path`` with :class:`RestrictedUnpickler` (EDM2 allow-list); returns plain data and tensors."""
    with open(path, "rb") as handle:
        return RestrictedUnpickler(handle).load()


def _children(record: PersistentObject | ModuleRecord) -> Iterator[tuple[str, Any]]:
    yield from (record.get("_modules") or {}).items()


def module_tensors(record: PersistentObject | ModuleRecord, prefix: str = "") -> dict[str, torch.Tensor]:
    """The ``state_dict`` of a pickled module record: parameters and persistent buffers, names joined with dots."""
    if not isinstance(record, PersistentObject | ModuleRecord):
        raise ValueError(f"expected a pickled torch module, got {type(record).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    non_persistent = record.get("_non_persistent_buffers_set") or set()
    for group in ("_parameters", "_buffers"):
        for name, tensor in (record.get(group) or {}).items():
            if tensor is not None and name not in non_persistent:
                tensors[prefix + name] = tensor.detach()
    for name, child in _children(record):
        if child is not None:
            tensors.update(module_tensors(child, f"{prefix}{name}."))
    return tensors
