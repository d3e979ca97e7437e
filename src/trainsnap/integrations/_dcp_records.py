"""The inert records of a DCP metadata pickle (:mod:`~trainsnap.integrations._dcp_pickle`) turned
into torch's own classes: ``Metadata``, ``TensorStorageMetadata``, ``TensorProperties``,
``ChunkStorageMetadata``, ``BytesStorageMetadata``, ``MetadataIndex``, ``StorageMeta``,
``_StorageInfo``, ``torch.Size``, dtypes, layouts, paths and plain builtins, each built by calling
its constructor with checked fields (fields a newer torch adds are left out, not trusted).

:class:`Converter` builds each record once (shared records stay shared), nests at most
:data:`MAX_DEPTH` deep and refuses a record that contains itself; :func:`check_shape` checks the
classes DCP's readers rely on. What does not fit is
:class:`~trainsnap.integrations._dcp_pickle.Refused`, naming it.
"""

from __future__ import annotations

import pathlib
from collections import OrderedDict
from typing import Any, Final

import torch

from trainsnap.format.flooding import FloodError, check_spread
from trainsnap.integrations._dcp_pickle import (
    DCP_FILESYSTEM,
    DCP_METADATA,
    DictRecord,
    Global,
    Record,
    Refused,
    SetRecord,
    is_torch_constant,
)

MAX_DEPTH: Final = 100
"""Deepest nesting of records and containers converted (DCP's own is about 6)."""
EXPANSION: Final = 64
"""A pickle's memo lets a record be referenced many times: the converted value, counted as the
tree it stands for (every reference expanded), may hold at most this many nodes per byte of the
pickle, plus :data:`EXPANSION_SLACK` (``T(i+1) = (T(i), T(i))`` 40 times is 220 bytes and 2^40
nodes, and hashing it walks them all)."""
EXPANSION_SLACK: Final = 1 << 20
MAX_KEY_NODES: Final = 1 << 12
"""Most nodes a dict key or set item may expand to (hashing one walks all of them; DCP's are
strings and small tuples)."""


class Converter:
    """Inert records to torch's DCP classes, each built once (shared records stay shared), with
    nesting bounded and cycles refused."""

    def __init__(self, budget: int = EXPANSION_SLACK) -> None:
        """``budget``: the most nodes the whole converted value may expand to (see
        :data:`EXPANSION`)."""
        self.done: dict[int, Any] = {}
        self.active: set[int] = set()
        self.sizes: dict[int, int] = {}
        self.budget = budget
        from torch.distributed.checkpoint import filesystem, metadata

        self.md, self.fs = metadata, filesystem

    def value(self, obj: Any, depth: int = 0) -> Any:
        if obj is None or isinstance(obj, bool | int | float | str | bytes):
            return obj
        if depth > MAX_DEPTH:
            raise Refused(f"records nested deeper than {MAX_DEPTH}")
        key = id(obj)
        if key in self.done:
            return self.done[key]
        if key in self.active:
            raise Refused("a record that contains itself")
        self.active.add(key)
        try:
            out = self._convert(obj, depth + 1)
        finally:
            self.active.discard(key)
        self.done[key] = out
        size = 1 + sum(self.sizes.get(id(child), 1) for child in _children(obj))
        if size > self.budget:
            raise Refused(
                f"shared references that expand to more than {self.budget} values (a pickle "
                "whose memo nests one record in itself over and over)"
            )
        self.sizes[key] = size
        return out

    def _key(self, value: Any, source: Any) -> Any:
        """``value`` (converted from ``source``) as a dict key or set item: hashable and of a
        bounded expanded size, so that hashing it is cheap."""
        if self.sizes.get(id(source), 1) > MAX_KEY_NODES:
            raise Refused(f"a key that expands to more than {MAX_KEY_NODES} values")
        return _hashable(value)

    def _convert(self, obj: Any, depth: int) -> Any:
        if isinstance(obj, tuple):
            return tuple(self.value(x, depth) for x in obj)
        if isinstance(obj, list):
            return [self.value(x, depth) for x in obj]
        if isinstance(obj, DictRecord):
            keys = [self._key(self.value(k, depth), k) for k, _ in obj.pairs]
            _spread(keys, "a dict")
            out = OrderedDict() if obj.ordered else {}
            for key, (_, v) in zip(keys, obj.pairs, strict=True):
                out[key] = self.value(v, depth)
            return out
        if isinstance(obj, SetRecord):
            items = [self._key(self.value(x, depth), x) for x in obj.items]
            _spread(items, "a set")
            return frozenset(items) if obj.frozen else set(items)
        if isinstance(obj, Global):
            if obj.module == "torch" and is_torch_constant(obj.name):
                return getattr(torch, obj.name)
            raise Refused(f"{obj.module}.{obj.name} used as a value")
        if isinstance(obj, Record):
            return self._record(obj, depth)
        raise Refused(f"a {type(obj).__name__}")

    def _record(self, rec: Record, depth: int) -> Any:
        module, name = rec.cls.module, rec.cls.name
        args = [self.value(a, depth) for a in rec.args]
        if module in (DCP_METADATA, DCP_FILESYSTEM) and name != "_MEM_FORMAT_ENCODING":
            if args:
                raise Refused(f"{name} made with arguments")
            return self._dataclass(name, self.value(rec.state, depth))
        if rec.built:
            raise Refused(f"BUILD on {module}.{name}")
        if name in ("set", "frozenset") and rec.args and isinstance(rec.args[0], tuple | list):
            for source, item in zip(rec.args[0], args[0], strict=False):
                self._key(item, source)
        return _call(module, name, args)

    def _dataclass(self, name: str, state: Any) -> Any:
        if name == "TensorProperties":
            fields = _properties(state)
            return self.md.TensorProperties(**fields)
        if name == "BytesStorageMetadata":
            return self.md.BytesStorageMetadata()
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise Refused(f"{name} with a state that is not a dict of fields")
        cls = self.fs._StorageInfo if name == "_StorageInfo" else getattr(self.md, name)
        check = _FIELDS[name]
        kept = {}
        for k, v in state.items():
            if k in check:  # fields a newer torch adds are left out, not trusted
                kept[k] = check[k](v, f"{name}.{k}")
        try:
            return cls(**kept)
        except (TypeError, ValueError) as e:  # a required field missing
            raise Refused(f"{name} without the fields it needs ({e})") from None


def _children(obj: Any) -> Any:
    """The records and values ``obj`` refers to (for its expanded size)."""
    if isinstance(obj, tuple | list):
        return obj
    if isinstance(obj, DictRecord):
        return [x for pair in obj.pairs for x in pair]
    if isinstance(obj, SetRecord):
        return obj.items
    if isinstance(obj, Record):
        return (*obj.args, obj.state)
    return ()


def _spread(keys: list[Any], what: str) -> None:
    try:
        check_spread(keys, what)
    except FloodError as e:
        raise Refused(str(e)) from None


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        raise Refused(f"an unhashable {type(value).__name__} as a key") from None
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
    elif (module, name) == (DCP_METADATA, "_MEM_FORMAT_ENCODING"):
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
                _spread(items, f"a {name}")
            builder = {"set": set, "frozenset": frozenset, "tuple": tuple, "list": list}.get(name)
            if builder is not None:
                return builder(items)
    raise Refused(f"{module}.{name} called with {len(args)} argument(s) it does not take")


def _ints(values: Any, what: str, *, low: int = 0) -> list[int]:
    if not isinstance(values, tuple | list) or len(values) > 64:
        raise Refused(f"{what}: expected at most 64 integers")
    for v in values:
        if type(v) is not int or not low <= v < 1 << 62:
            raise Refused(f"{what}: {str(v)[:40]} is not an integer in [{low}, 2^62)")
    return list(values)


def _size(value: Any, what: str) -> torch.Size:
    if not isinstance(value, torch.Size):
        value = torch.Size(_ints(value, what))
    return torch.Size(_ints(tuple(value), what))


def _typed(kind: type | tuple[type, ...], optional: bool = False) -> Any:
    def check(value: Any, what: str) -> Any:
        if (optional and value is None) or (isinstance(value, kind) and type(value) is not bool):
            return value
        raise Refused(f"{what}: a {type(value).__name__}")

    return check


def _offset(value: Any, what: str) -> int:
    if type(value) is not int or not 0 <= value < 1 << 62:
        raise Refused(f"{what}: {str(value)[:40]} is not an integer in [0, 2^62)")
    return value


def _list_of(kind: type) -> Any:
    def check(value: Any, what: str) -> Any:
        if not isinstance(value, list) or not all(isinstance(x, kind) for x in value):
            raise Refused(f"{what}: expected a list of {kind.__name__}")
        return value

    return check


def _properties(state: Any) -> dict[str, Any]:
    """TensorProperties' state: (dtype, layout, requires_grad, memory format code, pin_memory)."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    if not isinstance(state, tuple) or len(state) != 5:
        raise Refused("TensorProperties with a state other than its five fields")
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
        raise Refused("TensorProperties with fields of the wrong types")
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


def check_shape(metadata: Any) -> Any:
    """The classes DCP's readers rely on, where they rely on them."""
    md = torch.distributed.checkpoint.metadata
    if not isinstance(metadata, md.Metadata):
        raise Refused(f"the pickle holds a {type(metadata).__name__}, not DCP Metadata")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(key, str):
            raise Refused("a state_dict_metadata key that is not a string")
        if isinstance(entry, md.TensorStorageMetadata):
            if not isinstance(entry.properties, md.TensorProperties) or not all(
                isinstance(c, md.ChunkStorageMetadata) for c in entry.chunks
            ):
                raise Refused(f"tensor {key!r} with malformed properties or chunks")
        elif not isinstance(entry, md.BytesStorageMetadata):
            raise Refused(f"entry {key!r} is a {type(entry).__name__}")
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, md.StorageMeta):
        raise Refused("storage_meta is not a StorageMeta")
    return metadata
