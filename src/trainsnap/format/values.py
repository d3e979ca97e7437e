"""Encoding of plain values and dtype names.

Plain data (None, bool, int, float, str, bytes, lists, tuples, dicts with str or int keys, and
``torch.Size``/``torch.dtype``) is stored as JSON with a few tags so that it round-trips exactly:
a tuple comes back a tuple, ``nan`` comes back ``nan``, an int key stays an int. Anything else is
refused unless the caller opts into pickle for that save, and a pickled value only loads with an
explicit opt-in at load time: loading a snapshot never runs code from it by default.
"""

from __future__ import annotations

import base64
import json
import math
import pickle
from typing import Any, Final

import torch

from trainsnap.errors import IncompatibleError, InvalidArgumentError

JSON: Final = "json"
PICKLE: Final = "pickle"

# Tags are single-key objects whose key starts with "$"; a user dict that could be mistaken for
# one is itself written in the tagged "$dict" form, so decoding is never ambiguous.
_TAGS: Final = ("$tuple", "$float", "$bytes", "$dict", "$size", "$dtype")


class NotPlainError(TypeError):
    """Raised by :func:`encode_plain` for a value outside the plain-data set."""


def _enc(value: Any, path: str) -> Any:
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {"$float": repr(float(value))}
    if isinstance(value, torch.Size):
        return {"$size": [int(x) for x in value]}
    if isinstance(value, torch.dtype):
        return {"$dtype": dtype_name(value)}
    if isinstance(value, bytes | bytearray):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, list):
        return [_enc(x, f"{path}[{i}]") for i, x in enumerate(value)]
    if isinstance(value, tuple) and type(value) is tuple:
        return {"$tuple": [_enc(x, f"{path}[{i}]") for i, x in enumerate(value)]}
    if isinstance(value, dict) and type(value) is dict:
        plain_keys = all(isinstance(k, str) and not k.startswith("$") for k in value)
        if plain_keys:
            return {k: _enc(x, f"{path}.{k}") for k, x in value.items()}
        items = []
        for k, x in value.items():
            if isinstance(k, bool) or not isinstance(k, str | int):
                raise NotPlainError(f"{path}: dict key {k!r} is neither str nor int")
            items.append([k, _enc(x, f"{path}.{k}")])
        return {"$dict": items}
    raise NotPlainError(
        f"{path}: {type(value).__module__}.{type(value).__qualname__} is not plain data"
    )


def _dec(value: Any) -> Any:
    if isinstance(value, list):
        return [_dec(x) for x in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, body),) = value.items()
        if tag == "$tuple":
            if not isinstance(body, list):
                raise ValueError(f"$tuple holds a {type(body).__name__}, not a list")
            return tuple(_dec(x) for x in body)
        if tag == "$float":
            return float(body)
        if tag == "$bytes":
            return base64.b64decode(body)
        if tag == "$size":
            return torch.Size(int(x) for x in body)
        if tag == "$dtype":
            return dtype_from_name(body)
        if tag == "$dict":
            return _dec_pairs(body)
    if any(isinstance(k, str) and k.startswith("$") for k in value):
        raise ValueError(f"unknown tag in plain value: {sorted(value)}")
    return {k: _dec(x) for k, x in value.items()}


def _dec_pairs(body: Any) -> dict[Any, Any]:
    """A ``$dict`` (a dict with non-string keys): a list of distinct [key, value] pairs."""
    if not isinstance(body, list) or not all(
        isinstance(pair, list) and len(pair) == 2 for pair in body
    ):
        raise ValueError("$dict holds something other than a list of [key, value] pairs")
    out = {}
    for raw_key, item in body:
        key = _dec(raw_key)
        if key in out:
            raise ValueError(f"$dict repeats the key {key!r}")
        out[key] = _dec(item)
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


def encode(value: Any, key: str, *, allow_pickle: bool) -> tuple[str, bytes]:
    """(codec, bytes) for a value: JSON when plain, pickle only when allowed."""
    try:
        return JSON, encode_plain(value, key)
    except NotPlainError as e:
        if not allow_pickle:
            raise InvalidArgumentError(
                f"cannot save {key!r}: {e}. trainsnap stores tensors and plain data (None, bool, "
                "int, float, str, bytes, list, tuple, dict) so that loading never runs code. "
                "Convert it to plain data or a tensor, wrap it in an object with state_dict()/"
                "load_state_dict(), or pass allow_pickle=True to save it with pickle.",
                key=key,
            ) from e
        return PICKLE, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def decode(codec: str, data: bytes, key: str, *, allow_pickle: bool, snapshot_id: str) -> Any:
    if codec == JSON:
        try:
            return _dec(json.loads(data))
        except (ValueError, TypeError, KeyError, RecursionError) as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else e
            raise IncompatibleError(
                f"value {key!r} of snapshot {snapshot_id} is not valid trainsnap JSON: {why}",
                snapshot_id=snapshot_id,
                key=key,
            ) from e
    if codec == PICKLE:
        if not allow_pickle:
            raise IncompatibleError(
                f"value {key!r} of snapshot {snapshot_id} was saved with pickle; loading it would "
                "run code from the snapshot. Pass allow_pickle=True to load only if you trust "
                "whoever wrote this snapshot.",
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


def _dtype_table() -> dict[str, torch.dtype]:
    names = [
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "complex128",
        "complex64",
        "complex32",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint64",
        "uint32",
        "uint16",
        "uint8",
        "bool",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    ]
    table = {}
    for n in names:
        dt = getattr(torch, n, None)
        if isinstance(dt, torch.dtype):
            table[n] = dt
    return table


_DTYPES: Final = _dtype_table()
_NAMES: Final = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise InvalidArgumentError(
            f"dtype {dtype} is not supported by trainsnap; supported: {sorted(_DTYPES)}"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise IncompatibleError(
            f"dtype {name!r} is unknown to this trainsnap/torch; upgrade them to read it"
        ) from None


def itemsize(name: str) -> int:
    return dtype_from_name(name).itemsize
