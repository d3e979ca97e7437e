"""Reading a DCP ``.metadata`` pickle without running code from it.

``dcp.save`` writes its metadata with :mod:`pickle`, and unpickling runs whatever the file names:
even an allow-list unpickler lets a crafted file ``BUILD`` on an allowed *class* (changing it for
the whole process) or call an allowed constructor with anything. :func:`read_metadata` does not
unpickle: a small opcode reader walks the pickle and builds only inert records (a global is a
name, a call is a record of its name and arguments, ``BUILD`` fills a record made in this file and
nothing else); then the records DCP writes -- ``Metadata``, ``TensorStorageMetadata``,
``TensorProperties``, ``ChunkStorageMetadata``, ``BytesStorageMetadata``, ``MetadataIndex``,
``StorageMeta``, ``_StorageInfo``, ``torch.Size``, dtypes, layouts, paths and plain builtins --
are turned into torch's own classes by calling their constructors with checked fields. Any other
opcode or name is refused, naming it.

Bounds: the file is at most :data:`MAX_METADATA_BYTES` (checked with ``stat`` before reading, a
regular file opened non-blocking); every loop and allocation is bounded by the file's size (each
opcode makes at most one object; memo indices and marks are checked against what exists);
records nest at most :data:`MAX_DEPTH` deep and may not contain themselves.

``trust=True`` is the old, unrestricted ``pickle.load``, for a checkpoint one trusts that holds
something else.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import stat
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import torch

from trainsnap.errors import CorruptError, IncompatibleError

MAX_METADATA_BYTES: Final = 1 << 30
"""Largest ``.metadata`` read (a model of 10^5 tensors in 10^3 chunks each writes ~100 MiB)."""
MAX_DEPTH: Final = 100
"""Deepest nesting of records and containers converted (DCP's own is about 6)."""
_DCP: Final = "torch.distributed.checkpoint.metadata"
_FS: Final = "torch.distributed.checkpoint.filesystem"
_CLASSES: Final = {
    (_DCP, n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    (_FS, "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *(("builtins", n) for n in ("set", "frozenset", "tuple", "list", "dict")),
    *(("pathlib", n) for n in ("Path", "PosixPath", "PurePosixPath", "WindowsPath")),
    ("pathlib", "PureWindowsPath"),
}


class _Refused(Exception):
    """The pickle does something the reader refuses (an opcode, a name, a shape)."""


class _Malformed(Exception):
    """The pickle is not well formed (truncated, a bad mark or memo index)."""


@dataclass(eq=False, slots=True)
class _Global:
    module: str
    name: str


@dataclass(eq=False, slots=True)
class _Record:
    """A call the pickle asks for (``REDUCE``/``NEWOBJ``), recorded, never made."""

    cls: _Global
    args: tuple[Any, ...]
    state: Any = None
    built: bool = False


@dataclass(eq=False, slots=True)
class _Dict:
    pairs: list[tuple[Any, Any]] = field(default_factory=list)
    ordered: bool = False


@dataclass(eq=False, slots=True)
class _Set:
    items: list[Any] = field(default_factory=list)
    frozen: bool = False


class _Mark:
    pass


_MARK: Final = _Mark()


# -- the opcode reader ----------------------------------------------------------------------------


class _Reader:
    """One pass over the pickle; every opcode costs O(its own bytes), except the mark-taking
    ones, which consume what they pop."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise _Malformed(f"truncated at byte {self.pos}")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.take(size))[0]

    def pop(self) -> Any:
        if not self.stack or (self.marks and len(self.stack) <= self.marks[-1]):
            raise _Malformed("an opcode pops from an empty stack")
        return self.stack.pop()

    def pop_mark(self) -> list[Any]:
        if not self.marks:
            raise _Malformed("an opcode needs a mark and there is none")
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        return items

    def text(self, n: int) -> str:
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Malformed(f"a string that is not UTF-8 ({e})") from None

    def run(self) -> Any:
        while True:
            op = self.take(1)
            if op == pickle.STOP:
                if len(self.stack) != 1 or self.marks:
                    raise _Malformed("STOP with other than one object on the stack")
                return self.stack[0]
            handler = _OPS.get(op)
            if handler is None:
                raise _Refused(f"pickle opcode {op!r}")
            handler(self)

    # -- opcodes -------------------------------------------------------------------------------

    def proto(self) -> None:
        if self.unpack("<B") > 5:
            raise _Refused("a pickle protocol newer than 5")

    def frame(self) -> None:
        self.unpack("<Q")  # frames only batch reads: the bytes follow in place

    def push(self, value: Any) -> None:
        self.stack.append(value)

    def mark(self) -> None:
        self.marks.append(len(self.stack))

    def memoize(self) -> None:
        if not self.stack:
            raise _Malformed("MEMOIZE with an empty stack")
        self.memo[len(self.memo)] = self.stack[-1]

    def put(self, index: int) -> None:
        if not self.stack:
            raise _Malformed("PUT with an empty stack")
        self.memo[index] = self.stack[-1]

    def get(self, index: int) -> None:
        if index not in self.memo:
            raise _Malformed(f"memo index {index} was never stored")
        self.stack.append(self.memo[index])

    def long(self, n: int) -> None:
        if n > 1024:
            raise _Refused(f"an integer of {n} bytes")
        self.push(int.from_bytes(self.take(n), "little", signed=True))

    def global_(self, module: str, name: str) -> None:
        if (module, name) not in _CLASSES and not (module == "torch" and _torch_constant(name)):
            raise _Refused(f"{module}.{name}")
        self.push(_Global(module, name))

    def stack_global(self) -> None:
        name, module = self.pop(), self.pop()
        if not isinstance(module, str) or not isinstance(name, str):
            raise _Malformed("STACK_GLOBAL of something other than two strings")
        self.global_(module, name)

    def line_global(self) -> None:
        module = self.line()
        self.global_(module, self.line())

    def line(self) -> str:
        end = self.data.find(b"\n", self.pos, self.pos + 1024)
        if end < 0:
            raise _Malformed("a GLOBAL name longer than 1024 bytes or unterminated")
        return self.text(end - self.pos + 1)[:-1]

    def call(self) -> None:
        args, target = self.pop(), self.pop()
        if not isinstance(target, _Global) or not isinstance(args, tuple):
            raise _Refused(f"a call of {type(target).__name__} (only allow-listed names)")
        if (target.module, target.name) == ("collections", "OrderedDict") and not args:
            self.push(_Dict(ordered=True))  # filled by SETITEMS like a dict
            return
        self.push(_Record(target, args))

    def build(self) -> None:
        state, target = self.pop(), self.pop()
        if not isinstance(target, _Record) or target.built:
            what = "a class" if isinstance(target, _Global) else type(target).__name__
            raise _Refused(f"BUILD on {what} (only on a record this pickle made, once)")
        target.state, target.built = state, True
        self.push(target)

    def setitems(self, pairs: list[Any]) -> None:
        if len(pairs) % 2:
            raise _Malformed("SETITEMS with an odd number of items")
        target = self.pop()
        if not isinstance(target, _Dict):
            raise _Refused(f"SETITEM on {type(target).__name__}")
        target.pairs.extend(zip(pairs[::2], pairs[1::2], strict=True))
        self.push(target)

    def appends(self, items: list[Any]) -> None:
        target = self.pop()
        if not isinstance(target, list):
            raise _Refused(f"APPEND on {type(target).__name__}")
        target.extend(items)
        self.push(target)

    def additems(self, items: list[Any]) -> None:
        target = self.pop()
        if not isinstance(target, _Set) or target.frozen:
            raise _Refused(f"ADDITEMS on {type(target).__name__}")
        target.items.extend(items)
        self.push(target)


def _torch_constant(name: str) -> bool:
    value = getattr(torch, name, None) if name.isidentifier() else None
    return isinstance(value, torch.dtype | torch.layout | torch.memory_format)


def _tuple_of(n: int) -> Any:
    def op(r: _Reader) -> None:
        items = [r.pop() for _ in range(n)][::-1]
        r.push(tuple(items))

    return op


_OPS: Final[dict[bytes, Any]] = {
    pickle.PROTO: _Reader.proto,
    pickle.FRAME: _Reader.frame,
    pickle.MARK: _Reader.mark,
    pickle.POP: lambda r: r.pop(),
    pickle.POP_MARK: lambda r: r.pop_mark(),
    pickle.DUP: lambda r: r.push(r.stack[-1]) if r.stack else r.pop(),
    pickle.NONE: lambda r: r.push(None),
    pickle.NEWTRUE: lambda r: r.push(True),
    pickle.NEWFALSE: lambda r: r.push(False),
    pickle.BININT: lambda r: r.push(r.unpack("<i")),
    pickle.BININT1: lambda r: r.push(r.unpack("<B")),
    pickle.BININT2: lambda r: r.push(r.unpack("<H")),
    pickle.LONG1: lambda r: r.long(r.unpack("<B")),
    pickle.LONG4: lambda r: r.long(r.unpack("<i")),
    pickle.BINFLOAT: lambda r: r.push(r.unpack(">d")),
    pickle.SHORT_BINUNICODE: lambda r: r.push(r.text(r.unpack("<B"))),
    pickle.BINUNICODE: lambda r: r.push(r.text(r.unpack("<I"))),
    pickle.BINUNICODE8: lambda r: r.push(r.text(r.unpack("<Q"))),
    pickle.SHORT_BINBYTES: lambda r: r.push(r.take(r.unpack("<B"))),
    pickle.BINBYTES: lambda r: r.push(r.take(r.unpack("<I"))),
    pickle.BINBYTES8: lambda r: r.push(r.take(r.unpack("<Q"))),
    pickle.EMPTY_TUPLE: lambda r: r.push(()),
    pickle.TUPLE1: _tuple_of(1),
    pickle.TUPLE2: _tuple_of(2),
    pickle.TUPLE3: _tuple_of(3),
    pickle.TUPLE: lambda r: r.push(tuple(r.pop_mark())),
    pickle.EMPTY_LIST: lambda r: r.push([]),
    pickle.LIST: lambda r: r.push(r.pop_mark()),
    pickle.APPEND: lambda r: r.appends([r.pop()]),
    pickle.APPENDS: lambda r: r.appends(r.pop_mark()),
    pickle.EMPTY_DICT: lambda r: r.push(_Dict()),
    pickle.SETITEM: lambda r: r.setitems([*reversed([r.pop(), r.pop()])]),
    pickle.SETITEMS: lambda r: r.setitems(r.pop_mark()),
    pickle.EMPTY_SET: lambda r: r.push(_Set()),
    pickle.ADDITEMS: lambda r: r.additems(r.pop_mark()),
    pickle.FROZENSET: lambda r: r.push(_Set(r.pop_mark(), frozen=True)),
    pickle.MEMOIZE: _Reader.memoize,
    pickle.BINPUT: lambda r: r.put(r.unpack("<B")),
    pickle.LONG_BINPUT: lambda r: r.put(r.unpack("<I")),
    pickle.BINGET: lambda r: r.get(r.unpack("<B")),
    pickle.LONG_BINGET: lambda r: r.get(r.unpack("<I")),
    pickle.GLOBAL: _Reader.line_global,
    pickle.STACK_GLOBAL: _Reader.stack_global,
    pickle.REDUCE: _Reader.call,
    pickle.NEWOBJ: _Reader.call,
    pickle.BUILD: _Reader.build,
}


# -- records to torch's classes -------------------------------------------------------------------


class _Converter:
    """Inert records to torch's DCP classes, each built once (shared records stay shared), with
    nesting bounded and cycles refused."""

    def __init__(self) -> None:
        self.done: dict[int, Any] = {}
        self.active: set[int] = set()
        from torch.distributed.checkpoint import filesystem, metadata

        self.md, self.fs = metadata, filesystem

    def value(self, obj: Any, depth: int = 0) -> Any:
        if obj is None or isinstance(obj, bool | int | float | str | bytes):
            return obj
        if depth > MAX_DEPTH:
            raise _Refused(f"records nested deeper than {MAX_DEPTH}")
        key = id(obj)
        if key in self.done:
            return self.done[key]
        if key in self.active:
            raise _Refused("a record that contains itself")
        self.active.add(key)
        try:
            out = self._convert(obj, depth + 1)
        finally:
            self.active.discard(key)
        self.done[key] = out
        return out

    def _convert(self, obj: Any, depth: int) -> Any:
        if isinstance(obj, tuple):
            return tuple(self.value(x, depth) for x in obj)
        if isinstance(obj, list):
            return [self.value(x, depth) for x in obj]
        if isinstance(obj, _Dict):
            out = OrderedDict() if obj.ordered else {}
            for k, v in obj.pairs:
                out[_hashable(self.value(k, depth))] = self.value(v, depth)
            return out
        if isinstance(obj, _Set):
            items = [_hashable(self.value(x, depth)) for x in obj.items]
            return frozenset(items) if obj.frozen else set(items)
        if isinstance(obj, _Global):
            if obj.module == "torch" and _torch_constant(obj.name):
                return getattr(torch, obj.name)
            raise _Refused(f"{obj.module}.{obj.name} used as a value")
        if isinstance(obj, _Record):
            return self._record(obj, depth)
        raise _Refused(f"a {type(obj).__name__}")

    def _record(self, rec: _Record, depth: int) -> Any:
        module, name = rec.cls.module, rec.cls.name
        args = [self.value(a, depth) for a in rec.args]
        if module in (_DCP, _FS) and name != "_MEM_FORMAT_ENCODING":
            if args:
                raise _Refused(f"{name} made with arguments")
            return self._dataclass(name, self.value(rec.state, depth))
        if rec.built:
            raise _Refused(f"BUILD on {module}.{name}")
        return _call(module, name, args)

    def _dataclass(self, name: str, state: Any) -> Any:
        if name == "TensorProperties":
            fields = _properties(state)
            return self.md.TensorProperties(**fields)
        if name == "BytesStorageMetadata":
            return self.md.BytesStorageMetadata()
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise _Refused(f"{name} with a state that is not a dict of fields")
        cls = self.fs._StorageInfo if name == "_StorageInfo" else getattr(self.md, name)
        check = _FIELDS[name]
        kept = {}
        for k, v in state.items():
            if k in check:  # fields a newer torch adds are left out, not trusted
                kept[k] = check[k](v, f"{name}.{k}")
        try:
            return cls(**kept)
        except (TypeError, ValueError) as e:  # a required field missing
            raise _Refused(f"{name} without the fields it needs ({e})") from None


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        raise _Refused(f"an unhashable {type(value).__name__} as a key") from None
    return value


def _call(module: str, name: str, args: list[Any]) -> Any:
    """The few calls DCP's pickle makes, made here with checked arguments."""
    if (module, name) == ("torch", "Size"):
        if len(args) == 1 and isinstance(args[0], tuple | list):
            return torch.Size(_ints(args[0], "torch.Size"))
    elif (module, name) == ("torch.serialization", "_get_layout"):
        if len(args) == 1 and isinstance(args[0], str) and args[0].startswith("torch."):
            layout = getattr(torch, args[0][6:], None) if args[0][6:].isidentifier() else None
            if isinstance(layout, torch.layout):
                return layout
    elif (module, name) == (_DCP, "_MEM_FORMAT_ENCODING"):
        from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

        if len(args) == 1 and type(args[0]) is int:
            try:
                return _MEM_FORMAT_ENCODING(args[0])
            except ValueError:
                pass
    elif module == "pathlib":
        if all(isinstance(a, str) for a in args) and len(args) <= 256:
            pure = pathlib.PureWindowsPath if "Windows" in name else pathlib.PurePosixPath
            return pure(*args)
    elif module == "builtins" or (module, name) == ("collections", "OrderedDict"):
        if not args:
            return {"set": set, "frozenset": frozenset, "tuple": tuple, "list": list}.get(
                name, OrderedDict if name == "OrderedDict" else dict
            )()
        if len(args) == 1 and isinstance(args[0], list | tuple | set | frozenset):
            items = list(args[0])
            if name in ("set", "frozenset"):
                items = [_hashable(x) for x in items]
            builder = {"set": set, "frozenset": frozenset, "tuple": tuple, "list": list}.get(name)
            if builder is not None:
                return builder(items)
    raise _Refused(f"{module}.{name} called with {len(args)} argument(s) it does not take")


def _ints(values: Any, what: str, *, low: int = 0) -> list[int]:
    if not isinstance(values, tuple | list) or len(values) > 64:
        raise _Refused(f"{what}: expected at most 64 integers")
    for v in values:
        if type(v) is not int or not low <= v < 1 << 62:
            raise _Refused(f"{what}: {str(v)[:40]} is not an integer in [{low}, 2^62)")
    return list(values)


def _size(value: Any, what: str) -> torch.Size:
    if not isinstance(value, torch.Size):
        value = torch.Size(_ints(value, what))
    return torch.Size(_ints(tuple(value), what))


def _typed(kind: type | tuple[type, ...], optional: bool = False) -> Any:
    def check(value: Any, what: str) -> Any:
        if (optional and value is None) or (isinstance(value, kind) and type(value) is not bool):
            return value
        raise _Refused(f"{what}: a {type(value).__name__}")

    return check


def _offset(value: Any, what: str) -> int:
    if type(value) is not int or not 0 <= value < 1 << 62:
        raise _Refused(f"{what}: {str(value)[:40]} is not an integer in [0, 2^62)")
    return value


def _list_of(kind: type) -> Any:
    def check(value: Any, what: str) -> Any:
        if not isinstance(value, list) or not all(isinstance(x, kind) for x in value):
            raise _Refused(f"{what}: expected a list of {kind.__name__}")
        return value

    return check


def _properties(state: Any) -> dict[str, Any]:
    """TensorProperties' state: (dtype, layout, requires_grad, memory format code, pin_memory)."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    if not isinstance(state, tuple) or len(state) != 5:
        raise _Refused("TensorProperties with a state other than its five fields")
    dtype, layout, requires_grad, encoding, pin = state
    formats = {
        _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
        _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST: torch.channels_last,
        _MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT: torch.preserve_format,
    }
    if (
        not isinstance(dtype, torch.dtype)
        or not isinstance(layout, torch.layout)
        or type(requires_grad) is not bool
        or type(pin) is not bool
        or encoding not in formats
    ):
        raise _Refused("TensorProperties with fields of the wrong types")
    return {
        "dtype": dtype,
        "layout": layout,
        "requires_grad": requires_grad,
        "memory_format": formats[encoding],
        "pin_memory": pin,
    }


def _any(value: Any, what: str) -> Any:
    return value


_FIELDS: Final[dict[str, dict[str, Any]]] = {
    "Metadata": {
        "state_dict_metadata": _typed(dict),
        "planner_data": _any,
        "storage_data": _typed(dict, optional=True),
        "storage_meta": _any,
        "version": _typed(str, optional=True),
    },
    "TensorStorageMetadata": {"properties": _any, "size": _size, "chunks": _any},
    "ChunkStorageMetadata": {"offsets": _size, "sizes": _size},
    "MetadataIndex": {
        "fqn": _typed(str),
        "offset": lambda v, w: None if v is None else _size(v, w),
        "index": _typed(int, optional=True),
    },
    "StorageMeta": {
        "checkpoint_id": _typed((str, pathlib.PurePath), optional=True),
        "save_id": _typed(str, optional=True),
        "load_id": _typed(str, optional=True),
        "modules": _list_of(str),
    },
    "_StorageInfo": {
        "relative_path": _typed(str),
        "offset": _offset,
        "length": _offset,
        "transform_descriptors": lambda v, w: None if v is None else _list_of(str)(list(v), w),
    },
}


def _check_shape(metadata: Any) -> Any:
    """The classes DCP's readers rely on, where they rely on them."""
    md = torch.distributed.checkpoint.metadata
    if not isinstance(metadata, md.Metadata):
        raise _Refused(f"the pickle holds a {type(metadata).__name__}, not DCP Metadata")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(key, str):
            raise _Refused("a state_dict_metadata key that is not a string")
        if isinstance(entry, md.TensorStorageMetadata):
            if not isinstance(entry.properties, md.TensorProperties) or not all(
                isinstance(c, md.ChunkStorageMetadata) for c in entry.chunks
            ):
                raise _Refused(f"tensor {key!r} with malformed properties or chunks")
        elif not isinstance(entry, md.BytesStorageMetadata):
            raise _Refused(f"entry {key!r} is a {type(entry).__name__}")
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, md.StorageMeta):
        raise _Refused("storage_meta is not a StorageMeta")
    return metadata


# -- reading the file -----------------------------------------------------------------------------


def read_capped(path: Path, cap: int) -> bytes:
    """The bytes of the regular file at ``path``, refused (:class:`CorruptError`) when it is
    larger than ``cap`` (checked with ``fstat`` before reading), not a regular file, or grows
    while read. Opened non-blocking, so that a FIFO planted there cannot block the reader."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CorruptError(f"{path}: cannot be opened ({e.strerror})", path=str(path)) from e
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CorruptError(f"{path} is not a regular file", path=str(path))
        if info.st_size > cap:
            raise CorruptError(
                f"{path} is {info.st_size} bytes, more than such a file may be ({cap})",
                path=str(path),
            )
        chunks, total = [], 0
        while total <= info.st_size:
            chunk = os.read(fd, min(1 << 24, info.st_size + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total != info.st_size:
            raise CorruptError(f"{path} changed while it was read", path=str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


def decode_metadata(data: bytes, where: str = ".metadata") -> Any:
    """DCP ``Metadata`` from the bytes of a ``.metadata`` file, without unpickling them:
    :class:`IncompatibleError` for anything outside what DCP writes, :class:`CorruptError`
    for a malformed pickle. O(len(data)) time and memory."""
    try:
        return _check_shape(_Converter().value(_Reader(data).run()))
    except _Refused as e:
        raise IncompatibleError(
            f"{where} holds {e}, which is not part of torch's DCP metadata: reading it would "
            "run code from the checkpoint or is not what dcp.save writes. If you trust this "
            "checkpoint, import it with --trust-pickle (import_dcp(..., trust_pickle=True))",
            path=where,
        ) from None
    except _Malformed as e:
        raise CorruptError(f"{where} is not a readable pickle: {e}", path=where) from None


def read_metadata(path: Path, *, trust: bool = False) -> Any:
    """The ``Metadata`` object in the DCP ``.metadata`` file at ``path`` (see the module)."""
    data = read_capped(path, MAX_METADATA_BYTES)
    if not trust:
        return decode_metadata(data, str(path))
    try:
        return pickle.loads(data)
    except Exception as e:
        raise CorruptError(f"{path}: not a readable pickle ({e})", path=str(path)) from e


def safe_reader(path: str | os.PathLike[str]) -> Any:
    """A DCP ``FileSystemReader`` for ``path`` whose metadata is read by :func:`read_metadata`
    (no unpickling); its tensor items are read by torch as usual (``torch.load`` with
    ``weights_only=True``)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeReader(path)


def safe_planner() -> Any:
    """A DCP load planner whose non-tensor items are read by torch's restricted loader
    (``torch.load(..., weights_only=True)``: plain containers, numbers, strings, tensors) where
    torch's default planner unpickles them with ``weights_only=False``. An item that loader
    refuses is an :class:`IncompatibleError` naming it."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class _SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except Exception as e:  # whatever the restricted loader refuses
                raise IncompatibleError(
                    f"DCP item {fqn!r} is not plain data torch's restricted loader reads "
                    f"({type(e).__name__}); load that checkpoint with torch's own dcp.load "
                    "only if you trust it",
                    key=fqn,
                ) from e
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return _SafePlanner()
