"""Read network pickles of the official EDM2 code and torch checkpoint files as fresh plain data, running nothing.

The official code pickles its networks with ``pickle.dump``. Each class decorated by its ``persistence`` module
reduces to ``torch_utils.persistence._reconstruct_persistent_obj(meta)``, where ``meta`` holds ``type``,
``version``, ``module_src`` (the source of the class's module, which the official loader executes),
``class_name`` and ``state`` (the object's ``__dict__``: for a ``torch.nn.Module`` its ``_parameters``,
``_buffers``, ``_modules`` and plain attributes, plus ``_init_args`` / ``_init_kwargs``). Tensors reduce to
``torch._utils._rebuild_tensor_v2`` over a storage given as ``torch.storage._load_from_bytes(bytes)``, a small
legacy ``torch.save`` file (three header pickles, the storage's pickle, its key list, then ``numel`` as int64 and
the raw bytes). A ``torch.save`` checkpoint (``nnet_ema.pth``) is a zip of ``data.pkl`` and one raw file per
storage.

Both run through :class:`~.pickle_vm.SafeUnpickler`, whose allow-list here names only the exact constructors these
files use, each a wrapper that validates its arguments and returns a new object: records standing in for the
persistence wrapper and torch's containers, ``dnnlib``'s ``EasyDict``, an empty ``OrderedDict``, storages read by
this module (their size must equal the bytes present), tensors that are dense views covering exactly their storage
(no stride 0, no overlap, no offset, no sparse / quantized layouts, no neg / conj bits), and numpy arrays and
scalars of plain numeric dtypes. The embedded module source is never executed: only its SHA-256 is kept.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import re
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np
import torch

from .pickle_vm import (
    ATOMS,
    Budget,
    Global,
    PickleLimits,
    SafeUnpickler,
    Source,
    UnsafePickleError,
    brief,
    check_plain_tree,
)

__all__ = [
    "EasyDict",
    "ModuleRecord",
    "PersistentObject",
    "PickleLimits",
    "UnsafePickleError",
    "load_restricted_pickle",
    "load_torch_checkpoint",
    "module_tensors",
]

#: Storage types (the names torch pickles) -> dtype: plain numbers only (no bool, complex or quantized types).
STORAGE_DTYPES = {
    f"torch.{name}": dtype
    for dtype, name in torch.storage._dtype_to_storage_type_map().items()
    if dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32)
    or dtype in (torch.int16, torch.int8, torch.uint8)
}
NUMPY_CODES = ("b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8")
NUMPY_DTYPES = {np.dtype(code) for code in NUMPY_CODES}
LEGACY_MAGIC, LEGACY_PROTOCOL = 0x1950A86A20F9469CFC6C, 1001
MAX_NDIM = 16


@dataclass(eq=False)
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

    def __init__(self, class_path: str) -> None:
        self.class_path = class_path
        self.state: dict[str, Any] = {}

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


class _Storage:
    """A storage this reader read: a flat tensor over exactly the bytes the file holds for it."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat


# ---- validating wrappers (each returns a new object) -----------------------------------------------------------
def _refuse(message: str) -> NoReturn:
    raise UnsafePickleError(message)


def _ints(values: Any, what: str) -> tuple[int, ...]:
    if type(values) is not tuple or len(values) > MAX_NDIM or any(type(v) is not int for v in values):
        _refuse(f"tensor {what} must be a tuple of at most {MAX_NDIM} ints, got {type(values).__name__}")
    return values


def _check_dense(size: tuple[int, ...], stride: tuple[int, ...], numel: int) -> None:
    """Strides of a permuted contiguous layout: sorted by stride, each dim of size > 1 has stride = product of the
    sizes before it, so every element of the storage is used exactly once (no stride 0, no overlap, no gap)."""
    if any(s < 0 for s in size) or any(s < 0 for s in stride):
        _refuse(f"tensor size {size} / stride {stride} has negative entries")
    if numel == 0:
        return
    expected = 1
    for dim in sorted((d for d in range(len(size)) if size[d] > 1), key=lambda d: stride[d]):
        if stride[dim] != expected:
            _refuse(f"tensor size {size} with stride {stride} is not dense (stride 0, overlapping or with gaps)")
        expected *= size[dim]


def _rebuild_tensor(
    storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, metadata: Any = None
) -> torch.Tensor:
    """``_rebuild_tensor_v2``: a dense view covering exactly ``storage`` (offset 0, numel = storage numel)."""
    if type(storage) is not _Storage:
        _refuse(f"tensor storage must be a storage this reader read, got {type(storage).__name__}")
    size, stride = _ints(size, "size"), _ints(stride, "stride")
    numel = math.prod(size)
    if len(size) != len(stride) or type(offset) is not int or offset != 0 or numel != storage.flat.numel():
        _refuse(
            f"tensor of size {size} at offset {brief(offset)} does not cover exactly its storage of "
            f"{storage.flat.numel()} elements"
        )
    _check_dense(size, stride, numel)
    _plain_flags(requires_grad, hooks)
    if metadata is not None and (type(metadata) is not dict or metadata):
        _refuse("tensor metadata (neg / conj bits) is refused")
    return storage.flat.as_strided(size, stride, 0)


def _plain_flags(requires_grad: Any, hooks: Any) -> None:
    if type(requires_grad) is not bool or type(hooks) not in (dict, OrderedDict) or hooks:
        _refuse("tensor: requires_grad must be a bool and backward hooks empty")


def _rebuild_parameter(data: Any, requires_grad: Any, hooks: Any) -> torch.Tensor:
    """``_rebuild_parameter``: the tensor itself (parameters come back as plain tensors)."""
    if type(data) is not torch.Tensor:
        _refuse(f"parameter data must be a tensor this reader built, got {type(data).__name__}")
    _plain_flags(requires_grad, hooks)
    return data


def _new_storage(raw: memoryview | bytes, dtype: torch.dtype) -> _Storage:
    """A storage over a copy of ``raw`` (the caller has charged its bytes to the budget)."""
    flat = torch.frombuffer(bytearray(raw), dtype=dtype) if len(raw) else torch.empty(0, dtype=dtype)
    return _Storage(flat)


def _storage_id(pid: Any, length: int) -> tuple[str, torch.dtype, int]:
    """``(key, dtype, numel)`` of a persistent id ``("storage", type, key, location, numel[, view])``."""
    if type(pid) is not tuple or len(pid) != length or pid[0] != "storage" or type(pid[1]) is not Global:
        _refuse(f"refusing persistent id {brief(pid)}: only plain storages are allowed")
    key, location, numel = pid[2], pid[3], pid[4]
    if pid[1].name not in STORAGE_DTYPES or type(key) is not str or not re.fullmatch(r"\w{1,64}", key):
        _refuse(f"refusing storage {pid[1].name} / key {brief(key)}")
    if type(location) is not str or type(numel) is not int or numel < 0 or (length == 6 and pid[5] is not None):
        _refuse("refusing a storage id with a bad location, size or view")
    return key, STORAGE_DTYPES[pid[1].name], numel


_STORAGE_TYPES = {name: Global(name) for name in STORAGE_DTYPES}


def _legacy_storage(data: Any, budget: Budget) -> _Storage:
    """``torch.storage._load_from_bytes``: one storage from a small legacy ``torch.save`` file, read here."""
    if type(data) is not bytes:
        _refuse(f"storage: expected bytes, got {type(data).__name__}")
    source = Source(io.BytesIO(data), len(data))
    magic, version, sys_info = (SafeUnpickler(source, {}, budget).load() for _ in range(3))
    if magic != LEGACY_MAGIC or version != LEGACY_PROTOCOL or type(sys_info) is not dict:
        _refuse("storage: not a legacy torch.save storage")
    if sys_info.get("little_endian") is not True:
        _refuse("storage: only little-endian storages are read")
    found: list[tuple[str, torch.dtype, int]] = []

    def persistent_load(pid: Any) -> tuple[str, torch.dtype, int]:
        if found:
            _refuse("storage: the embedded file holds more than one storage")
        found.append(_storage_id(pid, 6))
        return found[0]

    root = SafeUnpickler(source, _STORAGE_TYPES, budget, persistent_load).load()
    keys = SafeUnpickler(source, {}, budget).load()
    if not found or root is not found[0] or type(keys) is not list or keys != [found[0][0]]:
        _refuse("storage: the embedded file is not one plain storage")
    _, dtype, numel = found[0]
    (count,) = struct.unpack("<q", source.read(8))
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if count != numel or source.left != nbytes:
        _refuse(f"storage: claims {numel} elements ({nbytes} bytes) but holds {source.left} bytes")
    budget.charge(nbytes, f"a storage of {nbytes} bytes")
    return _new_storage(memoryview(data)[len(data) - nbytes :], dtype)


def _persistent_object(meta: Any) -> PersistentObject:
    """The data of ``_reconstruct_persistent_obj(meta)``, without executing ``meta["module_src"]``."""
    if type(meta) is not dict or meta.get("type") != "class":
        _refuse("persistent object: meta must be a dict with type='class'")
    source, class_name, state, version = (meta.get(k) for k in ("module_src", "class_name", "state", "version"))
    if type(source) is not str or type(class_name) is not str:
        _refuse("persistent object: meta needs module_src and class_name strings")
    if state is None:
        state = {}
    if type(state) is not dict or type(version) not in ATOMS:
        _refuse(f"persistent object {class_name}: state must be a dict and version a number")
    digest = hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest()
    return PersistentObject(class_name, version, state, digest)


def _numpy_dtype(code: Any, align: Any = False, copy: Any = True) -> np.dtype:
    """``numpy.dtype(code)`` for plain numeric codes only (the shared dtype object is returned, never changed)."""
    if type(code) is not str or code not in NUMPY_CODES or type(align) is not bool or type(copy) is not bool:
        _refuse(f"numpy.dtype {brief(code)}: only plain numeric dtypes are allowed (no object dtype)")
    return np.dtype(code)


def _numpy_dtype_state(dtype: np.dtype, state: Any) -> None:
    """BUILD of a dtype: accepted only if it states what the dtype already is (native byte order, no fields)."""
    if (
        type(state) is not tuple
        or len(state) != 8
        or state[1] not in ("<", "|", "=")
        or any(x is not None for x in state[2:5])
    ):
        _refuse(f"numpy.dtype {dtype}: only native-order plain dtypes are allowed")


_NDARRAY = Global("numpy.ndarray")


def _numpy_array(subtype: Any, shape: Any, typecode: Any) -> np.ndarray:
    """Target of numpy's ``_reconstruct``: a new empty plain ndarray that BUILD then fills."""
    if subtype is not _NDARRAY:
        _refuse(f"numpy array: only numpy.ndarray is allowed, got {type(subtype).__name__}")
    return np.ndarray.__new__(np.ndarray, (0,), dtype="b")


def _numpy_array_state(array: np.ndarray, state: Any, budget: Budget) -> None:
    """BUILD of a new array: ``(version, shape, dtype, fortran, raw bytes)`` with ``len(raw) = prod(shape) * size``."""
    if type(state) is not tuple or len(state) != 5:
        _refuse("numpy array: malformed state")
    _, shape, dtype, fortran, raw = state
    if not isinstance(dtype, np.dtype) or dtype not in NUMPY_DTYPES or type(fortran) is not bool:
        _refuse("numpy array: only plain numeric dtypes are allowed (no object dtype)")
    shape = _ints(shape, "shape")
    if any(s < 0 for s in shape) or type(raw) is not bytes or len(raw) != math.prod(shape) * dtype.itemsize:
        _refuse(f"numpy array of shape {shape} does not match its {len(raw) if type(raw) is bytes else '?'} bytes")
    budget.charge(len(raw), "a numpy array")
    array.__setstate__((1, shape, dtype, fortran, raw))


def _numpy_scalar(dtype: Any, data: Any = None) -> Any:
    """A numpy scalar of a plain numeric dtype from its raw bytes."""
    if not isinstance(dtype, np.dtype) or dtype not in NUMPY_DTYPES or type(data) is not bytes:
        _refuse("numpy scalar: need a plain numeric dtype and raw bytes")
    if len(data) != dtype.itemsize:
        _refuse(f"numpy scalar: {len(data)} bytes for a {dtype} scalar")
    return np.frombuffer(data, dtype=dtype)[0]


def _no_args(factory: Callable[[], Any]) -> Callable[..., Any]:
    def make(*args: Any) -> Any:
        if args:
            _refuse(f"refusing {len(args)} arguments to a constructor that takes none here")
        return factory()

    return make


def _set_module_state(record: ModuleRecord, state: Any) -> None:
    if type(state) is not dict:
        _refuse(f"{record.class_path}: expected a dict state, got {type(state).__name__}")
    record.state = state


def _update_easydict(target: EasyDict, state: Any) -> None:
    if state is not None and type(state) is not dict:
        _refuse("EasyDict: expected a dict state")
    target.update(state or {})


def _ignore_dict_state(target: OrderedDict, state: Any) -> None:
    """An ``OrderedDict``'s attributes (a state dict's ``_metadata``) are checked to be a dict and dropped."""
    if type(state) is not dict:
        _refuse("OrderedDict: expected a dict of attributes")


_CONTAINERS = [
    "torch.nn.modules.container.ModuleDict",
    "torch.nn.modules.container.ModuleList",
    "torch.nn.modules.container.Sequential",
    "torch.nn.modules.module.Module",
]


def _tensor_globals() -> dict[str, Global]:
    return {
        "collections.OrderedDict": Global(
            "collections.OrderedDict", call=_no_args(OrderedDict), build=_ignore_dict_state
        ),
        "torch._utils._rebuild_tensor_v2": Global("torch._utils._rebuild_tensor_v2", call=_rebuild_tensor),
        "torch._utils._rebuild_parameter": Global("torch._utils._rebuild_parameter", call=_rebuild_parameter),
    }


def _edm2_globals(budget: Budget) -> dict[str, Global]:
    """The allow-list of an official network pickle: "module.name" -> token (see the module docstring)."""
    tokens = [
        Global("torch_utils.persistence._reconstruct_persistent_obj", call=_persistent_object),
        Global("dnnlib.util.EasyDict", new=_no_args(EasyDict), build=_update_easydict),
        Global("dnnlib.EasyDict", new=_no_args(EasyDict), build=_update_easydict),
        Global("torch.storage._load_from_bytes", call=lambda data: _legacy_storage(data, budget)),
        _NDARRAY,
        Global("numpy.dtype", call=_numpy_dtype, build=_numpy_dtype_state),
        Global("numpy.core.multiarray.scalar", call=_numpy_scalar),
        Global("numpy._core.multiarray.scalar", call=_numpy_scalar),
        *(
            Global(path, call=_numpy_array, build=lambda array, state: _numpy_array_state(array, state, budget))
            for path in ("numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct")
        ),
        *(
            Global(path, new=_no_args(lambda path=path: ModuleRecord(path)), build=_set_module_state)
            for path in _CONTAINERS
        ),
    ]
    return {**_tensor_globals(), **{token.name: token for token in tokens}}


_LEAVES = (str, bytes, int, float, bool, type(None), torch.Tensor, np.ndarray, *{type(d) for d in NUMPY_DTYPES})
_LEAVES += tuple({d.type for d in NUMPY_DTYPES})
_CHILDREN: dict[type, Callable[[Any], Any]] = {
    dict: dict.values,
    OrderedDict: OrderedDict.values,
    EasyDict: dict.values,
    list: iter,
    tuple: iter,
    set: lambda _: (),  # members are strings
    frozenset: lambda _: (),
    PersistentObject: lambda record: (record.state,),
    ModuleRecord: lambda record: (record.state,),
}


def _load(
    source: Source,
    budget: Budget,
    limits: PickleLimits,
    globals: dict[str, Global],
    persistent_load: Callable[[Any], Any] | None = None,
) -> Any:
    unpickler = SafeUnpickler(source, globals, budget, persistent_load, dict_types=(dict, OrderedDict, EasyDict))
    result = unpickler.load()
    check_plain_tree(result, limits, _CHILDREN, _LEAVES)
    return result


def load_restricted_pickle(path: str | os.PathLike, limits: PickleLimits | None = None) -> Any:
    """Read an official network pickle at ``path`` as plain data and tensors (see the module docstring).

    Raises :class:`UnsafePickleError` (a ``ValueError``) for anything outside the allow-list or ``limits``.
    """
    limits = limits or PickleLimits()
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        budget = limits.budget(size)
        return _load(Source(handle, size), budget, limits, _edm2_globals(budget))


def load_torch_checkpoint(path: str | os.PathLike, limits: PickleLimits | None = None) -> Any:
    """Read a ``torch.save`` zip checkpoint (a state dict) at ``path`` as plain data and dense tensors.

    Storages must be stored uncompressed with exactly ``numel * element_size`` bytes; they are read once each.
    """
    limits = limits or PickleLimits()
    size = os.path.getsize(path)
    if not zipfile.is_zipfile(path):
        raise UnsafePickleError(f"{path} is not a torch.save zip checkpoint")
    with zipfile.ZipFile(path) as archive:
        pickles = [n for n in archive.namelist() if re.fullmatch(r"[^/]+/data\.pkl", n)]
        if len(pickles) != 1:
            raise UnsafePickleError(f"{path} is not a torch.save checkpoint (it needs one <name>/data.pkl)")
        root = pickles[0].removesuffix("data.pkl")
        entries = {info.filename: info for info in archive.infolist()}
        if any(info.compress_type != zipfile.ZIP_STORED or info.file_size > size for info in entries.values()):
            raise UnsafePickleError(f"{path} holds compressed or oversized entries; torch.save stores them plainly")
        if f"{root}byteorder" in entries and archive.read(f"{root}byteorder") != b"little":
            raise UnsafePickleError(f"{path} holds big-endian storages")

        budget = limits.budget(size)
        read: dict[str, _Storage] = {}

        def persistent_load(pid: Any) -> _Storage:
            key, dtype, numel = _storage_id(pid, 5)
            if key not in read:
                info = entries.get(f"{root}data/{key}")
                nbytes = numel * torch.empty(0, dtype=dtype).element_size()
                if info is None or info.file_size != nbytes:
                    _refuse(f"storage {key}: claims {nbytes} bytes, the archive holds {info and info.file_size}")
                budget.charge(2 * nbytes, f"a storage of {nbytes} bytes")  # the bytes read and their copy
                read[key] = _new_storage(archive.read(info), dtype)
            elif read[key].flat.dtype != dtype:
                _refuse(f"storage {key} is read as two dtypes")
            return read[key]

        info = entries[pickles[0]]
        with archive.open(info) as stream:
            globals = {**_tensor_globals(), **_STORAGE_TYPES}
            return _load(Source(stream, info.file_size), budget, limits, globals, persistent_load)


def module_tensors(record: PersistentObject | ModuleRecord, prefix: str = "") -> dict[str, torch.Tensor]:
    """The ``state_dict`` of a pickled module record: parameters and persistent buffers, names joined with dots.

    Each module is visited once; a module reached twice (shared or cyclic submodules) is refused.
    """
    seen: dict[int, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    pending: list[tuple[Any, str]] = [(record, prefix)]
    while pending:
        node, path = pending.pop()
        if not isinstance(node, PersistentObject | ModuleRecord):
            raise ValueError(f"expected a pickled torch module at {path or '<root>'!r}, got {type(node).__name__}")
        if id(node) in seen:
            raise ValueError(f"module {path!r} is the module {seen[id(node)]!r} again: shared submodules are refused")
        seen[id(node)] = path
        non_persistent = node.get("_non_persistent_buffers_set") or set()
        for group in ("_parameters", "_buffers"):
            for name, tensor in _named(node, group, path):
                if tensor is not None and name not in non_persistent:
                    if not isinstance(tensor, torch.Tensor):
                        raise ValueError(f"{path}{name} is a {type(tensor).__name__}, not a tensor")
                    tensors[path + name] = tensor.detach()
        children = [(name, child) for name, child in _named(node, "_modules", path) if child is not None]
        pending += [(child, f"{path}{name}.") for name, child in reversed(children)]
    return tensors


def _named(node: PersistentObject | ModuleRecord, group: str, path: str) -> list[tuple[str, Any]]:
    entries = node.get(group) or {}
    if not isinstance(entries, dict) or any(type(name) is not str for name in entries):
        raise ValueError(f"{path or 'the module'}: {group} must be a dict with string keys")
    return list(entries.items())
