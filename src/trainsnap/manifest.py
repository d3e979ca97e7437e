"""The manifest and the marker: schema, compact encoding, validation.

Pure: no I/O. The manifest is one JSON document. Scalars and small tables are plain JSON; the
large tables (shards, chunks, block digests) are columnar little-endian integer arrays in base64,
so that a manifest of 10^5 tensors and 10^6 shards decodes in well under a second and every
index can be checked with vectorised bounds tests. FORMAT.md is the normative description.

Tables and how they chain (all indices 0-based):

* ``tensors``: key, rank (-1 for global), dtype, shape, ``nshards``. Tensor ``t`` owns the next
  ``nshards[t]`` rows of ``shards`` (in tensor order).
* ``shards``: ``kind`` (0 box, 1 flat), ``geo`` (box: offsets then sizes; flat: start, length),
  ``nchunks``. A shard's bytes (its elements in its own row-major order) are the concatenation
  of its next ``nchunks`` rows of ``chunks``.
* ``values``: key, rank, codec, ``nchunks``: their chunks follow all the tensors' chunks.
* ``chunks``: ``object``, ``offset``, ``length``: a byte range of one object.
* ``objects``: name, size, codec. Object ``o`` is covered by ``ceil(size / block_size)`` digests
  in ``blocks``, in object order.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from .checksum import Hasher
from .codec import itemsize
from .errors import CorruptError, IncompatibleError, TrainsnapError
from .spec import Box, Flat, Region, Shape

FORMAT: Final = "trainsnap.manifest"
MARKER_FORMAT: Final = "trainsnap.marker"
FORMAT_VERSION: Final = 1
LEVELS: Final = ("weights", "training", "strict")
STATE_KINDS: Final = ("model", "optimizer", "scheduler", "scaler", "rng", "data", "extra")
OBJECT_CODECS: Final = ("raw",)
VALUE_CODECS: Final = ("json", "pickle")

BOX: Final = 0
FLAT: Final = 1

_ID_RE: Final = re.compile(r"^step-[0-9]{12,20}-[0-9a-z]{4,32}$")
_HEX_RE: Final = re.compile(r"^[0-9a-f]+$")

I64 = npt.NDArray[np.int64]


def check_snapshot_id(snapshot_id: object) -> str:
    """The id if it is well formed; a crafted id could otherwise name a path outside the root."""
    if not isinstance(snapshot_id, str) or not _ID_RE.match(snapshot_id):
        raise IncompatibleError(
            f"{snapshot_id!r} is not a trainsnap snapshot id (expected step-<12 digits>-<suffix>)",
            snapshot_id=str(snapshot_id),
        )
    return snapshot_id


def object_key(name: str) -> str:
    """Storage key of an object, fanned out by its first two hex digits."""
    return f"objects/{name[:2]}/{name}"


def manifest_key(snapshot_id: str) -> str:
    return f"snapshots/{snapshot_id}/manifest.json"


def marker_key(snapshot_id: str) -> str:
    return f"snapshots/{snapshot_id}/COMMITTED"


@dataclass(slots=True, kw_only=True)
class Manifest:
    """A decoded manifest. Build it with :class:`ManifestBuilder`; read it with :func:`decode`."""

    snapshot_id: str
    created: str
    step: int
    level: str
    algorithm: str
    block_size: int
    tokens_seen: int | None = None
    samples_seen: int | None = None
    data_cursor: Any = None
    state_kinds: dict[str, bool] = field(default_factory=lambda: dict.fromkeys(STATE_KINDS, False))
    versions: dict[str, Any] = field(default_factory=dict)
    topology: dict[str, Any] = field(default_factory=dict)
    parent: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    # objects
    object_names: list[str] = field(default_factory=list)
    object_sizes: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    object_codecs: list[str] = field(default_factory=list)
    blocks: bytes = b""
    # chunks
    chunk_object: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    chunk_offset: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    chunk_length: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    # tensors and shards
    tensor_keys: list[str] = field(default_factory=list)
    tensor_ranks: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    tensor_dtypes: list[str] = field(default_factory=list)
    tensor_shapes: list[Shape] = field(default_factory=list)
    tensor_nshards: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    shard_kind: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    shard_geo: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    shard_nchunks: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    # values
    value_keys: list[str] = field(default_factory=list)
    value_ranks: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    value_codecs: list[str] = field(default_factory=list)
    value_nchunks: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    # derived on demand
    _derived: dict[str, Any] = field(default_factory=dict, repr=False)

    # -- derived indices ---------------------------------------------------------------------

    def _prefix(self, name: str, counts: I64) -> I64:
        if name not in self._derived:
            out = np.zeros(len(counts) + 1, np.int64)
            np.cumsum(counts, out=out[1:])
            self._derived[name] = out
        result: I64 = self._derived[name]
        return result

    @property
    def hasher(self) -> Hasher:
        if "hasher" not in self._derived:
            self._derived["hasher"] = Hasher(self.algorithm, self.block_size)
        h: Hasher = self._derived["hasher"]
        return h

    def shard_start(self) -> I64:
        return self._prefix("shard_start", self.tensor_nshards)

    def chunk_start(self) -> I64:
        """Prefix over shards then values: shard ``s`` owns ``chunk_start[s]:chunk_start[s+1]``."""
        return self._prefix("chunk_start", np.concatenate([self.shard_nchunks, self.value_nchunks]))

    def block_start(self) -> I64:
        b = self.block_size
        return self._prefix("block_start", (self.object_sizes + (b - 1)) // b)

    def geo_start(self) -> I64:
        if "geo_start" not in self._derived:
            ndim = np.array([len(s) for s in self.tensor_shapes], np.int64)
            per_shard = np.repeat(ndim, self.tensor_nshards)
            width = np.where(self.shard_kind == FLAT, 2, 2 * per_shard)
            self._derived["geo_start"] = self._prefix("_geo", width)
        g: I64 = self._derived["geo_start"]
        return g

    def tensor_index(self) -> dict[tuple[str, int], int]:
        if "tindex" not in self._derived:
            self._derived["tindex"] = {
                (k, int(r)): i
                for i, (k, r) in enumerate(zip(self.tensor_keys, self.tensor_ranks, strict=True))
            }
        idx: dict[tuple[str, int], int] = self._derived["tindex"]
        return idx

    def value_index(self) -> dict[tuple[str, int], int]:
        if "vindex" not in self._derived:
            self._derived["vindex"] = {
                (k, int(r)): i
                for i, (k, r) in enumerate(zip(self.value_keys, self.value_ranks, strict=True))
            }
        idx: dict[tuple[str, int], int] = self._derived["vindex"]
        return idx

    def find_tensor(self, key: str, rank: int) -> int | None:
        """The tensor saved under ``key`` as a global tensor, or as ``rank``'s own."""
        idx = self.tensor_index()
        found = idx.get((key, -1))
        return found if found is not None else idx.get((key, rank))

    def find_value(self, key: str, rank: int) -> int | None:
        idx = self.value_index()
        found = idx.get((key, -1))
        return found if found is not None else idx.get((key, rank))

    def shard_region(self, s: int, shape: Shape) -> Region:
        g0 = int(self.geo_start()[s])
        if int(self.shard_kind[s]) == FLAT:
            return Flat(int(self.shard_geo[g0]), int(self.shard_geo[g0 + 1]))
        n = len(shape)
        geo = self.shard_geo[g0 : g0 + 2 * n].tolist()
        return Box(tuple(geo[:n]), tuple(geo[n:]))

    def tensor_shards(self, t: int) -> list[tuple[int, Region]]:
        ss = self.shard_start()
        shape = self.tensor_shapes[t]
        return [(s, self.shard_region(s, shape)) for s in range(int(ss[t]), int(ss[t + 1]))]

    def value_chunk_base(self) -> int:
        return len(self.shard_kind)

    def chunks_of(self, owner: int) -> range:
        """Chunk rows of shard ``owner`` (or value ``owner - nshards``)."""
        cs = self.chunk_start()
        return range(int(cs[owner]), int(cs[owner + 1]))

    def object_blocks(self, o: int) -> bytes:
        bs = self.block_start()
        d = self.hasher.digest_size
        return self.blocks[int(bs[o]) * d : int(bs[o + 1]) * d]

    @property
    def nbytes(self) -> int:
        """Bytes stored: the sum of the sizes of the objects it references."""
        return int(self.object_sizes.sum())

    def summary(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "created": self.created,
            "level": self.level,
            "nbytes": self.nbytes,
            "tokens_seen": self.tokens_seen,
        }


# -- building -------------------------------------------------------------------------------------


class ManifestBuilder:
    """Accumulates tables in append order; :meth:`build` turns them into a :class:`Manifest`."""

    def __init__(self, **header: Any) -> None:
        self.header = header
        self._objects: dict[str, int] = {}
        self.object_names: list[str] = []
        self.object_sizes: list[int] = []
        self.object_codecs: list[str] = []
        self.block_parts: list[bytes] = []
        self.tensors: list[tuple[str, int, str, Shape]] = []
        self.tensor_nshards: list[int] = []
        self.shard_kind: list[int] = []
        self.shard_geo: list[int] = []
        self.shard_chunks: list[list[tuple[int, int, int]]] = []
        self.values: list[tuple[str, int, str]] = []
        self.value_chunks: list[list[tuple[int, int, int]]] = []

    def add_object(self, name: str, size: int, digests: bytes, codec: str = "raw") -> int:
        """Index of the object, adding it on first sight (an object may back many chunks)."""
        found = self._objects.get(name)
        if found is not None:
            return found
        i = len(self.object_names)
        self._objects[name] = i
        self.object_names.append(name)
        self.object_sizes.append(size)
        self.object_codecs.append(codec)
        self.block_parts.append(digests)
        return i

    def add_tensor(self, key: str, rank: int, dtype: str, shape: Shape) -> int:
        self.tensors.append((key, rank, dtype, tuple(shape)))
        self.tensor_nshards.append(0)
        return len(self.tensors) - 1

    def add_shard(self, tensor: int, region: Region, chunks: list[tuple[int, int, int]]) -> None:
        """Shards must be added tensor by tensor, in tensor order."""
        assert tensor == len(self.tensors) - 1, "shards are added right after their tensor"
        self.tensor_nshards[tensor] += 1
        if isinstance(region, Flat):
            self.shard_kind.append(FLAT)
            self.shard_geo += (region.start, region.length)
        else:
            self.shard_kind.append(BOX)
            self.shard_geo += (*region.offsets, *region.sizes)
        self.shard_chunks.append(chunks)

    def add_value(self, key: str, rank: int, codec: str, chunks: list[tuple[int, int, int]]) -> None:
        self.values.append((key, rank, codec))
        self.value_chunks.append(chunks)

    def build(self) -> Manifest:
        all_chunks = [c for cs in self.shard_chunks for c in cs] + [
            c for cs in self.value_chunks for c in cs
        ]
        carr = np.array(all_chunks, np.int64).reshape(-1, 3)
        return Manifest(
            **self.header,
            object_names=self.object_names,
            object_sizes=np.array(self.object_sizes, np.int64),
            object_codecs=self.object_codecs,
            blocks=b"".join(self.block_parts),
            chunk_object=np.ascontiguousarray(carr[:, 0]),
            chunk_offset=np.ascontiguousarray(carr[:, 1]),
            chunk_length=np.ascontiguousarray(carr[:, 2]),
            tensor_keys=[t[0] for t in self.tensors],
            tensor_ranks=np.array([t[1] for t in self.tensors], np.int64),
            tensor_dtypes=[t[2] for t in self.tensors],
            tensor_shapes=[t[3] for t in self.tensors],
            tensor_nshards=np.array(self.tensor_nshards, np.int64),
            shard_kind=np.array(self.shard_kind, np.int64),
            shard_geo=np.array(self.shard_geo, np.int64),
            shard_nchunks=np.array([len(c) for c in self.shard_chunks], np.int64),
            value_keys=[v[0] for v in self.values],
            value_ranks=np.array([v[1] for v in self.values], np.int64),
            value_codecs=[v[2] for v in self.values],
            value_nchunks=np.array([len(c) for c in self.value_chunks], np.int64),
        )


# -- encoding -------------------------------------------------------------------------------------


def _arr(a: I64) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype="<i8").tobytes()).decode("ascii")


def _unarr(s: object, what: str) -> I64:
    if not isinstance(s, str):
        raise ValueError(f"{what}: expected a base64 string")
    raw = base64.b64decode(s, validate=True)
    if len(raw) % 8:
        raise ValueError(f"{what}: {len(raw)} bytes is not a whole number of int64")
    return np.frombuffer(raw, dtype="<i8").astype(np.int64)


def encode(m: Manifest) -> bytes:
    doc = {
        "format": FORMAT,
        "format_version": m.format_version,
        "snapshot_id": m.snapshot_id,
        "created": m.created,
        "step": m.step,
        "tokens_seen": m.tokens_seen,
        "samples_seen": m.samples_seen,
        "data_cursor": m.data_cursor,
        "level": m.level,
        "state_kinds": m.state_kinds,
        "versions": m.versions,
        "topology": m.topology,
        "parent": m.parent,
        "meta": m.meta,
        "checksum": {"algorithm": m.algorithm, "block_size": m.block_size},
        "objects": {
            "names": m.object_names,
            "sizes": _arr(m.object_sizes),
            "codecs": m.object_codecs,
            "blocks": base64.b64encode(m.blocks).decode("ascii"),
        },
        "chunks": {
            "object": _arr(m.chunk_object),
            "offset": _arr(m.chunk_offset),
            "length": _arr(m.chunk_length),
        },
        "tensors": {
            "keys": m.tensor_keys,
            "ranks": _arr(m.tensor_ranks),
            "dtypes": m.tensor_dtypes,
            "shapes": [list(s) for s in m.tensor_shapes],
            "nshards": _arr(m.tensor_nshards),
        },
        "shards": {
            "kind": _arr(m.shard_kind),
            "geo": _arr(m.shard_geo),
            "nchunks": _arr(m.shard_nchunks),
        },
        "values": {
            "keys": m.value_keys,
            "ranks": _arr(m.value_ranks),
            "codecs": m.value_codecs,
            "nchunks": _arr(m.value_nchunks),
        },
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def decode(data: bytes, *, snapshot_id: str | None = None) -> Manifest:
    """Parse and validate; raise :class:`IncompatibleError` for a format this reader does not
    know and :class:`CorruptError` for anything malformed."""
    sid = snapshot_id or "?"
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptError(
            f"manifest of snapshot {sid} is not valid JSON: {e}", snapshot_id=snapshot_id
        ) from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptError(f"manifest of snapshot {sid} is not a trainsnap manifest")
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        raise IncompatibleError(
            f"snapshot {sid} has manifest format version {version!r}; this trainsnap reads "
            f"version {FORMAT_VERSION}. Upgrade trainsnap (newer formats) or convert the snapshot "
            "with an older trainsnap's `trainsnap migrate` (older formats).",
            snapshot_id=snapshot_id,
        )
    try:
        m = _from_doc(doc)
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


def _strs(v: object, what: str) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError(f"{what}: expected a list of strings")
    return v


def _opt_int(v: object, what: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{what}: expected an integer or null")
    return v


def _dict(v: object, what: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ValueError(f"{what}: expected an object")
    return v


def _from_doc(doc: dict[str, Any]) -> Manifest:
    ck = _dict(doc["checksum"], "checksum")
    objs = _dict(doc["objects"], "objects")
    ch = _dict(doc["chunks"], "chunks")
    tens = _dict(doc["tensors"], "tensors")
    sh = _dict(doc["shards"], "shards")
    vals = _dict(doc["values"], "values")
    shapes = tens["shapes"]
    if not isinstance(shapes, list) or not all(
        isinstance(s, list) and all(isinstance(n, int) and not isinstance(n, bool) for n in s)
        for s in shapes
    ):
        raise ValueError("tensors.shapes: expected a list of integer lists")
    kinds = _dict(doc["state_kinds"], "state_kinds")
    step = doc["step"]
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError("step: expected an integer")
    for name in ("created", "level"):
        if not isinstance(doc[name], str):
            raise ValueError(f"{name}: expected a string")
    parent = doc.get("parent")
    if parent is not None:
        check_snapshot_id(parent)
    blocks = objs["blocks"]
    if not isinstance(blocks, str):
        raise ValueError("objects.blocks: expected a base64 string")
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
        versions=_dict(doc["versions"], "versions"),
        topology=_dict(doc["topology"], "topology"),
        parent=parent,
        meta=_dict(doc.get("meta", {}), "meta"),
        object_names=_strs(objs["names"], "objects.names"),
        object_sizes=_unarr(objs["sizes"], "objects.sizes"),
        object_codecs=_strs(objs["codecs"], "objects.codecs"),
        blocks=base64.b64decode(blocks, validate=True),
        chunk_object=_unarr(ch["object"], "chunks.object"),
        chunk_offset=_unarr(ch["offset"], "chunks.offset"),
        chunk_length=_unarr(ch["length"], "chunks.length"),
        tensor_keys=_strs(tens["keys"], "tensors.keys"),
        tensor_ranks=_unarr(tens["ranks"], "tensors.ranks"),
        tensor_dtypes=_strs(tens["dtypes"], "tensors.dtypes"),
        tensor_shapes=[tuple(s) for s in shapes],
        tensor_nshards=_unarr(tens["nshards"], "tensors.nshards"),
        shard_kind=_unarr(sh["kind"], "shards.kind"),
        shard_geo=_unarr(sh["geo"], "shards.geo"),
        shard_nchunks=_unarr(sh["nchunks"], "shards.nchunks"),
        value_keys=_strs(vals["keys"], "values.keys"),
        value_ranks=_unarr(vals["ranks"], "values.ranks"),
        value_codecs=_strs(vals["codecs"], "values.codecs"),
        value_nchunks=_unarr(vals["nchunks"], "values.nchunks"),
    )


# -- validation -----------------------------------------------------------------------------------


def validate(m: Manifest) -> list[str]:
    """Every structural problem of a decoded manifest (empty when sound).

    Checks types, ranges and cross-table consistency with vectorised tests; shard tiling per
    tensor is checked by :func:`trainsnap.verify` and, for what it reads, by every load.
    Unknown algorithms and codecs raise :class:`IncompatibleError` (a newer writer), the rest is
    reported as corruption.
    """
    p: list[str] = []
    Hasher(m.algorithm, max(m.block_size, 1))  # raises IncompatibleError when unknown
    if not 64 <= m.block_size <= 1 << 30:
        p.append(f"block_size {m.block_size} outside [64, 2^30]")
        return p
    if m.level not in LEVELS:
        p.append(f"level {m.level!r} is not one of {LEVELS}")
    if m.step < 0:
        p.append(f"step {m.step} is negative")
    for c in set(m.object_codecs) - set(OBJECT_CODECS):
        raise IncompatibleError(f"object codec {c!r} unknown to this trainsnap; upgrade it")
    for c in set(m.value_codecs) - set(VALUE_CODECS):
        raise IncompatibleError(f"value codec {c!r} unknown to this trainsnap; upgrade it")
    p += _validate_objects(m)
    p += _validate_tables(m)
    return p


def _validate_objects(m: Manifest) -> list[str]:
    p = []
    n = len(m.object_names)
    if len(m.object_sizes) != n or len(m.object_codecs) != n:
        return [f"objects table columns disagree in length ({n} names)"]
    width = m.hasher.name_length()
    bad = [x for x in m.object_names if len(x) != width or not _HEX_RE.match(x)]
    if bad:
        p.append(f"{len(bad)} object names are not {width}-digit lowercase hex, e.g. {bad[0]!r}")
    if len(set(m.object_names)) != n:
        p.append("object names repeat")
    if n and int(m.object_sizes.min()) < 0:
        p.append("an object has a negative size")
        return p
    nblocks = int(m.block_start()[-1])
    if len(m.blocks) != nblocks * m.hasher.digest_size:
        p.append(
            f"{len(m.blocks)} bytes of block digests, expected {nblocks} x {m.hasher.digest_size}"
        )
    return p


def _validate_tables(m: Manifest) -> list[str]:
    p = []
    nt, ns, nv = len(m.tensor_keys), len(m.shard_kind), len(m.value_keys)
    if not (len(m.tensor_ranks) == len(m.tensor_dtypes) == len(m.tensor_shapes) == nt):
        return ["tensor table columns disagree in length"]
    if len(m.tensor_nshards) != nt or int(m.tensor_nshards.sum()) != ns:
        return ["tensors' shard counts do not add up to the shard table"]
    if not (len(m.value_ranks) == len(m.value_codecs) == len(m.value_nchunks) == nv):
        return ["value table columns disagree in length"]
    if len(m.shard_nchunks) != ns:
        return ["shard table columns disagree in length"]
    nc = len(m.chunk_object)
    if len(m.chunk_offset) != nc or len(m.chunk_length) != nc:
        return ["chunk table columns disagree in length"]
    counts = np.concatenate([m.tensor_nshards, m.shard_nchunks, m.value_nchunks])
    if len(counts) and int(counts.min()) < 0:
        return ["a negative count in the tensor, shard or value table"]
    if int(m.shard_nchunks.sum()) + int(m.value_nchunks.sum()) != nc:
        return ["shards' and values' chunk counts do not add up to the chunk table"]
    if nc:
        no = len(m.object_names)
        if int(m.chunk_object.min()) < 0 or int(m.chunk_object.max()) >= no:
            return ["a chunk names an object index outside the object table"]
        if int(m.chunk_offset.min()) < 0 or int(m.chunk_length.min()) <= 0:
            return ["a chunk has a negative offset or a non-positive length"]
        ends = m.chunk_offset + m.chunk_length
        if bool((ends > m.object_sizes[m.chunk_object]).any()):
            return ["a chunk extends past the end of its object"]
    if len({*zip(m.tensor_keys, m.tensor_ranks.tolist(), strict=True)}) != nt:
        p.append("a (key, rank) pair names two tensors")
    if len({*zip(m.value_keys, m.value_ranks.tolist(), strict=True)}) != nv:
        p.append("a (key, rank) pair names two values")
    if nt and int(m.tensor_ranks.min()) < -1 or nv and int(m.value_ranks.min()) < -1:
        p.append("a rank below -1")
    if "" in m.tensor_keys or "" in m.value_keys:
        p.append("an empty key")
    if any(n < 0 for s in m.tensor_shapes for n in s):
        p.append("a negative dimension in a tensor shape")
    if ns and not np.isin(m.shard_kind, (BOX, FLAT)).all():
        return [*p, "a shard kind other than 0 (box) or 1 (flat)"]
    if p:
        return p
    return _validate_shard_bytes(m)


def _validate_shard_bytes(m: Manifest) -> list[str]:
    """Each shard's geometry fits its tensor and its chunks hold exactly its bytes (vectorised:
    a manifest of a million shards validates in a fraction of a second)."""
    geo_start = m.geo_start()
    if int(geo_start[-1]) != len(m.shard_geo):
        return [f"shard geometry has {len(m.shard_geo)} numbers, expected {int(geo_start[-1])}"]
    try:
        isz = np.array([itemsize(d) for d in m.tensor_dtypes], np.int64)
    except TrainsnapError as e:
        return [str(e)]
    nt = len(m.tensor_shapes)
    ndim = np.array([len(s) for s in m.tensor_shapes], np.int64)
    maxdim = int(ndim.max()) if nt else 0
    shapes = np.zeros((nt, maxdim), np.int64)
    for t, s in enumerate(m.tensor_shapes):
        shapes[t, : len(s)] = s
    numel_t = np.prod(np.where(np.arange(maxdim) < ndim[:, None], shapes, 1), axis=1)
    owner = np.repeat(np.arange(nt), m.tensor_nshards)
    g0, nd, flat = geo_start[:-1], ndim[owner], m.shard_kind == FLAT
    geo = m.shard_geo
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
        return [f"tensor {m.tensor_keys[t]!r} has a shard outside its shape {m.tensor_shapes[t]}"]
    clen = np.zeros(len(m.chunk_length) + 1, np.int64)
    np.cumsum(m.chunk_length, out=clen[1:])
    cs = m.chunk_start()[: len(owner) + 1]
    stored = clen[cs[1:]] - clen[cs[:-1]]
    bad = np.nonzero(stored != numel * isz[owner])[0]
    if len(bad):
        s = int(bad[0])
        return [
            f"tensor {m.tensor_keys[int(owner[s])]!r}: a shard holds {int(numel[s] * isz[owner[s]])}"
            f" bytes but its chunks hold {int(stored[s])}"
        ]
    return []


# -- the marker -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Marker:
    snapshot_id: str
    manifest_size: int
    manifest_digest: str
    algorithm: str
    summary: Mapping[str, Any]
    writer: Mapping[str, Any]


def encode_marker(m: Manifest, manifest_bytes: bytes, writer: Mapping[str, Any]) -> bytes:
    doc = {
        "format": MARKER_FORMAT,
        "format_version": FORMAT_VERSION,
        "snapshot_id": m.snapshot_id,
        "manifest": {
            "size": len(manifest_bytes),
            "algorithm": m.algorithm,
            "digest": m.hasher.digest(manifest_bytes).hex(),
        },
        "summary": m.summary(),
        "writer": dict(writer),
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def decode_marker(data: bytes, snapshot_id: str) -> Marker:
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != MARKER_FORMAT:
            raise ValueError("not a trainsnap marker")
        if doc.get("format_version") != FORMAT_VERSION:
            raise IncompatibleError(
                f"snapshot {snapshot_id} has marker format version "
                f"{doc.get('format_version')!r}; this trainsnap reads {FORMAT_VERSION}. "
                "Upgrade trainsnap.",
                snapshot_id=snapshot_id,
            )
        man = _dict(doc["manifest"], "manifest")
        size = man["size"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError("manifest.size: expected a non-negative integer")
        digest, algorithm = man["digest"], man["algorithm"]
        if not isinstance(digest, str) or not isinstance(algorithm, str):
            raise ValueError("manifest.digest and manifest.algorithm must be strings")
        Hasher(algorithm)
        summary = _check_summary(_dict(doc["summary"], "summary"), snapshot_id)
        marker = Marker(
            snapshot_id=check_snapshot_id(doc["snapshot_id"]),
            manifest_size=size,
            manifest_digest=digest,
            algorithm=algorithm,
            summary=summary,
            writer=_dict(doc.get("writer", {}), "writer"),
        )
    except TrainsnapError:
        raise
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CorruptError(
            f"commit marker of snapshot {snapshot_id} is malformed: {e}", snapshot_id=snapshot_id
        ) from e
    if marker.snapshot_id != snapshot_id:
        raise CorruptError(
            f"commit marker under snapshot {snapshot_id} names {marker.snapshot_id!r}",
            snapshot_id=snapshot_id,
        )
    return marker


def id_step(snapshot_id: str) -> int:
    return int(check_snapshot_id(snapshot_id).split("-")[1])


def _check_summary(s: dict[str, Any], snapshot_id: str) -> dict[str, Any]:
    """The marker repeats a few manifest fields for cheap listing; they must be well typed and
    agree with the id (a verifier also checks them against the manifest)."""
    step, nbytes, tokens = s.get("step"), s.get("nbytes"), s.get("tokens_seen")
    for name, v in (("step", step), ("nbytes", nbytes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"summary.{name}: expected a non-negative integer, got {v!r}")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int)):
        raise ValueError(f"summary.tokens_seen: expected an integer or null, got {tokens!r}")
    if not isinstance(s.get("created"), str):
        raise ValueError("summary.created: expected a string")
    if s.get("level") not in LEVELS:
        raise ValueError(f"summary.level: expected one of {LEVELS}, got {s.get('level')!r}")
    if step != id_step(snapshot_id):
        raise ValueError(f"summary.step {step} disagrees with the snapshot id {snapshot_id}")
    return s


def check_manifest_bytes(marker: Marker, data: bytes) -> None:
    """Raise :class:`CorruptError` unless ``data`` is the manifest the marker committed."""
    if len(data) != marker.manifest_size:
        raise CorruptError(
            f"manifest of snapshot {marker.snapshot_id} is {len(data)} bytes, the commit marker "
            f"recorded {marker.manifest_size}: it was changed or truncated after commit",
            snapshot_id=marker.snapshot_id,
            path=manifest_key(marker.snapshot_id),
        )
    digest = Hasher(marker.algorithm).digest(data).hex()
    if digest != marker.manifest_digest:
        raise CorruptError(
            f"manifest of snapshot {marker.snapshot_id} does not match the checksum its commit "
            "marker recorded: it was changed after commit",
            snapshot_id=marker.snapshot_id,
            path=manifest_key(marker.snapshot_id),
        )


def referenced_objects(manifests: Iterable[Manifest]) -> set[str]:
    out: set[str] = set()
    for m in manifests:
        out.update(m.object_names)
    return out


def level_rank(level: str) -> int:
    return LEVELS.index(level)


def keys_summary(keys: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
