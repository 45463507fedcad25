"""A pickle machine that builds plain data only: the opcode loop under :mod:`.safe_pickle`.

Python's ``pickle.Unpickler`` hands every ``GLOBAL`` to ``find_class`` but then applies ``BUILD`` (``__setstate__``,
``__dict__.update``, ``setattr``) and ``REDUCE`` to whatever that returned, so an allow-listed class or function can
be changed process-wide by the file that names it. :class:`SafeUnpickler` runs its own loop instead:

- a ``GLOBAL`` resolves to a :class:`Global` token of the allow-list, never to a class or function; ``REDUCE`` and
  ``NEWOBJ`` call the token's validating wrapper, and ``BUILD`` is applied only to an object a wrapper has just
  created and registered for it (once);
- ``APPEND`` / ``SETITEM`` / ``ADDITEMS`` only fill lists, dicts and sets the machine made, with keys and set
  members restricted to strings: nothing hashes or compares a nested structure while loading, and string hashes
  are salted per process, so a file cannot choose keys that all collide (as it can with ints: ``hash(k * (2**61 -
  1)) == 0``) and make filling a dict quadratic;
- every allocation is charged to a :class:`Budget` before it happens (strings and bytes by length, containers
  and stack slots by rough CPython sizes, tensors and arrays by their bytes), a length is checked against the
  bytes left in the file before it is read, integers are at most 16 bytes long, and the memo is a dict (a huge
  memo index allocates nothing);
- :func:`check_plain_tree` then walks the result once per object (iteratively, with a visited set): it refuses
  cycles, any object outside the plain types, a nesting deeper than ``max_depth`` and a result whose expansion as
  a tree (what a recursive consumer such as ``json.dumps`` walks) exceeds ``max_nodes``.

Every refusal is an :class:`UnsafePickleError`, a ``ValueError`` naming the offending construct.
"""

from __future__ import annotations

import io
import pickle
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Budget",
    "Global",
    "PickleLimits",
    "SafeUnpickler",
    "Source",
    "UnsafePickleError",
    "brief",
    "check_plain_tree",
]

#: Rough CPython sizes charged to the budget: a stack slot or small object, a list/tuple item, a dict/set entry.
SLOT_BYTES, ITEM_BYTES, ENTRY_BYTES = 32, 8, 64
MAX_INT_BYTES = 16
ATOMS = (str, bytes, int, float, bool, type(None))


class UnsafePickleError(pickle.UnpicklingError, ValueError):
    """The pickle holds a construct this reader refuses (a global off the allow-list, a bomb, a cycle, ...)."""


@dataclass(frozen=True)
class PickleLimits:
    """Bounds on what one file may make the reader build.

    ``max_bytes``: total bytes of everything built (None: 4 x the file size + 256 MiB, enough for the storage
    copies of a network pickle); ``max_depth``: nesting of the result; ``max_nodes``: size of the result expanded
    as a tree (objects shared through the pickle memo count once per path that reaches them).
    """

    max_bytes: int | None = None
    max_depth: int = 64
    max_nodes: int = 1_000_000

    def budget(self, file_size: int) -> Budget:
        return Budget(self.max_bytes if self.max_bytes is not None else 4 * file_size + (256 << 20))


class Budget:
    """Bytes the reader may still allocate; :meth:`charge` refuses before an allocation that would exceed it."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def charge(self, nbytes: int, what: str) -> None:
        self.used += nbytes
        if self.used > self.limit:
            raise UnsafePickleError(
                f"refusing {what}: the pickle would make this reader build more than {self.limit} bytes"
            )


class Source:
    """A binary stream of known length; every read is checked against the bytes left before it allocates."""

    def __init__(self, stream: io.BufferedIOBase | io.BytesIO, size: int) -> None:
        self.stream, self.left = stream, size

    def require(self, n: int) -> None:
        if not 0 <= n <= self.left:
            raise UnsafePickleError(f"the pickle claims {n} bytes where only {self.left} are left in the file")

    def read(self, n: int) -> bytes:
        self.require(n)
        data = self.stream.read(n)
        if len(data) != n:
            raise UnsafePickleError("the pickle ends early")
        self.left -= n
        return data

    def readline(self, limit: int = 256) -> bytes:
        line = self.stream.readline(limit + 1)
        self.left -= len(line)
        if not line.endswith(b"\n"):
            raise UnsafePickleError(f"a GLOBAL name longer than {limit} bytes or without its newline")
        return line[:-1]


@dataclass(frozen=True, eq=False)
class Global:
    """What a ``GLOBAL`` of the allow-list resolves to: a name, never the class or function it names.

    ``call(*args)`` serves ``REDUCE``, ``new(*args)`` serves ``NEWOBJ``; both return a fresh object. ``build(obj,
    state)`` is then the only ``BUILD`` that object accepts. ``data`` is what the token stands for when a wrapper
    reads it as an argument (a dtype, a storage type).
    """

    name: str
    call: Callable[..., Any] | None = None
    new: Callable[..., Any] | None = None
    build: Callable[[Any, Any], None] | None = None
    data: Any = None


def _long(data: bytes) -> int:
    if len(data) > MAX_INT_BYTES:
        raise UnsafePickleError(f"refusing an integer of {len(data)} bytes (at most {MAX_INT_BYTES})")
    return int.from_bytes(data, "little", signed=True)


def _key(value: Any, where: str) -> str:
    if type(value) is not str:
        raise UnsafePickleError(f"{where}: only strings are allowed, got {type(value).__name__}")
    return value


def brief(value: Any) -> str:
    """``repr`` of an atom (cut to 80 characters), else the type's name: never a walk of attacker data."""
    return repr(value)[:80] if type(value) in ATOMS else type(value).__name__


class SafeUnpickler:
    """Run the opcodes of one pickle from ``source``, resolving globals from ``globals`` (see the module doc).

    ``persistent_load(pid)`` serves ``BINPERSID`` (None: persistent ids are refused); ``dict_types`` are the dict
    types (made by this machine or a wrapper) that ``SETITEM`` may fill.
    """

    def __init__(
        self,
        source: Source,
        globals: Mapping[str, Global],
        budget: Budget,
        persistent_load: Callable[[Any], Any] | None = None,
        dict_types: tuple[type, ...] = (dict, OrderedDict),
    ) -> None:
        self.source, self.globals, self.budget, self.dict_types = source, globals, budget, dict_types
        self.persistent_load = persistent_load
        self.stack: list[Any] = []
        self.marks: list[list[Any]] = []
        self.memo: dict[int, Any] = {}
        self.buildable: dict[int, tuple[Any, Callable[[Any, Any], None]]] = {}

    # -- the loop ------------------------------------------------------------------------------------------------
    def load(self) -> Any:
        read = self.source.read
        while True:
            code = read(1)[0]
            handler = _DISPATCH.get(code)
            if handler is None:
                name = _OPCODE_NAMES.get(code, f"0x{code:02x}")
                raise UnsafePickleError(f"refusing pickle opcode {name}: this reader does not run it")
            self.budget.charge(SLOT_BYTES, "a pickle opcode")
            if code == pickle.STOP[0]:
                if len(self.stack) != 1 or self.marks:
                    raise UnsafePickleError("the pickle stops with a malformed stack")
                return self.stack.pop()
            try:
                handler(self)
            except UnsafePickleError:
                raise
            except (IndexError, KeyError, TypeError, ValueError, struct.error, OverflowError) as error:
                name = _OPCODE_NAMES.get(code, f"0x{code:02x}")
                detail = str(error)[:200]
                raise UnsafePickleError(
                    f"malformed pickle at opcode {name}: {type(error).__name__}: {detail}"
                ) from None

    def pop(self) -> Any:
        if not self.stack:
            raise UnsafePickleError("the pickle pops an empty stack")
        return self.stack.pop()

    def pop_mark(self) -> list[Any]:
        if not self.marks:
            raise UnsafePickleError("the pickle uses a MARK it never set")
        items, self.stack = self.stack, self.marks.pop()
        return items

    def push(self, value: Any) -> None:
        self.stack.append(value)

    def top(self, kinds: tuple[type, ...], opcode: str) -> Any:
        if not self.stack or type(self.stack[-1]) not in kinds:
            found = type(self.stack[-1]).__name__ if self.stack else "nothing"
            raise UnsafePickleError(f"{opcode} on {found}: this reader only fills containers it made")
        return self.stack[-1]

    # -- atoms ---------------------------------------------------------------------------------------------------
    def op_proto(self) -> None:
        if self.source.read(1)[0] > pickle.HIGHEST_PROTOCOL:
            raise UnsafePickleError("unknown pickle protocol")

    def op_frame(self) -> None:
        self.source.read(8)

    def op_const(self, value: Any) -> None:
        self.push(value)

    def op_int(self, fmt: str, size: int) -> None:
        self.push(struct.unpack(fmt, self.source.read(size))[0])

    def op_long(self, size_fmt: str, size: int) -> None:
        (length,) = struct.unpack(size_fmt, self.source.read(size))
        self.push(_long(self.source.read(length)))

    def op_binfloat(self) -> None:
        self.push(struct.unpack(">d", self.source.read(8))[0])

    def op_blob(self, size_fmt: str, size: int, kind: str) -> None:
        (length,) = struct.unpack(size_fmt, self.source.read(size))
        self.source.require(length)
        self.budget.charge(length, f"a {kind} of {length} bytes")
        data = self.source.read(length)
        if kind == "str":
            self.push(data.decode("utf-8", "surrogatepass"))
        elif kind == "ascii":
            self.push(data.decode("ascii"))
        else:
            self.push(data)

    # -- containers ----------------------------------------------------------------------------------------------
    def op_mark(self) -> None:
        self.budget.charge(ENTRY_BYTES, "a MARK")
        self.marks.append(self.stack)
        self.stack = []

    def op_pop(self) -> None:
        self.pop()

    def op_pop_mark(self) -> None:
        self.pop_mark()

    def op_dup(self) -> None:
        self.push(self.stack[-1])

    def op_empty(self, factory: Callable[[], Any]) -> None:
        self.budget.charge(ENTRY_BYTES, "a container")
        self.push(factory())

    def op_tuple(self, count: int | None) -> None:
        if count is None:
            items = self.pop_mark()
        else:
            if len(self.stack) < count:
                raise UnsafePickleError("the pickle builds a tuple from an empty stack")
            items = self.stack[len(self.stack) - count :]
            del self.stack[len(self.stack) - count :]
        self.budget.charge(ENTRY_BYTES + ITEM_BYTES * len(items), "a tuple")
        self.push(tuple(items))

    def op_list(self) -> None:
        items = self.pop_mark()
        self.budget.charge(ENTRY_BYTES + ITEM_BYTES * len(items), "a list")
        self.push(items)

    def op_append(self) -> None:
        item = self.pop()
        self.budget.charge(ITEM_BYTES, "a list item")
        self.top((list,), "APPEND").append(item)

    def op_appends(self) -> None:
        items = self.pop_mark()
        self.budget.charge(ITEM_BYTES * len(items), "list items")
        self.top((list,), "APPENDS").extend(items)

    def _set_items(self, target: dict, items: list[Any]) -> None:
        if len(items) % 2:
            raise UnsafePickleError("SETITEMS with an odd number of items")
        self.budget.charge(ENTRY_BYTES * (len(items) // 2), "dict entries")
        for i in range(0, len(items), 2):
            target[_key(items[i], "dict key")] = items[i + 1]

    def op_dict(self) -> None:
        items = self.pop_mark()
        target: dict = {}
        self._set_items(target, items)
        self.push(target)

    def op_setitem(self) -> None:
        value, key = self.pop(), self.pop()
        self._set_items(self.top(self.dict_types, "SETITEM"), [key, value])

    def op_setitems(self) -> None:
        items = self.pop_mark()
        self._set_items(self.top(self.dict_types, "SETITEMS"), items)

    def op_additems(self) -> None:
        items = self.pop_mark()
        self.budget.charge(ENTRY_BYTES * len(items), "set items")
        self.top((set,), "ADDITEMS").update(_key(item, "set member") for item in items)

    def op_frozenset(self) -> None:
        items = self.pop_mark()
        self.budget.charge(ENTRY_BYTES * (1 + len(items)), "a frozenset")
        self.push(frozenset(_key(item, "frozenset member") for item in items))

    # -- memo ----------------------------------------------------------------------------------------------------
    def op_get(self, fmt: str, size: int) -> None:
        (index,) = struct.unpack(fmt, self.source.read(size))
        if index not in self.memo:
            raise UnsafePickleError(f"the pickle reads memo entry {index}, which it never wrote")
        self.push(self.memo[index])

    def _put(self, index: int) -> None:
        if not self.stack:
            raise UnsafePickleError("the pickle memoizes an empty stack")
        self.budget.charge(ENTRY_BYTES, "a memo entry")
        self.memo[index] = self.stack[-1]

    def op_put(self, fmt: str, size: int) -> None:
        self._put(struct.unpack(fmt, self.source.read(size))[0])

    def op_memoize(self) -> None:
        self._put(len(self.memo))

    # -- globals and objects -------------------------------------------------------------------------------------
    def _resolve(self, module: str, name: str) -> None:
        path = f"{module}.{name}"
        token = self.globals.get(path)
        if token is None:
            raise UnsafePickleError(
                f"refusing to load global {path!r}: it is not on the allow-list of this reader (the file is not "
                "a network pickle or checkpoint, or it carries code)"
            )
        self.push(token)

    def op_global(self) -> None:
        module = self.source.readline().decode("utf-8")
        self._resolve(module, self.source.readline().decode("utf-8"))

    def op_stack_global(self) -> None:
        name, module = self.pop(), self.pop()
        if type(module) is not str or type(name) is not str:
            raise UnsafePickleError("STACK_GLOBAL needs two strings")
        self._resolve(module, name)

    def _made(self, token: Global, value: Any) -> Any:
        if token.build is not None:
            self.buildable[id(value)] = (value, token.build)
        return value

    def op_reduce(self) -> None:
        args, token = self.pop(), self.pop()
        if type(token) is not Global or token.call is None or type(args) is not tuple:
            raise UnsafePickleError(f"refusing REDUCE of {_describe(token)}: only allow-listed constructors run")
        self.push(self._made(token, token.call(*args)))

    def op_newobj(self) -> None:
        args, token = self.pop(), self.pop()
        if type(token) is not Global or token.new is None or type(args) is not tuple:
            raise UnsafePickleError(f"refusing NEWOBJ of {_describe(token)}: only allow-listed classes are made")
        self.push(self._made(token, token.new(*args)))

    def op_build(self) -> None:
        state = self.pop()
        target = self.stack[-1] if self.stack else None
        entry = self.buildable.pop(id(target), None)
        if entry is None or entry[0] is not target:
            raise UnsafePickleError(
                f"refusing BUILD on {_describe(target)}: this reader sets state only on an object it has just made"
            )
        entry[1](target, state)

    def op_binpersid(self) -> None:
        pid = self.pop()
        if self.persistent_load is None:
            raise UnsafePickleError(f"refusing persistent id {brief(pid)}: plain network pickles carry none")
        self.push(self.persistent_load(pid))


def _describe(value: Any) -> str:
    if type(value) is Global:
        return value.name
    return type(value).__name__


def _dispatch() -> dict[int, Callable[[SafeUnpickler], None]]:
    P, U = pickle, SafeUnpickler
    table: dict[bytes, Callable[[SafeUnpickler], None]] = {
        P.PROTO: U.op_proto,
        P.FRAME: U.op_frame,
        P.STOP: lambda self: None,
        P.NONE: lambda self: self.op_const(None),
        P.NEWTRUE: lambda self: self.op_const(True),
        P.NEWFALSE: lambda self: self.op_const(False),
        P.BININT: lambda self: self.op_int("<i", 4),
        P.BININT1: lambda self: self.op_int("<B", 1),
        P.BININT2: lambda self: self.op_int("<H", 2),
        P.LONG1: lambda self: self.op_long("<B", 1),
        P.LONG4: lambda self: self.op_long("<i", 4),
        P.BINFLOAT: U.op_binfloat,
        P.SHORT_BINUNICODE: lambda self: self.op_blob("<B", 1, "str"),
        P.BINUNICODE: lambda self: self.op_blob("<I", 4, "str"),
        P.BINUNICODE8: lambda self: self.op_blob("<Q", 8, "str"),
        P.SHORT_BINBYTES: lambda self: self.op_blob("<B", 1, "bytes"),
        P.BINBYTES: lambda self: self.op_blob("<I", 4, "bytes"),
        P.BINBYTES8: lambda self: self.op_blob("<Q", 8, "bytes"),
        P.SHORT_BINSTRING: lambda self: self.op_blob("<B", 1, "ascii"),
        P.BINSTRING: lambda self: self.op_blob("<i", 4, "ascii"),
        P.MARK: U.op_mark,
        P.POP: U.op_pop,
        P.POP_MARK: U.op_pop_mark,
        P.DUP: U.op_dup,
        P.EMPTY_LIST: lambda self: self.op_empty(list),
        P.EMPTY_DICT: lambda self: self.op_empty(dict),
        P.EMPTY_SET: lambda self: self.op_empty(set),
        P.EMPTY_TUPLE: lambda self: self.op_const(()),
        P.TUPLE: lambda self: self.op_tuple(None),
        P.TUPLE1: lambda self: self.op_tuple(1),
        P.TUPLE2: lambda self: self.op_tuple(2),
        P.TUPLE3: lambda self: self.op_tuple(3),
        P.LIST: U.op_list,
        P.APPEND: U.op_append,
        P.APPENDS: U.op_appends,
        P.DICT: U.op_dict,
        P.SETITEM: U.op_setitem,
        P.SETITEMS: U.op_setitems,
        P.ADDITEMS: U.op_additems,
        P.FROZENSET: U.op_frozenset,
        P.BINGET: lambda self: self.op_get("<B", 1),
        P.LONG_BINGET: lambda self: self.op_get("<I", 4),
        P.BINPUT: lambda self: self.op_put("<B", 1),
        P.LONG_BINPUT: lambda self: self.op_put("<I", 4),
        P.MEMOIZE: U.op_memoize,
        P.GLOBAL: U.op_global,
        P.STACK_GLOBAL: U.op_stack_global,
        P.REDUCE: U.op_reduce,
        P.NEWOBJ: U.op_newobj,
        P.BUILD: U.op_build,
        P.BINPERSID: U.op_binpersid,
    }
    return {opcode[0]: handler for opcode, handler in table.items()}


_DISPATCH = _dispatch()
_OPCODE_NAMES = {
    getattr(pickle, name)[0]: name
    for name in dir(pickle)
    if name.isupper() and isinstance(getattr(pickle, name), bytes) and len(getattr(pickle, name)) == 1
}


def check_plain_tree(
    root: Any, limits: PickleLimits, containers: Mapping[type, Callable[[Any], Iterable[Any]]], leaves: tuple[type, ...]
) -> None:
    """Refuse cycles, types outside ``containers`` / ``leaves`` (exact types), nesting deeper than
    ``limits.max_depth`` and a tree expansion above ``limits.max_nodes``; each object is visited once.

    ``containers`` maps a type to its children. Depth and tree size follow ``d(x) = 1 + max d(child)``,
    ``n(x) = 1 + sum n(child)``, computed in post-order with an explicit stack.
    """
    depth: dict[int, int] = {}
    nodes: dict[int, int] = {}
    on_path: set[int] = set()
    keep: list[Any] = []  # holds every visited object so that no id is reused during the walk
    stack: list[tuple[Any, list[Any] | None]] = [(root, None)]
    while stack:
        obj, children = stack[-1]
        key = id(obj)
        if children is None:
            if key in depth:
                stack.pop()
                continue
            kind = type(obj)
            if kind in leaves:
                depth[key], nodes[key] = 1, 1
                keep.append(obj)
                stack.pop()
                continue
            if kind not in containers:
                raise UnsafePickleError(f"the pickle leaves a {kind.__module__}.{kind.__qualname__} in its data")
            if len(on_path) >= limits.max_depth:
                raise UnsafePickleError(f"the pickle nests deeper than {limits.max_depth} levels")
            children = list(containers[kind](obj))
            stack[-1] = (obj, children)
            on_path.add(key)
            keep.append(obj)
            for child in children:
                if id(child) in on_path:
                    raise UnsafePickleError(f"the pickle holds a reference cycle through a {kind.__name__}")
                if id(child) not in depth:
                    stack.append((child, None))
            continue
        stack.pop()
        on_path.discard(key)
        depth[key] = 1 + max((depth[id(c)] for c in children), default=0)
        nodes[key] = min(1 + sum(nodes[id(c)] for c in children), limits.max_nodes + 1)
        if depth[key] > limits.max_depth:
            raise UnsafePickleError(f"the pickle nests deeper than {limits.max_depth} levels")
        if nodes[key] > limits.max_nodes:
            raise UnsafePickleError(
                f"the pickle's data expands to more than {limits.max_nodes} nodes when walked as a tree "
                "(objects shared many times over)"
            )
