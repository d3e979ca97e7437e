"""Encoding of plain values and dtype names.

Plain data is stored as JSON with a few tags so that it round-trips exactly: None, bool, int,
float (``nan`` and infinities included), str, bytes, list, tuple, dict and ``OrderedDict`` (any
scalar keys), ``set``/``frozenset``, ``pathlib`` paths, ``datetime``/``date``/``time``/
``timedelta``, numpy scalars and arrays (numeric, bool, bytes and str dtypes), and
``torch.Size``/``torch.dtype``. Decoding builds only these types. Anything else (namedtuples,
enums, dataclasses, ``argparse.Namespace``, arbitrary objects) is refused unless the caller opts
into pickle for its key, and a pickled value only loads with the same opt-in at load time:
loading a snapshot never runs code from it by default.
"""

from __future__ import annotations

import base64
import datetime as dt
import enum
import json
import math
import pathlib
import pickle
import sys
from collections import OrderedDict
from collections.abc import Sequence
from functools import cache
from typing import TYPE_CHECKING, Any, Final, cast

import numpy as np

if TYPE_CHECKING:
    import torch

from trainsnap.errors import CorruptError, IncompatibleError, InvalidArgumentError
from trainsnap.format import tree
from trainsnap.format.flooding import FloodError, check_spread

JSON: Final = "json"
PICKLE: Final = "pickle"

# Tags are single-key objects whose key starts with "$"; a user dict that could be mistaken for
# one is itself written in the tagged "$dict" form, so decoding is never ambiguous.
_TAGS: Final = (
    "$tuple", "$float", "$bytes", "$dict", "$odict", "$size", "$dtype", "$set", "$frozenset",
    "$path", "$datetime", "$date", "$time", "$timedelta", "$np", "$npscalar",
)  # fmt: skip
_PATHS: Final = {
    cls.__name__: cls
    for cls in (
        pathlib.PurePosixPath,
        pathlib.PureWindowsPath,
        pathlib.PosixPath,
        pathlib.WindowsPath,
        pathlib.Path,
    )
}
_NP_KINDS: Final = "biufcSUmM"
"""numpy dtype kinds stored as plain data (no objects, no structured records)."""

PickleKeys = bool | Sequence[str]
"""Pickle opt-in: everything (True), nothing (False), or the values under these dotted keys."""


class NotPlainError(TypeError):
    """Raised by :func:`encode_plain` for a value outside the plain-data set."""


class UnreadableValueError(InvalidArgumentError):
    """Raised by :func:`encode_plain` for plain data no reader would read back: nested deeper
    than :data:`MAX_DEPTH`, holding itself, an integer beyond :data:`MAX_INT`, or a set or
    dict whose keys share one hash beyond :data:`~trainsnap.format.flooding.MAX_SHARED_HASH`."""


MAX_DEPTH: Final = 200
"""Deepest nesting of containers in one plain value (a reader refuses more, so a save does)."""
MAX_INT: Final = tree.MAX_INT
_MAX_NP_DTYPE: Final = 32
"""Longest numpy dtype string read (``"<M8[ns]"`` is 7)."""


def pickle_allowed(allow: PickleKeys, key: str) -> bool:
    """Whether the opt-in ``allow`` covers the value at ``key`` (a key covers what is under it)."""
    if isinstance(allow, bool):
        return allow
    keys = [allow] if isinstance(allow, str) else allow
    return any(key == k or key.startswith(k + ".") for k in keys)


def _why_not(value: Any) -> str:
    cls = type(value)
    if isinstance(value, tuple) and hasattr(cls, "_fields"):
        return "a namedtuple"
    if isinstance(value, enum.Enum):
        return "an enum member"
    if hasattr(cls, "__dataclass_fields__"):
        return "a dataclass instance"
    if cls.__module__ == "argparse" and cls.__name__ == "Namespace":
        return "an argparse.Namespace"
    return "not plain data"


def _spread(keys: Any, path: str) -> None:
    """A save refuses the container a reader would refuse (:mod:`~trainsnap.format.flooding`)."""
    try:
        check_spread(keys, _clip(path))
    except FloodError as e:
        raise UnreadableValueError(f"{e}; a reader refuses it. Use other keys") from None


def _enc_items(pairs: Any, path: str, depth: int) -> list[list[Any]]:
    out = []
    for k, x in pairs:
        if not _is_key(k):
            raise NotPlainError(f"{path}: dict key {k!r} is not a str, int, float, bool or None")
        out.append([_enc(k, path, depth), _enc(x, f"{path}.{k}", depth)])
    return out


def _is_key(k: Any) -> bool:
    return k is None or isinstance(k, str) or tree.is_key(k)


def _enc(value: Any, path: str, depth: int = 0) -> Any:
    """The JSON form of ``value``; a container deeper than :data:`MAX_DEPTH` (which a cycle
    always is) raises :class:`UnreadableValueError` naming where."""
    if isinstance(value, list | tuple | dict | set | frozenset):
        if depth >= MAX_DEPTH:
            raise UnreadableValueError(
                f"{_clip(path)}: nested deeper than {MAX_DEPTH} containers (or it holds itself); a "
                "reader refuses that. Flatten it, or break the cycle"
            )
        depth += 1
    return _enc_one(value, path, depth)


def _enc_numpy(value: Any, path: str) -> Any:
    if value.dtype.kind not in _NP_KINDS:
        raise NotPlainError(f"{path}: a numpy value of dtype {value.dtype} is not plain data")
    body = base64.b64encode(np.ascontiguousarray(value).tobytes()).decode("ascii")
    if isinstance(value, np.ndarray):
        return {"$np": [value.dtype.str, list(value.shape), body]}
    return {"$npscalar": [value.dtype.str, body]}


def _clip(path: str) -> str:
    return path if len(path) <= 80 else f"{path[:77]}..."


def _enc_one(value: Any, path: str, depth: int) -> Any:
    if value is None or type(value) in (bool, str):
        return value
    if type(value) is int:
        if not -MAX_INT < value < MAX_INT:
            raise UnreadableValueError(
                f"{_clip(path)}: an integer of {value.bit_length()} bits; a reader refuses "
                "integers of 1024 bits or more. Store it as a string or bytes"
            )
        return int(value)
    if isinstance(value, np.ndarray | np.generic):
        return _enc_numpy(value, path)
    if type(value) is float:
        if math.isfinite(value):
            return float(value)
        return {"$float": repr(float(value))}
    torch = sys.modules.get("torch")  # no torch value can exist before torch is imported
    if torch is not None and isinstance(value, torch.Size):
        return {"$size": [int(x) for x in value]}
    if torch is not None and isinstance(value, torch.dtype):
        return {"$dtype": dtype_name(value)}
    if isinstance(value, bytes | bytearray):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if type(value) is list:
        return [_enc(x, f"{path}[{i}]", depth) for i, x in enumerate(value)]
    if type(value) is tuple:
        return {"$tuple": [_enc(x, f"{path}[{i}]", depth) for i, x in enumerate(value)]}
    if type(value) is dict:
        plain_keys = all(isinstance(k, str) and not k.startswith("$") for k in value)
        if plain_keys:
            return {k: _enc(x, f"{path}.{k}", depth) for k, x in value.items()}
        _spread(value, path)
        return {"$dict": _enc_items(value.items(), path, depth)}
    if type(value) is OrderedDict:
        _spread(value, path)
        return {"$odict": _enc_items(value.items(), path, depth)}
    if type(value) in (set, frozenset):
        _spread(value, path)
        items = [_enc(x, f"{path}{{}}", depth) for x in value]
        items.sort(key=lambda x: json.dumps(x, sort_keys=True))  # the same bytes on every rank
        return {f"${type(value).__name__}": items}
    if type(value).__name__ in _PATHS and type(value) is _PATHS[type(value).__name__]:
        return {"$path": [type(value).__name__, str(value)]}
    if type(value) is dt.datetime:
        return {"$datetime": value.isoformat()}
    if type(value) is dt.date:
        return {"$date": value.isoformat()}
    if type(value) is dt.time:
        return {"$time": value.isoformat()}
    if type(value) is dt.timedelta:
        return {"$timedelta": [value.days, value.seconds, value.microseconds]}
    cls = type(value)
    raise NotPlainError(f"{path}: {cls.__module__}.{cls.__qualname__} is {_why_not(value)}")


def _dec(value: Any, depth: int = 0) -> Any:
    """The value a JSON document encodes; ValueError for anything malformed: every tag's body
    is checked for type and range before it is used, nesting is bounded by :data:`MAX_DEPTH`
    (the JSON nests at most twice as deep as the value: a tag is one level more)."""
    if isinstance(value, list | dict):
        if depth >= 2 * MAX_DEPTH + 2:
            raise ValueError(f"nested deeper than {MAX_DEPTH} containers")
        depth += 1
    elif isinstance(value, int) and not isinstance(value, bool):
        if not -MAX_INT < value < MAX_INT:
            raise ValueError("an integer of 1024 bits or more")
        return value
    if isinstance(value, list):
        return [_dec(x, depth) for x in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, body),) = value.items()
        if tag in _CONTAINER_TAGS:
            return _dec_container(tag, body, depth)
        decoded = _dec_scalar(tag, body)
        if decoded is not _NOT_SCALAR:
            return decoded
    if any(isinstance(k, str) and k.startswith("$") for k in value):
        raise ValueError(f"unknown tag in plain value: {sorted(value)[:4]}")
    return {k: _dec(x, depth) for k, x in value.items()}


_CONTAINER_TAGS: Final = frozenset({"$tuple", "$dict", "$odict", "$set", "$frozenset"})
_NOT_SCALAR: Final = object()


def _body(tag: str, body: Any, kind: type | tuple[type, ...], size: int | None = None) -> Any:
    """``body`` when it is a ``kind`` (of ``size`` items); ValueError naming the tag else."""
    if not isinstance(body, kind) or (size is not None and len(cast(list[Any], body)) != size):
        want = f"{size} items" if size is not None else getattr(kind, "__name__", str(kind))
        raise ValueError(f"{tag} holds a {type(body).__name__} ({str(body)[:40]}), not {want}")
    return body


def _dec_container(tag: str, body: Any, depth: int) -> Any:
    if tag == "$tuple":
        return tuple(_dec(x, depth) for x in _body(tag, body, list))
    if tag in ("$dict", "$odict"):
        pairs = _dec_pairs(body, depth)
        return OrderedDict(pairs) if tag == "$odict" else pairs
    items = [_dec(x, depth) for x in _body(tag, body, list)]
    check_spread(items, tag)
    return set(items) if tag == "$set" else frozenset(items)


def _int_in(value: Any, low: int, high: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
        raise ValueError(f"{what}: expected an integer in [{low}, {high}), got {str(value)[:40]}")
    return value


def _dec_scalar(tag: str, body: Any) -> Any:
    """The tagged scalars; ``_NOT_SCALAR`` for other tags."""
    if tag == "$float":
        return float(_body(tag, body, str))
    if tag == "$bytes":
        return base64.b64decode(_body(tag, body, str), validate=True)
    if tag == "$size":
        import torch

        return torch.Size(_int_in(n, 0, 1 << 63, "$size") for n in _body(tag, body, list))
    if tag == "$dtype":
        return dtype_from_name(_body(tag, body, str))
    if tag == "$path":
        cls_name, text = _body(tag, body, list, 2)
        cls = _PATHS.get(cls_name) if isinstance(cls_name, str) else None
        if cls is None or not isinstance(text, str):
            raise ValueError(f"$path holds {str(body)[:60]}, not [a path class, a string]")
        try:
            return cls(text)
        except NotImplementedError:  # a concrete path of another OS: its pure flavour
            pure = pathlib.PureWindowsPath if "Windows" in cls_name else pathlib.PurePosixPath
            return pure(text)
    if tag in ("$datetime", "$date", "$time"):
        text = _body(tag, body, str)
        if tag == "$datetime":
            return dt.datetime.fromisoformat(text)
        return dt.date.fromisoformat(text) if tag == "$date" else dt.time.fromisoformat(text)
    if tag == "$timedelta":
        days, seconds, micro = _body(tag, body, list, 3)
        return dt.timedelta(
            days=_int_in(days, -999999999, 1000000000, "$timedelta days"),
            seconds=_int_in(seconds, 0, 86400, "$timedelta seconds"),
            microseconds=_int_in(micro, 0, 1000000, "$timedelta microseconds"),
        )
    if tag in ("$np", "$npscalar"):
        return _dec_numpy(tag, body)
    return _NOT_SCALAR


def _dec_numpy(tag: str, body: Any) -> Any:
    _body(tag, body, list, 3 if tag == "$np" else 2)
    name, text = body[0], body[-1]
    if not isinstance(name, str) or len(name) > _MAX_NP_DTYPE or not isinstance(text, str):
        raise ValueError(f"{tag} holds {str(body)[:60]}, not [a dtype, ..., base64 text]")
    dtype = np.dtype(name)
    if dtype.kind not in _NP_KINDS or dtype.itemsize == 0:
        raise ValueError(f"numpy dtype {name!r} is not plain data")
    shape = tuple(_body(tag, body[1], list)) if tag == "$np" else ()
    if len(shape) > 64:
        raise ValueError(f"numpy shape of {len(shape)} dimensions (at most 64)")
    for n in shape:
        _int_in(n, 0, 1 << 62, "numpy shape")
    if len(text) // 4 * 3 < dtype.itemsize * math.prod(shape):  # before decoding anything
        raise ValueError(f"numpy value of shape {list(shape)} and {len(text)} base64 bytes differ")
    raw = base64.b64decode(text, validate=True)
    if len(raw) != dtype.itemsize * math.prod(shape):
        raise ValueError(f"numpy value of shape {list(shape)} and {len(raw)} bytes disagree")
    if dtype.kind == "U":  # UCS-4 code units: beyond U+10FFFF no str can hold them
        units = np.frombuffer(raw, dtype=np.dtype("uint32").newbyteorder(dtype.byteorder))
        if units.size and int(units.max()) > sys.maxunicode:
            raise ValueError(f"numpy {name!r} text holds a code point beyond U+10FFFF")
    array = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    return array if tag == "$np" else array[()]


def _dec_pairs(body: Any, depth: int) -> dict[Any, Any]:
    """A ``$dict`` (a dict with non-string keys): a list of distinct [key, value] pairs."""
    if not isinstance(body, list) or not all(
        isinstance(pair, list) and len(pair) == 2 for pair in body
    ):
        raise ValueError("$dict holds something other than a list of [key, value] pairs")
    keys = [_dec(raw_key, depth) for raw_key, _ in body]
    for key in keys:
        if not _is_key(key):
            raise ValueError(f"$dict has a key {str(key)[:40]} that is not a scalar")
    check_spread(keys, "$dict")
    out = {}
    for key, (_, item) in zip(keys, body, strict=True):
        if key in out:
            raise ValueError(f"$dict repeats the key {key!r}")
        out[key] = _dec(item, depth)
    return out


def is_plain(value: Any) -> bool:
    try:
        _enc(value, "")
    except NotPlainError:
        return False
    return True


def encode_plain(value: Any, path: str = "value") -> bytes:
    """JSON bytes for a plain value; raises :class:`NotPlainError` for anything else."""
    return json.dumps(_enc(value, path), separators=(",", ":"), allow_nan=False).encode()


def encode(value: Any, key: str, *, allow_pickle: PickleKeys) -> tuple[str, bytes]:
    """(codec, bytes) for a value: JSON when plain, pickle only when allowed for ``key``."""
    try:
        return JSON, encode_plain(value, key)
    except UnreadableValueError as e:
        raise InvalidArgumentError(f"cannot save {key!r}: {e}", key=key) from None
    except NotPlainError as e:
        if not pickle_allowed(allow_pickle, key):
            top = key.split(".", 1)[0]
            raise InvalidArgumentError(
                f"cannot save {key!r}: {e}. trainsnap stores tensors and plain data (None, bool, "
                "int, float, str, bytes, containers, sets, paths, datetimes, numpy values) so "
                "that loading never runs code. Convert it to plain data (a namedtuple or "
                "Namespace to a dict, an enum to its value), wrap it in an object with "
                "state_dict()/load_state_dict(), or opt into pickle for this key: "
                f"allow_pickle=({top!r},) when saving and when loading.",
                key=key,
            ) from e
        return PICKLE, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def decode(codec: str, data: bytes, key: str, *, allow_pickle: PickleKeys, snapshot_id: str) -> Any:
    """The value ``data`` holds. :class:`CorruptError` for JSON no writer makes (malformed,
    nested too deeply, keys that flood a hash table); :class:`IncompatibleError` for pickle
    without the opt-in or an unknown codec."""
    if codec == JSON:
        try:
            return _dec(json.loads(data))
        except (
            ValueError,
            TypeError,
            KeyError,
            IndexError,
            OverflowError,
            RecursionError,
        ) as e:
            # No trainsnap of this format writes such bytes (a save refuses what a reader
            # would): they are damage, and a restore falls back past them like other damage.
            why = "nested too deeply" if isinstance(e, RecursionError) else e
            raise CorruptError(
                f"value {key!r} of snapshot {snapshot_id} is not valid trainsnap JSON: {why}",
                snapshot_id=snapshot_id,
                key=key,
            ) from e
    if codec == PICKLE:
        if not pickle_allowed(allow_pickle, key):
            raise IncompatibleError(
                f"value {key!r} of snapshot {snapshot_id} was saved with pickle; loading it would "
                f"run code from the snapshot. Pass allow_pickle=({key.split('.', 1)[0]!r},) (or "
                "True) to load it only if you trust whoever wrote this snapshot.",
                snapshot_id=snapshot_id,
                key=key,
            )
        return pickle.loads(data)
    raise IncompatibleError(
        f"value {key!r} of snapshot {snapshot_id} uses unknown codec {codec!r}; upgrade trainsnap",
        snapshot_id=snapshot_id,
        key=key,
    )


# -- dtypes ---------------------------------------------------------------------------------------


_ITEMSIZES: Final = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex128": 16,
    "complex64": 8,
    "complex32": 4,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
}
"""Every dtype name a snapshot may record, and its bytes per element (torch's ``itemsize``):
the manifest's checks use it without importing torch."""


@cache
def _dtypes() -> dict[str, torch.dtype]:
    """The dtypes of :data:`_ITEMSIZES` this torch has (imported on first use)."""
    import torch

    table = {}
    for n in _ITEMSIZES:
        dt = getattr(torch, n, None)
        if isinstance(dt, torch.dtype):
            table[n] = dt
    return table


@cache
def _names() -> dict[torch.dtype, str]:
    return {v: k for k, v in _dtypes().items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _names()[dtype]
    except KeyError:
        raise InvalidArgumentError(
            f"dtype {dtype} is not supported by trainsnap; supported: {sorted(_dtypes())}"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _dtypes()[name]
    except KeyError:
        raise IncompatibleError(
            f"dtype {name!r} is unknown to this trainsnap/torch; upgrade them to read it"
        ) from None


def itemsize(name: str) -> int:
    """Bytes per element of the dtype ``name``, without importing torch."""
    try:
        return _ITEMSIZES[name]
    except KeyError:
        raise IncompatibleError(
            f"dtype {name!r} is unknown to this trainsnap/torch; upgrade them to read it"
        ) from None
