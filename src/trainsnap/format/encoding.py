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
import re
import struct
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from trainsnap.errors import CorruptError, IncompatibleError, TrainsnapError
from trainsnap.format.checksums import Hasher
from trainsnap.format.manifest import (
    BOX,
    FLAT,
    FORMAT,
    FORMAT_VERSION,
    I64,
    LEVELS,
    OBJECT_CODECS,
    READABLE_VERSIONS,
    VALUE_CODECS,
    Manifest,
    check_snapshot_id,
)
from trainsnap.format.values import itemsize

_HEX_RE: Final = re.compile(r"[0-9a-f]+")


def as_dict(value: object, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what}: expected an object")
    return value


# -- encoding -------------------------------------------------------------------------------------

MAGIC: Final = b"\x89TSNAPM\n"
"""The first 8 bytes of a format-3 manifest (formats 1 and 2 are JSON: they start with ``{``)."""
_HEAD: Final = struct.Struct("<8sQ")  # magic, header length


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
    if n > len(data) - _HEAD.size:
        raise ValueError(f"header of {n} bytes runs past the end of the {len(data)}-byte manifest")
    doc = json.loads(data[_HEAD.size : _HEAD.size + n])
    if not isinstance(doc, dict):
        raise ValueError("the header is not a JSON object")
    return doc, memoryview(data)[_HEAD.size + n :]


def encode(manifest: Manifest) -> bytes:
    """The manifest in the current format (3): a JSON header and a binary body of tables."""
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
        if data[:8] == MAGIC:
            doc, body = unpack(data)
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


# -- validation -----------------------------------------------------------------------------------


def validate(manifest: Manifest) -> list[str]:
    """Every structural problem of a decoded manifest (empty when sound).

    Checks types, ranges and cross-table consistency with vectorised tests; shard tiling per
    tensor is checked by :func:`trainsnap.verify` and, for what it reads, by every load.
    Unknown algorithms and codecs raise :class:`IncompatibleError` (a newer writer), the rest is
    reported as corruption.
    """
    p: list[str] = []
    Hasher(manifest.algorithm, max(manifest.block_size, 1))  # raises IncompatibleError when unknown
    if not 64 <= manifest.block_size <= 1 << 30:
        p.append(f"block_size {manifest.block_size} outside [64, 2^30]")
        return p
    if manifest.level not in LEVELS:
        p.append(f"level {manifest.level!r} is not one of {LEVELS}")
    if manifest.step < 0:
        p.append(f"step {manifest.step} is negative")
    world = manifest.topology.get("world_size", 1)
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= 1 << 24:
        p.append(f"topology.world_size {world!r} is not a positive integer")
    for c in set(manifest.object_codecs) - set(OBJECT_CODECS):
        raise IncompatibleError(f"object codec {c!r} unknown to this trainsnap; upgrade it")
    for c in set(manifest.value_codecs) - set(VALUE_CODECS):
        raise IncompatibleError(f"value codec {c!r} unknown to this trainsnap; upgrade it")
    bounds = _bounds_problems(manifest)
    if bounds:  # later checks sum and index with these numbers: they must not wrap
        return p + bounds
    p += _validate_objects(manifest)
    p += _validate_tables(manifest)
    return p


_LIMIT = 1 << 62
"""Every size, offset, length and count of a manifest is below this, and so is every sum the
validation forms, so that no int64 arithmetic on them can wrap (a crafted manifest would
otherwise pass checks by overflow, or drive numpy past its buffers)."""
MAX_NDIM = 64
"""Most dimensions a tensor may have (torch's own limit)."""


def _bounds_problems(manifest: Manifest) -> list[str]:
    """Ranges of every number before any arithmetic: counts no larger than the table they
    count, sizes and offsets in ``[0, 2^62)``, totals (summed as floats, which cannot wrap)
    below ``2^62``."""
    nshards, nchunks = len(manifest.shard_kind), len(manifest.chunk_object)
    columns: list[tuple[str, npt.NDArray[np.int64], int]] = [
        ("objects.sizes", manifest.object_sizes, _LIMIT),
        ("objects.stored", manifest.object_stored, _LIMIT),
        ("objects.frames", manifest.frames, 2 * manifest.block_size + 4096),
        ("tensors.nshards", manifest.tensor_nshards, nshards),
        ("shards.nchunks", manifest.shard_nchunks, nchunks),
        ("values.nchunks", manifest.value_nchunks, nchunks),
        ("chunks.offset", manifest.chunk_offset, _LIMIT),
        ("chunks.length", manifest.chunk_length, _LIMIT),
        ("shards.geometry", manifest.shard_geo, _LIMIT),
    ]
    for name, column, top in columns:
        if len(column) and (int(column.min()) < 0 or int(column.max()) > top):
            return [f"{name} holds a number outside [0, {top}]"]
    for name, column in (
        ("object sizes", manifest.object_sizes),
        ("chunk lengths", manifest.chunk_length),
        ("tensor counts", np.concatenate([manifest.tensor_nshards, manifest.value_nchunks])),
    ):
        if float(np.sum(column, dtype=np.float64)) >= _LIMIT:
            return [f"the {name} add up to 2^62 or more"]
    return _shape_problems(manifest)


def _shape_problems(manifest: Manifest) -> list[str]:
    for key, shape in zip(manifest.tensor_keys, manifest.tensor_shapes, strict=False):
        if len(shape) > MAX_NDIM:
            return [f"tensor {key!r} has {len(shape)} dimensions (at most {MAX_NDIM})"]
        numel = 1
        for n in shape:  # Python ints: exact
            if not 0 <= n < _LIMIT:
                return [f"tensor {key!r} has a dimension {n} outside [0, 2^62)"]
            numel *= n
        if numel * 16 >= _LIMIT:
            return [f"tensor {key!r} of shape {list(shape)} is larger than 2^58 elements"]
    return []


def _validate_objects(manifest: Manifest) -> list[str]:
    p = []
    n = len(manifest.object_names)
    if len(manifest.object_sizes) != n or len(manifest.object_codecs) != n:
        return [f"objects table columns disagree in length ({n} names)"]
    width = manifest.hasher.name_length()
    if manifest.format_version == 1:  # format 2 names are made from raw digest bytes: hex by design
        bad = [x for x in manifest.object_names if len(x) != width or not _HEX_RE.fullmatch(x)]
        if bad:
            p.append(
                f"{len(bad)} object names are not {width}-digit lowercase hex, e.g. {bad[0]!r}"
            )
    if len(set(manifest.object_names)) != n:
        p.append("object names repeat")
    if n and int(manifest.object_sizes.min()) < 0:
        p.append("an object has a negative size")
        return p
    nblocks = int(manifest.block_start()[-1])
    if len(manifest.blocks) != nblocks * manifest.hasher.digest_size:
        p.append(
            f"{len(manifest.blocks)} bytes of block digests, expected {nblocks} x "
            f"{manifest.hasher.digest_size}"
        )
    return p + _validate_frames(manifest)


def _validate_frames(manifest: Manifest) -> list[str]:
    """Compressed objects: one frame per block, frames adding up to the stored size
    (vectorised: half a million objects)."""
    stored = manifest.stored()
    if len(stored) != len(manifest.object_sizes) or (len(stored) and int(stored.min()) < 0):
        return ["objects.stored disagrees with the object table"]
    mask = manifest.compressed_mask()
    if not np.array_equal(stored[~mask], manifest.object_sizes[~mask]):
        return ["a raw object's stored size differs from its size"]
    cb = manifest._compressed_block_start()
    ncb = int(cb[-1])
    if len(manifest.frames) != ncb or len(manifest.raw_blocks) != ncb * manifest.hasher.digest_size:
        return [f"{len(manifest.frames)} frames for {ncb} compressed blocks"]
    if not ncb:
        return []
    if int(manifest.frames.min()) <= 0:
        return ["a compressed frame has no bytes"]
    sums = np.zeros(len(manifest.frames) + 1, np.int64)
    np.cumsum(manifest.frames, out=sums[1:])
    per_object = sums[cb[1:]] - sums[cb[:-1]]
    bad = np.nonzero(mask & (per_object != stored))[0]
    if len(bad):
        return [
            f"object {manifest.object_names[int(bad[0])]}: frames do not add up to its stored size"
        ]
    return []


def _validate_tables(manifest: Manifest) -> list[str]:
    p = []
    nt, ns, nv = len(manifest.tensor_keys), len(manifest.shard_kind), len(manifest.value_keys)
    if not (
        len(manifest.tensor_ranks)
        == len(manifest.tensor_dtypes)
        == len(manifest.tensor_shapes)
        == nt
    ):
        return ["tensor table columns disagree in length"]
    if len(manifest.tensor_nshards) != nt or int(manifest.tensor_nshards.sum()) != ns:
        return ["tensors' shard counts do not add up to the shard table"]
    if not (
        len(manifest.value_ranks) == len(manifest.value_codecs) == len(manifest.value_nchunks) == nv
    ):
        return ["value table columns disagree in length"]
    if len(manifest.shard_nchunks) != ns:
        return ["shard table columns disagree in length"]
    nc = len(manifest.chunk_object)
    if len(manifest.chunk_offset) != nc or len(manifest.chunk_length) != nc:
        return ["chunk table columns disagree in length"]
    counts = np.concatenate(
        [manifest.tensor_nshards, manifest.shard_nchunks, manifest.value_nchunks]
    )
    if len(counts) and int(counts.min()) < 0:
        return ["a negative count in the tensor, shard or value table"]
    if int(manifest.shard_nchunks.sum()) + int(manifest.value_nchunks.sum()) != nc:
        return ["shards' and values' chunk counts do not add up to the chunk table"]
    if nc:
        no = len(manifest.object_names)
        if int(manifest.chunk_object.min()) < 0 or int(manifest.chunk_object.max()) >= no:
            return ["a chunk names an object index outside the object table"]
        if int(manifest.chunk_offset.min()) < 0 or int(manifest.chunk_length.min()) <= 0:
            return ["a chunk has a negative offset or a non-positive length"]
        ends = manifest.chunk_offset + manifest.chunk_length
        if bool((ends > manifest.object_sizes[manifest.chunk_object]).any()):
            return ["a chunk extends past the end of its object"]
    if len({*zip(manifest.tensor_keys, manifest.tensor_ranks.tolist(), strict=True)}) != nt:
        p.append("a (key, rank) pair names two tensors")
    if len({*zip(manifest.value_keys, manifest.value_ranks.tolist(), strict=True)}) != nv:
        p.append("a (key, rank) pair names two values")
    if (nt and int(manifest.tensor_ranks.min()) < -1) or (
        nv and int(manifest.value_ranks.min()) < -1
    ):
        p.append("a rank below -1")
    if "" in manifest.tensor_keys or "" in manifest.value_keys:
        p.append("an empty key")
    if any(n < 0 for s in manifest.tensor_shapes for n in s):
        p.append("a negative dimension in a tensor shape")
    if ns and not np.isin(manifest.shard_kind, (BOX, FLAT)).all():
        return [*p, "a shard kind other than 0 (box) or 1 (flat)"]
    if p:
        return p
    return _validate_shard_bytes(manifest)


def _validate_shard_bytes(manifest: Manifest) -> list[str]:
    """Each shard's geometry fits its tensor and its chunks hold exactly its bytes (vectorised:
    a manifest of a million shards validates in a fraction of a second)."""
    geo_start = manifest.geo_start()
    if int(geo_start[-1]) != len(manifest.shard_geo):
        return [
            f"shard geometry has {len(manifest.shard_geo)} numbers, expected {int(geo_start[-1])}"
        ]
    try:
        isz = np.array([itemsize(d) for d in manifest.tensor_dtypes], np.int64)
    except TrainsnapError as e:
        return [str(e)]
    nt = len(manifest.tensor_shapes)
    ndim = np.array([len(s) for s in manifest.tensor_shapes], np.int64)
    maxdim = int(ndim.max()) if nt else 0
    shapes = np.zeros((nt, maxdim), np.int64)
    for t, s in enumerate(manifest.tensor_shapes):
        shapes[t, : len(s)] = s
    numel_t = np.prod(np.where(np.arange(maxdim) < ndim[:, None], shapes, 1), axis=1)
    owner = np.repeat(np.arange(nt), manifest.tensor_nshards)
    g0, nd, flat = geo_start[:-1], ndim[owner], manifest.shard_kind == FLAT
    geo = manifest.shard_geo
    ok = np.ones(len(owner), bool)
    numel = np.ones(len(owner), np.int64)
    if flat.any():
        start, length = geo[g0[flat]], geo[g0[flat] + 1]
        ok[flat] = (start >= 0) & (length >= 0) & (start + length <= numel_t[owner[flat]])
        numel[flat] = length
    for d in range(maxdim):
        sel = ~flat & (nd > d)
        if not sel.any():
            continue
        off, size = geo[g0[sel] + d], geo[g0[sel] + nd[sel] + d]
        ok[sel] &= (off >= 0) & (size >= 0) & (off + size <= shapes[owner[sel], d])
        numel[sel] *= size
    if not ok.all():
        t = int(owner[int(np.argmin(ok))])
        return [
            f"tensor {manifest.tensor_keys[t]!r} has a shard outside its shape "
            f"{manifest.tensor_shapes[t]}"
        ]
    clen = np.zeros(len(manifest.chunk_length) + 1, np.int64)
    np.cumsum(manifest.chunk_length, out=clen[1:])
    cs = manifest.chunk_start()[: len(owner) + 1]
    stored = clen[cs[1:]] - clen[cs[:-1]]
    bad = np.nonzero(stored != numel * isz[owner])[0]
    if len(bad):
        first = int(bad[0])
        want = int(numel[first] * isz[owner[first]])
        return [
            f"tensor {manifest.tensor_keys[int(owner[first])]!r}: a shard holds {want} bytes "
            f"but its chunks hold {int(stored[first])}"
        ]
    return []
