"""An opcode reader for the pickles ``dcp.save`` writes, which builds inert records and never
runs anything: a global is a :class:`Global` (a name, refused unless in :data:`ALLOWED_NAMES` or
a torch dtype, layout or memory format), a call is a :class:`Record` of its name and arguments,
``BUILD`` fills a record made by this pickle and nothing else. Any other opcode or name is
:class:`Refused`, naming it; a truncated or inconsistent pickle is :class:`Malformed`.

Every opcode makes at most one object and costs O(its own bytes), except the mark-taking ones,
which consume what they pop: :func:`read_pickle` is O(len(data)) in time and memory. Memo indices
and marks are checked against what exists.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass, field
from typing import Any, Final

import torch

DCP_METADATA: Final = "torch.distributed.checkpoint.metadata"
DCP_FILESYSTEM: Final = "torch.distributed.checkpoint.filesystem"
ALLOWED_NAMES: Final = {
    (DCP_METADATA, n)
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
    (DCP_FILESYSTEM, "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *(("builtins", n) for n in ("set", "frozenset", "tuple", "list", "dict")),
    *(("pathlib", n) for n in ("Path", "PosixPath", "PurePosixPath", "WindowsPath")),
    ("pathlib", "PureWindowsPath"),
}
"""The names a DCP metadata pickle may use (besides torch's dtypes, layouts and formats)."""


class Refused(Exception):
    """The pickle does something the reader refuses (an opcode, a name, a shape)."""


class Malformed(Exception):
    """The pickle is not well formed (truncated, a bad mark or memo index)."""


@dataclass(eq=False, slots=True)
class Global:
    module: str
    name: str


@dataclass(eq=False, slots=True)
class Record:
    """A call the pickle asks for (``REDUCE``/``NEWOBJ``), recorded, never made."""

    cls: Global
    args: tuple[Any, ...]
    state: Any = None
    built: bool = False


@dataclass(eq=False, slots=True)
class DictRecord:
    pairs: list[tuple[Any, Any]] = field(default_factory=list)
    ordered: bool = False


@dataclass(eq=False, slots=True)
class SetRecord:
    items: list[Any] = field(default_factory=list)
    frozen: bool = False


def read_pickle(data: bytes) -> Any:
    """The object the pickle ``data`` holds, as inert records (see the module)."""
    return Reader(data).run()


# -- the opcode reader ----------------------------------------------------------------------------


class Reader:
    """One pass over the pickle; every opcode costs O(its own bytes), except the mark-taking
    ones, which consume what they pop."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise Malformed(f"truncated at byte {self.pos}")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.take(size))[0]

    def pop(self) -> Any:
        if not self.stack or (self.marks and len(self.stack) <= self.marks[-1]):
            raise Malformed("an opcode pops from an empty stack")
        return self.stack.pop()

    def pop_mark(self) -> list[Any]:
        if not self.marks:
            raise Malformed("an opcode needs a mark and there is none")
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        return items

    def text(self, n: int) -> str:
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError as e:
            raise Malformed(f"a string that is not UTF-8 ({e})") from None

    def run(self) -> Any:
        while True:
            op = self.take(1)
            if op == pickle.STOP:
                if len(self.stack) != 1 or self.marks:
                    raise Malformed("STOP with other than one object on the stack")
                return self.stack[0]
            handler = _OPS.get(op)
            if handler is None:
                raise Refused(f"pickle opcode {op!r}")
            handler(self)

    # -- opcodes -------------------------------------------------------------------------------

    def proto(self) -> None:
        if self.unpack("<B") > 5:
            raise Refused("a pickle protocol newer than 5")

    def frame(self) -> None:
        self.unpack("<Q")  # frames only batch reads: the bytes follow in place

    def push(self, value: Any) -> None:
        self.stack.append(value)

    def mark(self) -> None:
        self.marks.append(len(self.stack))

    def memoize(self) -> None:
        if not self.stack:
            raise Malformed("MEMOIZE with an empty stack")
        self.memo[len(self.memo)] = self.stack[-1]

    def put(self, index: int) -> None:
        if not self.stack:
            raise Malformed("PUT with an empty stack")
        self.memo[index] = self.stack[-1]

    def get(self, index: int) -> None:
        if index not in self.memo:
            raise Malformed(f"memo index {index} was never stored")
        self.stack.append(self.memo[index])

    def long(self, n: int) -> None:
        if n > 1024:
            raise Refused(f"an integer of {n} bytes")
        self.push(int.from_bytes(self.take(n), "little", signed=True))

    def global_(self, module: str, name: str) -> None:
        if (module, name) not in ALLOWED_NAMES and not (
            module == "torch" and is_torch_constant(name)
        ):
            raise Refused(f"{module}.{name}")
        self.push(Global(module, name))

    def stack_global(self) -> None:
        name, module = self.pop(), self.pop()
        if not isinstance(module, str) or not isinstance(name, str):
            raise Malformed("STACK_GLOBAL of something other than two strings")
        self.global_(module, name)

    def line_global(self) -> None:
        module = self.line()
        self.global_(module, self.line())

    def line(self) -> str:
        end = self.data.find(b"\n", self.pos, self.pos + 1024)
        if end < 0:
            raise Malformed("a GLOBAL name longer than 1024 bytes or unterminated")
        return self.text(end - self.pos + 1)[:-1]

    def call(self) -> None:
        args, target = self.pop(), self.pop()
        if not isinstance(target, Global) or not isinstance(args, tuple):
            raise Refused(f"a call of {type(target).__name__} (only allow-listed names)")
        if (target.module, target.name) == ("collections", "OrderedDict") and not args:
            self.push(DictRecord(ordered=True))  # filled by SETITEMS like a dict
            return
        self.push(Record(target, args))

    def build(self) -> None:
        state, target = self.pop(), self.pop()
        if not isinstance(target, Record) or target.built:
            what = "a class" if isinstance(target, Global) else type(target).__name__
            raise Refused(f"BUILD on {what} (only on a record this pickle made, once)")
        target.state, target.built = state, True
        self.push(target)

    def setitems(self, pairs: list[Any]) -> None:
        if len(pairs) % 2:
            raise Malformed("SETITEMS with an odd number of items")
        target = self.pop()
        if not isinstance(target, DictRecord):
            raise Refused(f"SETITEM on {type(target).__name__}")
        target.pairs.extend(zip(pairs[::2], pairs[1::2], strict=True))
        self.push(target)

    def appends(self, items: list[Any]) -> None:
        target = self.pop()
        if not isinstance(target, list):
            raise Refused(f"APPEND on {type(target).__name__}")
        target.extend(items)
        self.push(target)

    def additems(self, items: list[Any]) -> None:
        target = self.pop()
        if not isinstance(target, SetRecord) or target.frozen:
            raise Refused(f"ADDITEMS on {type(target).__name__}")
        target.items.extend(items)
        self.push(target)


def is_torch_constant(name: str) -> bool:
    value = getattr(torch, name, None) if name.isidentifier() else None
    return isinstance(value, torch.dtype | torch.layout | torch.memory_format)


def _tuple_of(n: int) -> Any:
    def op(r: Reader) -> None:
        items = [r.pop() for _ in range(n)][::-1]
        r.push(tuple(items))

    return op


_OPS: Final[dict[bytes, Any]] = {
    pickle.PROTO: Reader.proto,
    pickle.FRAME: Reader.frame,
    pickle.MARK: Reader.mark,
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
    pickle.EMPTY_DICT: lambda r: r.push(DictRecord()),
    pickle.SETITEM: lambda r: r.setitems([*reversed([r.pop(), r.pop()])]),
    pickle.SETITEMS: lambda r: r.setitems(r.pop_mark()),
    pickle.EMPTY_SET: lambda r: r.push(SetRecord()),
    pickle.ADDITEMS: lambda r: r.additems(r.pop_mark()),
    pickle.FROZENSET: lambda r: r.push(SetRecord(r.pop_mark(), frozen=True)),
    pickle.MEMOIZE: Reader.memoize,
    pickle.BINPUT: lambda r: r.put(r.unpack("<B")),
    pickle.LONG_BINPUT: lambda r: r.put(r.unpack("<I")),
    pickle.BINGET: lambda r: r.get(r.unpack("<B")),
    pickle.LONG_BINGET: lambda r: r.get(r.unpack("<I")),
    pickle.GLOBAL: Reader.line_global,
    pickle.STACK_GLOBAL: Reader.stack_global,
    pickle.REDUCE: Reader.call,
    pickle.NEWOBJ: Reader.call,
    pickle.BUILD: Reader.build,
}
