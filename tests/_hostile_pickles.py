"""A corpus of hostile network pickles and torch checkpoints, built byte by byte.

``encode`` is a small pickler of its own: plain Python data plus :class:`Call` (``GLOBAL`` + args + ``REDUCE``),
:class:`New` (``GLOBAL`` + args + ``NEWOBJ``), an optional ``BUILD`` state on either, :class:`Ref` (a bare
``GLOBAL``) and :class:`Raw` (opcodes written as given). Lists and dicts are memoized when created and a Python
object met twice is written as a memo reference, so shared objects (DAGs) and cycles come out as they would from
``pickle``. Each entry of :func:`build_corpus` is ``name -> (path, pattern the refusal must match)``.
"""

from __future__ import annotations

import io
import pickle
import struct
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

LEGACY_MAGIC, LEGACY_PROTOCOL = 0x1950A86A20F9469CFC6C, 1001
_NOSTATE = object()


class Call:
    def __init__(self, path: str, *args: Any, state: Any = _NOSTATE) -> None:
        self.path, self.args, self.state = path, args, state


class New(Call):
    pass


class Ref:
    def __init__(self, path: str) -> None:
        self.path = path


class Raw:
    def __init__(self, data: bytes) -> None:
        self.data = data


def _global(path: str) -> bytes:
    module, name = path.rsplit(".", 1)
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def encode(obj: Any, protocol: int = 4, memo_out: dict[int, int] | None = None) -> bytes:
    """The pickle of ``obj`` (see the module docstring); ``memo_out`` receives ``id(object) -> memo index``."""
    out = io.BytesIO()
    out.write(pickle.PROTO + bytes([protocol]))
    memo: dict[int, int] = {} if memo_out is None else memo_out
    keep: list[Any] = []

    def put(o: Any) -> None:
        memo[id(o)] = len(memo)
        keep.append(o)
        out.write(pickle.LONG_BINPUT + struct.pack("<I", memo[id(o)]))

    def enc(o: Any) -> None:
        if id(o) in memo:
            out.write(pickle.LONG_BINGET + struct.pack("<I", memo[id(o)]))
        elif o is None:
            out.write(pickle.NONE)
        elif o is True or o is False:
            out.write(pickle.NEWTRUE if o else pickle.NEWFALSE)
        elif type(o) is int:
            out.write(pickle.BININT + struct.pack("<i", o) if -(2**31) <= o < 2**31 else _long(o))
        elif type(o) is float:
            out.write(pickle.BINFLOAT + struct.pack(">d", o))
        elif type(o) is str:
            data = o.encode("utf-8")
            out.write(pickle.BINUNICODE + struct.pack("<I", len(data)) + data)
        elif type(o) is bytes:
            out.write((pickle.BINBYTES + struct.pack("<I", len(o)) if len(o) < 2**32 else b"") + o)
        elif type(o) is tuple:
            out.write(pickle.MARK)
            for item in o:
                enc(item)
            out.write(pickle.TUPLE)
        elif type(o) is list:
            out.write(pickle.EMPTY_LIST)
            put(o)
            if o:
                out.write(pickle.MARK)
                for item in o:
                    enc(item)
                out.write(pickle.APPENDS)
        elif type(o) is dict:
            out.write(pickle.EMPTY_DICT)
            put(o)
            if o:
                out.write(pickle.MARK)
                for key, value in o.items():
                    enc(key)
                    enc(value)
                out.write(pickle.SETITEMS)
        elif isinstance(o, Call):
            out.write(_global(o.path))
            enc(tuple(o.args))
            out.write(pickle.NEWOBJ if isinstance(o, New) else pickle.REDUCE)
            put(o)
            if o.state is not _NOSTATE:
                enc(o.state)
                out.write(pickle.BUILD)
        elif isinstance(o, Ref):
            out.write(_global(o.path))
        elif isinstance(o, Raw):
            out.write(o.data)
        else:
            raise TypeError(type(o))

    enc(obj)
    out.write(pickle.STOP)
    return out.getvalue()


def _long(value: int) -> bytes:
    data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return pickle.LONG4 + struct.pack("<i", len(data)) + data


# ---- tensors ---------------------------------------------------------------------------------------------------
def legacy_storage(
    raw: bytes, storage_type: str = "FloatStorage", numel: int | None = None, little_endian: bool = True,
    view: Any = None, keys: list[str] | None = None,
) -> bytes:  # fmt: skip
    """The bytes ``torch.storage._load_from_bytes`` reads: a legacy ``torch.save`` of one storage."""
    itemsize = {"FloatStorage": 4, "HalfStorage": 2, "QInt8Storage": 1, "BoolStorage": 1}[storage_type]
    numel = len(raw) // itemsize if numel is None else numel
    out = io.BytesIO()
    for header in (LEGACY_MAGIC, LEGACY_PROTOCOL, {"protocol_version": 1001, "little_endian": little_endian}):
        pickle.dump(header, out, protocol=2)
    pid = ("storage", Ref(f"torch.{storage_type}"), "0", "cpu", numel, view)
    out.write(encode(Raw(encode(pid, protocol=2)[2:-1] + pickle.BINPERSID), protocol=2))
    pickle.dump(["0"] if keys is None else keys, out, protocol=2)
    out.write(struct.pack("<q", numel) + raw)
    return out.getvalue()


def storage(values: list[float] | None = None, **kwargs: Any) -> Call:
    raw = np.asarray(values if values is not None else [1.0, 2.0, 3.0, 4.0], dtype="<f4").tobytes()
    return Call("torch.storage._load_from_bytes", legacy_storage(raw, **kwargs))


def tensor(store: Any, offset: Any = 0, size: Any = (2, 2), stride: Any = (2, 1), metadata: Any = _NOSTATE) -> Call:
    args = [store, offset, size, stride, False, Call("collections.OrderedDict")]
    if metadata is not _NOSTATE:
        args.append(metadata)
    return Call("torch._utils._rebuild_tensor_v2", *args)


def persistent(class_name: str, state: dict[str, Any]) -> Call:
    meta = {"type": "class", "version": 6, "module_src": "", "class_name": class_name, "state": state}
    return Call("torch_utils.persistence._reconstruct_persistent_obj", meta)


def network(modules: dict[str, Any] | None = None, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """An official-looking ``{"ema": Precond}`` around the given modules / parameters."""
    return {"ema": persistent("Precond", {"_parameters": parameters or {}, "_buffers": {}, "_modules": modules or {}})}


def _dag(depth: int, make: Callable[[Any], Any]) -> Any:
    node: Any = []
    for _ in range(depth):
        node = make(node)
    return node


def _block(modules: dict[str, Any]) -> Call:
    return persistent("Block", {"_parameters": {}, "_modules": modules})


def _cycle() -> list:
    loop: list = []
    loop.append(loop)
    return loop


def _module_cycle() -> Raw:
    """A module whose ``_modules`` holds the module itself (set after the module is made, as ``pickle`` does)."""
    modules: dict[str, Any] = {}
    unet = persistent("UNet", {"_parameters": {}, "_buffers": {}, "_modules": modules})
    memo: dict[int, int] = {}
    body = encode(unet, memo_out=memo)[2:-1]

    def get(o: Any) -> bytes:
        return pickle.LONG_BINGET + struct.pack("<I", memo[id(o)])

    return Raw(body + get(modules) + encode("again")[2:-1] + get(unet) + pickle.SETITEM + pickle.POP)


def _raw(*parts: bytes) -> Raw:
    return Raw(b"".join(parts))


# ---- the corpus ------------------------------------------------------------------------------------------------
def network_pickles() -> dict[str, tuple[bytes, str]]:
    """``name -> (file bytes, refusal pattern)`` of hostile network pickles."""
    negate = {"__defaults__": ({"neg": True},)}
    stride0 = {"ema": tensor(storage([1.0]), size=(30000, 10000), stride=(0, 0))}
    corpus: dict[str, tuple[Any, str]] = {
        # -- mutation of allow-listed classes and functions
        "build_on_global_class": (
            _raw(_global("dnnlib.util.EasyDict"), encode((None, {"__getattr__": 1}))[2:-1], pickle.BUILD),
            "BUILD on dnnlib.util.EasyDict",
        ),
        "build_on_rebuild_function_negates": (
            _raw(_global("torch._utils._rebuild_tensor_v2"), encode((None, negate))[2:-1], pickle.BUILD),
            "BUILD on torch._utils._rebuild_tensor_v2",
        ),
        "build_on_container_class": (
            _raw(_global("torch.nn.modules.container.ModuleDict"), encode((None, {"get": 0}))[2:-1], pickle.BUILD),
            "BUILD on torch.nn.modules.container.ModuleDict",
        ),
        "build_on_ordereddict_class": (
            _raw(_global("collections.OrderedDict"), encode({"fromkeys": 0})[2:-1], pickle.BUILD),
            "BUILD on collections.OrderedDict",
        ),
        "build_on_persistence_function": (
            _raw(
                _global("torch_utils.persistence._reconstruct_persistent_obj"),
                encode((None, negate))[2:-1],
                pickle.BUILD,
            ),
            "BUILD on torch_utils.persistence",
        ),  # fmt: skip
        "build_on_storage_reader": (
            _raw(_global("torch.storage._load_from_bytes"), encode({"__code__": 0})[2:-1], pickle.BUILD),
            "BUILD on torch.storage._load_from_bytes",
        ),
        "build_on_numpy_dtype_singleton": (
            Call("numpy.dtype", "f4", False, True, state=(3, ">", None, None, None, -1, -1, 0)),
            "native-order",
        ),
        "build_on_built_tensor": (
            _raw(encode(tensor(storage()))[2:-1], encode((None, {"data": 0}))[2:-1], pickle.BUILD),
            "BUILD on Tensor",
        ),
        "build_twice_on_module_record": (
            _raw(encode(New("torch.nn.modules.container.ModuleDict", state={}))[2:-1], pickle.EMPTY_DICT, pickle.BUILD),
            "BUILD on ModuleRecord",
        ),  # fmt: skip
        "setstate_on_persistent_object": (
            _raw(encode(persistent("UNet", {}))[2:-1], pickle.EMPTY_DICT, pickle.BUILD),
            "BUILD on PersistentObject",
        ),
        "setitem_on_global_class": (
            _raw(_global("dnnlib.util.EasyDict"), encode("__getattr__")[2:-1], pickle.NONE, pickle.SETITEM),
            "SETITEM on Global",
        ),
        "append_on_global_function": (
            _raw(_global("torch._utils._rebuild_parameter"), pickle.NONE, pickle.APPEND),
            "APPEND on Global",
        ),
        "reduce_setattr": (Call("builtins.setattr", Ref("dnnlib.util.EasyDict"), "get", 0), "builtins.setattr"),
        "reduce_getattr": (Call("builtins.getattr", Ref("numpy.ndarray"), "__setstate__"), "builtins.getattr"),
        "reduce_copyreg_reconstructor": (Call("copyreg._reconstructor", Ref("builtins.object")), "copyreg"),
        "reduce_of_a_string": (_raw(encode("os.system")[2:-1], pickle.EMPTY_TUPLE, pickle.REDUCE), "REDUCE of str"),
        "newobj_of_numpy_ndarray": (New("numpy.ndarray", (10**6, 10**6)), "NEWOBJ of numpy.ndarray"),
        "reduce_of_persistence_with_exec_source": (
            Call(
                "torch_utils.persistence._reconstruct_persistent_obj",
                {"type": "class", "module_src": 1, "class_name": "UNet"},
            ),
            "module_src and class_name",
        ),
        # -- allocation bombs
        "bytearray_size": (Call("builtins.bytearray", 1_900_000_000), "builtins.bytearray"),
        "untyped_storage_size": (New("torch.storage.UntypedStorage", 10**10), "torch.storage.UntypedStorage"),
        "torch_zeros_size": (Call("torch.zeros", (10**5, 10**5)), "torch.zeros"),
        "numpy_array_shape_bomb": (
            Call(
                "numpy._core.multiarray._reconstruct",
                Ref("numpy.ndarray"),
                (0,),
                b"b",
                state=(1, (10**6, 10**6), Call("numpy.dtype", "f4", False, True), False, b"\0" * 4),
            ),
            "does not match",
        ),  # fmt: skip
        "numpy_object_dtype": (Call("numpy.dtype", "O8", False, True), "object dtype"),
        "numpy_scalar_wrong_size": (
            Call("numpy._core.multiarray.scalar", Call("numpy.dtype", "f8", False, True), b"\0"),
            "scalar",
        ),
        "legacy_storage_numel_claim": (
            {"ema": storage([1.0], numel=500_000_000)},
            "claims 500000000 elements",
        ),
        "legacy_storage_quantized": (
            {"ema": Call("torch.storage._load_from_bytes", legacy_storage(b"\0" * 4, "QInt8Storage"))},
            "QInt8Storage",
        ),
        "legacy_storage_bool": (
            {"ema": Call("torch.storage._load_from_bytes", legacy_storage(b"\2" * 4, "BoolStorage"))},
            "BoolStorage",
        ),
        "legacy_storage_big_endian": ({"ema": storage(little_endian=False)}, "little-endian"),
        "legacy_storage_view": ({"ema": storage(view=("0", 0, 1))}, "view"),
        "legacy_storage_two_keys": ({"ema": storage(keys=["0", "1"])}, "one plain storage"),
        "bytes_length_claim": (_raw(pickle.BINBYTES8, struct.pack("<Q", 2**40)), "claims 1099511627776 bytes"),
        "str_length_claim": (_raw(pickle.BINUNICODE8, struct.pack("<Q", 2**62)), "claims"),
        "huge_integer": (_raw(pickle.LONG4, struct.pack("<i", 10**6), b"\x01" * 10**6), "integer of 1000000"),
        "giant_memo_index": (
            _raw(
                pickle.NONE,
                pickle.LONG_BINPUT,
                struct.pack("<I", 2**32 - 1),
                pickle.LONG_BINGET,
                struct.pack("<I", 2**32 - 2),
            ),
            "never wrote",
        ),  # fmt: skip
        # -- tensors that are not dense views covering their storage
        "stride_zero_expand": (stride0, "does not cover exactly"),
        "stride_zero_same_numel": ({"ema": tensor(storage(), stride=(0, 1))}, "not dense"),
        "overlapping_strides": ({"ema": tensor(storage(), stride=(1, 1))}, "not dense"),
        "strides_with_gaps": ({"ema": tensor(storage([0.0] * 8), size=(2, 4), stride=(8, 1))}, "not dense"),
        "negative_stride": ({"ema": tensor(storage(), stride=(-2, 1))}, "negative"),
        "negative_storage_offset": ({"ema": tensor(storage(), offset=-3)}, "offset -3"),
        "huge_storage_offset": ({"ema": tensor(storage(), offset=2**62)}, "offset 4611686018427387904"),
        "storage_smaller_than_extent": ({"ema": tensor(storage(), size=(10,), stride=(1,))}, "does not cover"),
        "storage_larger_than_extent": ({"ema": tensor(storage(), size=(2,), stride=(1,))}, "does not cover"),
        "negated_tensor_metadata": ({"ema": tensor(storage(), metadata={"neg": True})}, "neg / conj"),
        "sparse_tensor": (Call("torch._utils._rebuild_sparse_tensor", Ref("torch.sparse_coo"), ()), "_rebuild_sparse"),
        "quantized_tensor": (Call("torch._utils._rebuild_qtensor", ()), "_rebuild_qtensor"),
        "tensor_subclass": (Call("torch._tensor._rebuild_from_type_v2", ()), "_rebuild_from_type_v2"),
        "tensor_on_fake_storage": ({"ema": tensor(b"\0" * 16)}, "storage this reader read"),
        "parameter_with_hooks": (
            Call("torch._utils._rebuild_parameter", tensor(storage()), False, {"hook": 0}),
            "backward hooks",
        ),
        # -- structure
        "deep_nesting": (_raw(pickle.EMPTY_LIST * 10_000, pickle.APPEND * 9_999), "deeper than"),
        "list_cycle": (_cycle(), "cycle"),
        "module_cycle": (_module_cycle(), "cycle"),
        "list_dag_path_explosion": (_dag(60, lambda child: [child, child]), "expands to more than"),
        "shared_module_dag_depth_60": (_dag(60, lambda child: _block({"a": child, "b": child})), "deeper than"),
        "shared_module_dag_wide": (
            _dag(8, lambda child: _block({str(i): child for i in range(16)})),
            "expands to more than",
        ),
        "tuple_dict_key": ({("a", ("b",)): 1}, "dict key"),
        "colliding_int_keys": ({k * (2**61 - 1): 0 for k in range(1, 20_000)}, "dict key"),
        "deeply_nested_persistent_id": (
            _raw(pickle.EMPTY_LIST * 5_000, pickle.APPEND * 4_999, pickle.BINPERSID),
            "persistent id list",
        ),  # fmt: skip
        "global_left_in_data": ({"ema": Ref("numpy.ndarray")}, "leaves a"),
        "storage_left_in_data": ({"ema": storage()}, "leaves a"),
        "persistent_id": (_raw(encode("x")[2:-1], pickle.BINPERSID), "persistent id"),
        "opcode_inst": (_raw(pickle.INST, b"os\nsystem\n"), "INST"),
        "opcode_obj": (_raw(pickle.MARK, _global("dnnlib.util.EasyDict"), pickle.OBJ), "OBJ"),
        "opcode_newobj_ex": (
            _raw(_global("dnnlib.util.EasyDict"), pickle.EMPTY_TUPLE, pickle.EMPTY_DICT, pickle.NEWOBJ_EX),
            "NEWOBJ_EX",
        ),
        "opcode_ext1": (_raw(pickle.EXT1, b"\x01"), "EXT1"),
        "global_name_without_newline": (_raw(pickle.GLOBAL, b"a" * 10_000), "GLOBAL name"),
    }
    return {name: (encode(obj), pattern) for name, (obj, pattern) in corpus.items()}


def _zip(data_pkl: bytes, storages: dict[str, bytes], compress: bool = False) -> bytes:
    out = io.BytesIO()
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(out, "w", method) as archive:
        archive.writestr("archive/data.pkl", data_pkl)
        archive.writestr("archive/byteorder", "little")
        for key, raw in storages.items():
            archive.writestr(f"archive/data/{key}", raw)
    return out.getvalue()


def _zip_tensor(size: tuple[int, ...], stride: tuple[int, ...], numel: int, offset: int = 0) -> Call:
    pid = ("storage", Ref("torch.FloatStorage"), "0", "cpu", numel)
    store = Raw(encode(pid)[2:-1] + pickle.BINPERSID)
    return Call("torch._utils._rebuild_tensor_v2", store, offset, size, stride, False, Call("collections.OrderedDict"))


def _saved(obj: Any) -> bytes:
    out = io.BytesIO()
    torch.save(obj, out)
    return out.getvalue()


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated: exactly why a file should not carry one
        return torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)


def checkpoint_files() -> dict[str, tuple[bytes, str]]:
    """``name -> (file bytes, refusal pattern)`` of hostile ``torch.save`` checkpoints."""
    floats = b"\0" * 16
    return {
        "zip_stride_zero": (_saved({"w": torch.zeros(1).expand(1000, 1000)}), "does not cover"),
        "zip_offset_view": (_saved({"w": torch.arange(10.0)[2:]}), "does not cover"),
        "zip_sparse": (_saved({"w": torch.eye(3).to_sparse()}), "_rebuild_sparse_tensor"),
        "zip_quantized": (_saved({"w": _quantized()}), "_rebuild_qtensor"),
        "zip_bytearray": (_zip(encode({"w": Call("builtins.bytearray", 1_900_000_000)}), {}), "builtins.bytearray"),
        "zip_storage_claims_more": (
            _zip(encode({"w": _zip_tensor((10**8,), (1,), 10**8)}), {"0": floats}),
            "claims 400000000 bytes",
        ),
        "zip_compressed_storage": (
            _zip(encode({"w": _zip_tensor((4,), (1,), 4)}), {"0": floats}, compress=True),
            "compressed",
        ),
        "zip_build_on_ordereddict_class": (
            _zip(encode(_raw(_global("collections.OrderedDict"), encode({"fromkeys": 0})[2:-1], pickle.BUILD)), {}),
            "BUILD on collections.OrderedDict",
        ),
        "zip_ordered_dict_with_args": (
            _zip(encode(Call("collections.OrderedDict", [("w", 1)])), {}),
            "takes none",
        ),
        "zip_not_a_zip": (b"PK\x03\x04" + b"\0" * 100, "not a torch.save"),
        "zip_values_not_tensors": (_saved({"w": 1, "v": [torch.zeros(2)]}), "not a state dict of named tensors"),
        "zip_pos_embed_without_tokens": (
            _saved(
                {
                    "patch_embed.proj.weight": torch.zeros(4, 3, 2, 2),
                    "pos_embed": torch.zeros(5),
                    "decoder_pred.weight": torch.zeros(12, 4),
                    "in_blocks.0.mlp.fc1.weight": torch.zeros(8, 4),
                }
            ),
            "not an official U-ViT state dict: IndexError",
        ),  # fmt: skip
    }


def build_corpus(folder: Path) -> dict[str, tuple[Path, str]]:
    """Write every hostile file into ``folder``: network pickles as ``.pkl``, checkpoints as ``.pth``."""
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for suffix, files in ((".pkl", network_pickles()), (".pth", checkpoint_files())):
        for name, (data, pattern) in files.items():
            path = folder / f"{name}{suffix}"
            path.write_bytes(data)
            written[name] = (path, pattern)
    return written
