"""Encoding, decoding and validation of manifests (a JSON header and its columnar tables).

Pure: no I/O. Scalars and small tables are plain JSON; the large tables (shards, chunks, block
digests) are little-endian int64 arrays (or raw digest bytes) in a binary body after the header
(format 3; formats 1 and 2, still read, held them in base64 inside one JSON document), so that a
manifest of 10^5 tensors and 10^6 shards decodes in well under a second and every index is
checked with vectorised bounds tests.
Unknown versions, algorithms and codecs are :class:`IncompatibleError` (a newer writer); anything
else malformed is :class:`CorruptError`.
"""

from __future__ import annotations

import base64
import json
import struct
from typing import Any, Final

import numpy as np

from trainsnap.errors import CorruptError, IncompatibleError, TrainsnapError
from trainsnap.format.checksums import Hasher
from trainsnap.format.manifest import (
    FORMAT,
    FORMAT_VERSION,
    I64,
    OBJECT_CODECS,
    READABLE_VERSIONS,
    Manifest,
    check_snapshot_id,
)
from trainsnap.format.validation import validate


def as_dict(value: object, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what}: expected an object")
    return value


# -- encoding -------------------------------------------------------------------------------------

MAGIC: Final = b"\x89TSNAPM\n"
"""The first 8 bytes of a format-3 manifest (formats 1 and 2 are JSON: they start with ``{``)."""
_HEAD: Final = struct.Struct("<8sQ")  # magic, header length
MAX_MANIFEST: Final = 256 << 20
"""Largest manifest read (a marker recording a larger one is refused before it is read): a
manifest of 10^6 shards is about 80 MiB, and a reader's memory grows with the rows (FORMAT.md
§8 gives the peak at this cap)."""
MAX_HEADER: Final = 64 << 20
"""Largest JSON part of a manifest (keys, tree, small tables); the large tables are binary."""


class _Tables:
    """Format 3: the large columns, laid end to end (each aligned to 8 bytes) in the body that
    follows the JSON header; the header refers to each by ``{"offset", "length"}`` in bytes."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, data: bytes) -> dict[str, int]:
        ref = {"offset": self.size, "length": len(data)}
        pad = -len(data) % 8
        self.parts += [data, bytes(pad)] if pad else [data]
        self.size += len(data) + pad
        return ref

    def i64(self, array: I64) -> dict[str, int]:
        return self.add(np.ascontiguousarray(array, dtype="<i8").tobytes())


def pack(doc: dict[str, Any], body: bytes | list[bytes]) -> bytes:
    """A format-3 manifest from its header document and its body (the tables).

    The header is padded with spaces so that the body starts at a multiple of 8 bytes."""
    header = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    header += b" " * (-(_HEAD.size + len(header)) % 8)
    return b"".join(
        [_HEAD.pack(MAGIC, len(header)), header, *([body] if isinstance(body, bytes) else body)]
    )


def unpack(data: bytes) -> tuple[dict[str, Any], memoryview]:
    """The header document and the body of a format-3 manifest (``ValueError`` if it is not
    one)."""
    if len(data) < _HEAD.size or data[:8] != MAGIC:
        raise ValueError("not a binary trainsnap manifest (bad magic)")
    _, n = _HEAD.unpack_from(data)
    if n > MAX_HEADER:
        raise ValueError(f"header of {n} bytes, more than a header may be ({MAX_HEADER})")
    if n > len(data) - _HEAD.size:
        raise ValueError(f"header of {n} bytes runs past the end of the {len(data)}-byte manifest")
    doc = json.loads(data[_HEAD.size : _HEAD.size + n])
    if not isinstance(doc, dict):
        raise ValueError("the header is not a JSON object")
    return doc, memoryview(data)[_HEAD.size + n :]


def encode(manifest: Manifest) -> bytes:
    """The manifest in the current format (4): a JSON header and a binary body of tables."""
    t = _Tables()
    doc = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "snapshot_id": manifest.snapshot_id,
        "created": manifest.created,
        "step": manifest.step,
        "tokens_seen": manifest.tokens_seen,
        "samples_seen": manifest.samples_seen,
        "data_cursor": manifest.data_cursor,
        "level": manifest.level,
        "state_kinds": manifest.state_kinds,
        "versions": manifest.versions,
        "topology": manifest.topology,
        "parent": manifest.parent,
        "meta": manifest.meta,
        "tree": manifest.tree,
        "checksum": {"algorithm": manifest.algorithm, "block_size": manifest.block_size},
        "objects": {
            "names": t.add(bytes.fromhex("".join(manifest.object_names))),
            "sizes": t.i64(manifest.object_sizes),
            "stored": t.i64(manifest.stored()),
            "codecs": t.i64(
                np.array([OBJECT_CODECS.index(c) for c in manifest.object_codecs], np.int64)
            ),
            "blocks": t.add(manifest.blocks),
            "frames": t.i64(manifest.frames),
            "raw_blocks": t.add(manifest.raw_blocks),
        },
        "chunks": {
            "object": t.i64(manifest.chunk_object),
            "offset": t.i64(manifest.chunk_offset),
            "length": t.i64(manifest.chunk_length),
        },
        "tensors": {
            "keys": manifest.tensor_keys,
            "ranks": t.i64(manifest.tensor_ranks),
            "dtypes": manifest.tensor_dtypes,
            "ndim": t.i64(np.array([len(s) for s in manifest.tensor_shapes], np.int64)),
            "dims": t.i64(np.array([d for s in manifest.tensor_shapes for d in s], np.int64)),
            "nshards": t.i64(manifest.tensor_nshards),
        },
        "shards": {
            "kind": t.i64(manifest.shard_kind),
            "geo": t.i64(manifest.shard_geo),
            "nchunks": t.i64(manifest.shard_nchunks),
        },
        "values": {
            "keys": manifest.value_keys,
            "ranks": t.i64(manifest.value_ranks),
            "codecs": manifest.value_codecs,
            "nchunks": t.i64(manifest.value_nchunks),
        },
    }
    return pack(doc, t.parts)


# -- decoding -------------------------------------------------------------------------------------


class _Columns:
    """Reads the large columns of a manifest: base64 strings in formats 1 and 2, references
    into the binary body in format 3."""

    def __init__(self, body: memoryview | None) -> None:
        self.body = body

    def view(self, value: object, what: str) -> bytes | memoryview:
        if self.body is None:
            if not isinstance(value, str):
                raise ValueError(f"{what}: expected a base64 string")
            return base64.b64decode(value, validate=True)
        if not isinstance(value, dict) or set(value) != {"offset", "length"}:
            raise ValueError(f"{what}: expected a table reference {{offset, length}}")
        o, n = value["offset"], value["length"]
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (o, n)):
            raise ValueError(f"{what}: offset and length must be non-negative integers")
        if o + n > len(self.body):
            raise ValueError(
                f"{what}: bytes [{o}, {o + n}) run past the end of the {len(self.body)}-byte body"
            )
        return self.body[o : o + n]

    def raw(self, value: object, what: str) -> bytes:
        return bytes(self.view(value, what))

    def i64(self, value: object, what: str) -> I64:
        raw = self.view(value, what)
        if len(raw) % 8:
            raise ValueError(f"{what}: {len(raw)} bytes is not a whole number of int64")
        return np.frombuffer(raw, dtype="<i8").astype(np.int64)


def _decode_objects(
    objs: dict[str, Any], version: int, algorithm: str, cols: _Columns
) -> dict[str, Any]:
    if version == 1:
        return {
            "object_names": _strs(objs["names"], "objects.names"),
            "object_sizes": cols.i64(objs["sizes"], "objects.sizes"),
            "object_codecs": _strs(objs["codecs"], "objects.codecs"),
            "blocks": cols.raw(objs["blocks"], "objects.blocks"),
        }
    width = Hasher(algorithm).digest_size
    raw = cols.view(objs["names"], "objects.names")
    if len(raw) % width:
        raise ValueError(f"objects.names: {len(raw)} bytes is not a whole number of digests")
    hexed = raw.hex()
    step = 2 * width
    ids = cols.i64(objs["codecs"], "objects.codecs")
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= len(OBJECT_CODECS)):
        raise IncompatibleError("an object codec unknown to this trainsnap; upgrade it")
    return {
        "object_names": [hexed[i : i + step] for i in range(0, len(hexed), step)],
        "object_sizes": cols.i64(objs["sizes"], "objects.sizes"),
        "object_stored": cols.i64(objs["stored"], "objects.stored"),
        "object_codecs": np.array(OBJECT_CODECS, dtype=object)[ids].tolist(),
        "blocks": cols.raw(objs["blocks"], "objects.blocks"),
        "frames": cols.i64(objs["frames"], "objects.frames"),
        "raw_blocks": cols.raw(objs["raw_blocks"], "objects.raw_blocks"),
    }


def decode(data: bytes, *, snapshot_id: str | None = None) -> Manifest:
    """Parse and validate; raise :class:`IncompatibleError` for a format this reader does not
    know and :class:`CorruptError` for anything malformed."""
    sid = snapshot_id or "?"
    body: memoryview | None = None
    try:
        if len(data) > MAX_MANIFEST:
            raise ValueError(f"{len(data)} bytes, more than a manifest may be ({MAX_MANIFEST})")
        if data[:8] == MAGIC:
            doc, body = unpack(data)
        elif len(data) > MAX_HEADER:  # formats 1 and 2: all JSON
            raise ValueError(f"{len(data)} bytes of JSON, more than a header may be")
        else:
            doc = json.loads(data)
    except RecursionError:
        raise CorruptError(
            f"manifest of snapshot {sid} is not a valid manifest: its header is nested too deeply",
            snapshot_id=snapshot_id,
        ) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptError(
            f"manifest of snapshot {sid} is not a valid manifest: {e}", snapshot_id=snapshot_id
        ) from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptError(f"manifest of snapshot {sid} is not a trainsnap manifest")
    version = doc.get("format_version")
    if version not in READABLE_VERSIONS:
        raise IncompatibleError(
            f"snapshot {sid} has manifest format version {version!r}; this trainsnap reads "
            f"versions {list(READABLE_VERSIONS)}. Upgrade trainsnap to read it.",
            snapshot_id=snapshot_id,
        )
    if (body is None) != (version < 3):
        raise CorruptError(
            f"manifest of snapshot {sid} claims format version {version} but is "
            f"{'JSON' if body is None else 'binary'}",
            snapshot_id=snapshot_id,
        )
    try:
        m = _from_doc(doc, _Columns(body))
    except TrainsnapError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise CorruptError(
            f"manifest of snapshot {sid} is malformed: {type(e).__name__}: {e}",
            snapshot_id=snapshot_id,
        ) from e
    problems = validate(m)
    if problems:
        raise CorruptError(
            f"manifest of snapshot {sid} is inconsistent",
            snapshot_id=snapshot_id,
            problems=problems,
        )
    if snapshot_id is not None and m.snapshot_id != snapshot_id:
        raise CorruptError(
            f"manifest under snapshot {snapshot_id} names itself {m.snapshot_id!r}",
            snapshot_id=snapshot_id,
        )
    return m


def _strs(value: object, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise ValueError(f"{what}: expected a list of strings")
    return value


def _opt_int(value: object, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what}: expected an integer or null")
    return value


def _decode_shapes(tens: dict[str, Any], version: int, cols: _Columns) -> list[tuple[int, ...]]:
    """Formats 2 and 3 store shapes as two int64 columns (rank of each tensor, all dimensions)."""
    if version == 1:
        shapes = tens["shapes"]
        if not isinstance(shapes, list) or not all(
            isinstance(s, list) and all(isinstance(n, int) and not isinstance(n, bool) for n in s)
            for s in shapes
        ):
            raise ValueError("tensors.shapes: expected a list of integer lists")
        return [tuple(s) for s in shapes]
    ndim = cols.i64(tens["ndim"], "tensors.ndim")
    dims = cols.i64(tens["dims"], "tensors.dims").tolist()
    if len(ndim) and (int(ndim.min()) < 0 or int(ndim.sum()) != len(dims)):
        raise ValueError("tensors.ndim and tensors.dims disagree")
    ends = np.cumsum(ndim).tolist()
    starts = [0, *ends][: len(ends)]
    return [tuple(dims[a:b]) for a, b in zip(starts, ends, strict=True)]


def _from_doc(doc: dict[str, Any], cols: _Columns) -> Manifest:
    ck = as_dict(doc["checksum"], "checksum")
    objs = as_dict(doc["objects"], "objects")
    ch = as_dict(doc["chunks"], "chunks")
    tens = as_dict(doc["tensors"], "tensors")
    sh = as_dict(doc["shards"], "shards")
    vals = as_dict(doc["values"], "values")
    shapes = _decode_shapes(tens, int(doc["format_version"]), cols)
    kinds = as_dict(doc["state_kinds"], "state_kinds")
    step = doc["step"]
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError("step: expected an integer")
    for name in ("created", "level"):
        if not isinstance(doc[name], str):
            raise ValueError(f"{name}: expected a string")
    parent = doc.get("parent")
    if parent is not None:
        check_snapshot_id(parent)
    objects = _decode_objects(objs, int(doc["format_version"]), str(ck["algorithm"]), cols)
    return Manifest(
        format_version=doc["format_version"],
        snapshot_id=check_snapshot_id(doc["snapshot_id"]),
        created=doc["created"],
        step=step,
        level=doc["level"],
        algorithm=str(ck["algorithm"]),
        block_size=_opt_int(ck["block_size"], "checksum.block_size") or 0,
        tokens_seen=_opt_int(doc.get("tokens_seen"), "tokens_seen"),
        samples_seen=_opt_int(doc.get("samples_seen"), "samples_seen"),
        data_cursor=doc.get("data_cursor"),
        state_kinds={str(k): bool(v) for k, v in kinds.items()},
        versions=as_dict(doc["versions"], "versions"),
        topology=as_dict(doc["topology"], "topology"),
        parent=parent,
        meta=as_dict(doc.get("meta", {}), "meta"),
        tree=doc.get("tree") if int(doc["format_version"]) >= 4 else None,
        **objects,
        chunk_object=cols.i64(ch["object"], "chunks.object"),
        chunk_offset=cols.i64(ch["offset"], "chunks.offset"),
        chunk_length=cols.i64(ch["length"], "chunks.length"),
        tensor_keys=_strs(tens["keys"], "tensors.keys"),
        tensor_ranks=cols.i64(tens["ranks"], "tensors.ranks"),
        tensor_dtypes=_strs(tens["dtypes"], "tensors.dtypes"),
        tensor_shapes=shapes,
        tensor_nshards=cols.i64(tens["nshards"], "tensors.nshards"),
        shard_kind=cols.i64(sh["kind"], "shards.kind"),
        shard_geo=cols.i64(sh["geo"], "shards.geo"),
        shard_nchunks=cols.i64(sh["nchunks"], "shards.nchunks"),
        value_keys=_strs(vals["keys"], "values.keys"),
        value_ranks=cols.i64(vals["ranks"], "values.ranks"),
        value_codecs=_strs(vals["codecs"], "values.codecs"),
        value_nchunks=cols.i64(vals["nchunks"], "values.nchunks"),
    )
