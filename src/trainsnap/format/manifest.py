"""The manifest: the snapshot's self-describing index, as an in-memory columnar model.

Pure: no I/O. Encoding and validation live in :mod:`trainsnap.format.encoding`, the commit marker in
:mod:`trainsnap.format.marker`; FORMAT.md is the normative description.

Tables and how they chain (all indices 0-based):

* ``tensors``: key, rank (-1 for global), dtype, shape, ``nshards``. Tensor ``t`` owns the next
  ``nshards[t]`` rows of ``shards`` (in tensor order).
* ``shards``: ``kind`` (0 box, 1 flat), ``geo`` (box: offsets then sizes; flat: start, length),
  ``nchunks``. A shard's bytes (its elements in its own row-major order) are the concatenation
  of its next ``nchunks`` rows of ``chunks``.
* ``values``: key, rank, codec, ``nchunks``: their chunks follow all the tensors' chunks.
* ``chunks``: ``object``, ``offset``, ``length``: a byte range of one object.
* ``objects``: name, size (decoded), codec. Object ``o`` is ``ceil(size / block_size)`` blocks;
  ``blocks`` holds a digest of each block *as stored*, in object order. A raw object is stored as
  is; a compressed one (format 2) is one independent frame per block: ``stored`` gives its bytes
  on storage, ``frames`` each compressed block's stored size and ``raw_blocks`` each block's
  digest once decoded (compressed objects only, in object order).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

import numpy as np
import numpy.typing as npt

from trainsnap.errors import IncompatibleError, InvalidArgumentError, listed
from trainsnap.format.checksums import Hasher
from trainsnap.format.regions import Box, Flat, Region, Shape

FORMAT: Final = "trainsnap.manifest"
MARKER_FORMAT: Final = "trainsnap.marker"
FORMAT_VERSION: Final = 4
READABLE_VERSIONS: Final = (1, 2, 3, 4)
MANIFEST_NAMES: Final = {
    1: "manifest.json",
    2: "manifest.json",
    3: "manifest.bin",
    4: "manifest.bin",
}
"""The manifest's file name in a snapshot, by format version (formats 3 and 4 are binary)."""
LEVELS: Final = ("weights", "training", "strict")
"""The resume levels, lowest first (:func:`check_level` validates one given by a user)."""
STATE_KINDS: Final = ("model", "optimizer", "scheduler", "scaler", "rng", "data", "extra")
OBJECT_CODECS: Final = ("raw", "zstd", "bg2+zstd", "bg4+zstd", "bg8+zstd")
"""Object codecs; in format 2 an object's codec is stored as its index here."""
VALUE_CODECS: Final = ("json", "pickle")

BOX: Final = 0
FLAT: Final = 1

_ID_RE: Final = re.compile(r"step-[0-9]{12,20}-[0-9a-z]{4,32}")

I64 = npt.NDArray[np.int64]


def check_snapshot_id(snapshot_id: object) -> str:
    """The id if it is well formed; a crafted id could otherwise name a path outside the root."""
    if not isinstance(snapshot_id, str) or not _ID_RE.fullmatch(snapshot_id):
        raise IncompatibleError(
            f"{snapshot_id!r} is not a trainsnap snapshot id (expected step-<12 digits>-<suffix>)",
            snapshot_id=str(snapshot_id),
        )
    return snapshot_id


def object_key(name: str) -> str:
    """Storage key of an object, fanned out by its first two hex digits."""
    return f"objects/{name[:2]}/{name}"


def manifest_key(snapshot_id: str, version: int = FORMAT_VERSION) -> str:
    """Storage key of the manifest of a snapshot of format ``version`` (its marker says which)."""
    return f"snapshots/{snapshot_id}/{MANIFEST_NAMES.get(version, MANIFEST_NAMES[FORMAT_VERSION])}"


def manifest_keys(snapshot_id: str) -> list[str]:
    """Every key a manifest of any readable version may have, the current one first."""
    names = dict.fromkeys([MANIFEST_NAMES[FORMAT_VERSION], *MANIFEST_NAMES.values()])
    return [f"snapshots/{snapshot_id}/{n}" for n in names]


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
    tree: Any = None
    """The saved state's structure (:mod:`trainsnap.format.tree`; format 4). None for older
    formats and for snapshots made without one (imports): then only a template can say it."""
    whole_nbytes: int | None = None
    """Set on a part of a manifest handed to some ranks (:mod:`trainsnap.format.manifest_part`):
    the whole snapshot's stored bytes. Not encoded."""
    whole_rows: tuple[list[int], list[int], list[int]] | None = None
    """Set on a part: where its tensors, its values and its tree's top-level items are in the
    whole manifest (rows, rows, positions), so that merged parts keep the saved order. Not
    encoded."""
    # objects
    object_names: list[str] = field(default_factory=list)
    object_sizes: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    object_codecs: list[str] = field(default_factory=list)
    blocks: bytes = b""
    object_stored: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    """Bytes each object occupies on storage (equal to its size unless compressed)."""
    frames: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    raw_blocks: bytes = b""
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

    def _prefix(self, name: str, counts: Callable[[], I64]) -> I64:
        """The prefix sums of ``counts()``, computed once (``counts`` is not called again)."""
        if name not in self._derived:
            values = counts()
            out = np.zeros(len(values) + 1, np.int64)
            np.cumsum(values, out=out[1:])
            self._derived[name] = out
        result: I64 = self._derived[name]
        return result

    @property
    def world_size(self) -> int:
        """How many ranks wrote the snapshot (validated when decoded)."""
        w = self.topology.get("world_size", 1)
        return w if isinstance(w, int) and not isinstance(w, bool) and w > 0 else 1

    @property
    def hasher(self) -> Hasher:
        if "hasher" not in self._derived:
            self._derived["hasher"] = Hasher(self.algorithm, self.block_size)
        h: Hasher = self._derived["hasher"]
        return h

    def shard_start(self) -> I64:
        return self._prefix("shard_start", lambda: self.tensor_nshards)

    def chunk_start(self) -> I64:
        """Prefix over shards then values: shard ``s`` owns ``chunk_start[s]:chunk_start[s+1]``."""
        return self._prefix(
            "chunk_start", lambda: np.concatenate([self.shard_nchunks, self.value_nchunks])
        )

    def block_start(self) -> I64:
        b = self.block_size
        return self._prefix("block_start", lambda: (self.object_sizes + (b - 1)) // b)

    def geo_start(self) -> I64:
        if "geo_start" not in self._derived:
            ndim = np.array([len(s) for s in self.tensor_shapes], np.int64)
            per_shard = np.repeat(ndim, self.tensor_nshards)
            width = np.where(self.shard_kind == FLAT, 2, 2 * per_shard)
            self._derived["geo_start"] = self._prefix("_geo", lambda: width)
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

    def rank_scoped_keys(self, value: bool = False) -> frozenset[str]:
        """Keys of the tensors (or values) saved per rank (rank >= 0), computed once: O(entries),
        whatever world size the manifest claims."""
        name = "vranked" if value else "tranked"
        if name not in self._derived:
            keys, ranks = (
                (self.value_keys, self.value_ranks)
                if value
                else (self.tensor_keys, self.tensor_ranks)
            )
            self._derived[name] = frozenset(
                k for k, r in zip(keys, ranks.tolist(), strict=True) if r >= 0
            )
        found: frozenset[str] = self._derived[name]
        return found

    def find_tensor(self, key: str, rank: int) -> int | None:
        """The tensor saved under ``key`` as a global tensor, or as ``rank``'s own."""
        idx = self.tensor_index()
        found = idx.get((key, -1))
        return found if found is not None else idx.get((key, rank))

    def find_value(self, key: str, rank: int) -> int | None:
        idx = self.value_index()
        found = idx.get((key, -1))
        return found if found is not None else idx.get((key, rank))

    def shard_region(self, shard: int, shape: Shape) -> Region:
        g0 = int(self.geo_start()[shard])
        if int(self.shard_kind[shard]) == FLAT:
            return Flat(int(self.shard_geo[g0]), int(self.shard_geo[g0 + 1]))
        n = len(shape)
        geo = self.shard_geo[g0 : g0 + 2 * n].tolist()
        return Box(tuple(geo[:n]), tuple(geo[n:]))

    def tensor_shards(self, tensor: int) -> list[tuple[int, Region]]:
        ss = self.shard_start()
        shape = self.tensor_shapes[tensor]
        return [
            (s, self.shard_region(s, shape)) for s in range(int(ss[tensor]), int(ss[tensor + 1]))
        ]

    def value_chunk_base(self) -> int:
        return len(self.shard_kind)

    def chunks_of(self, owner: int) -> range:
        """Chunk rows of shard ``owner`` (or value ``owner - nshards``)."""
        cs = self.chunk_start()
        return range(int(cs[owner]), int(cs[owner + 1]))

    def object_blocks(self, obj: int) -> bytes:
        bs = self.block_start()
        d = self.hasher.digest_size
        return self.blocks[int(bs[obj]) * d : int(bs[obj + 1]) * d]

    def stored(self) -> I64:
        return self.object_stored if len(self.object_stored) else self.object_sizes

    def compressed_mask(self) -> npt.NDArray[np.bool_]:
        """True for each object stored compressed."""
        if "cmask" not in self._derived:
            codecs = self.object_codecs
            self._derived["cmask"] = (
                np.fromiter((c != "raw" for c in codecs), bool, count=len(codecs))
                if "raw" not in codecs or len(set(codecs)) > 1
                else np.zeros(len(codecs), bool)
            )
        mask: npt.NDArray[np.bool_] = self._derived["cmask"]
        return mask

    def compressed(self, obj: int) -> bool:
        return bool(self.compressed_mask()[obj])

    def _compressed_block_start(self) -> I64:
        """Prefix over objects of their blocks counted only for compressed objects."""
        if "cblock" not in self._derived:
            b = self.block_size
            n = (self.object_sizes + (b - 1)) // b
            mask = self.compressed_mask()
            self._derived["cblock"] = self._prefix("_cb", lambda: np.where(mask, n, 0))
        out: I64 = self._derived["cblock"]
        return out

    def object_frames(self, obj: int) -> I64:
        """Stored size of each block (frame) of compressed object ``o``."""
        cb = self._compressed_block_start()
        return self.frames[int(cb[obj]) : int(cb[obj + 1])]

    def object_raw_blocks(self, obj: int) -> bytes:
        cb = self._compressed_block_start()
        d = self.hasher.digest_size
        return self.raw_blocks[int(cb[obj]) * d : int(cb[obj + 1]) * d]

    @property
    def nbytes(self) -> int:
        """Bytes stored: the sum of the stored sizes of the objects it references."""
        if self.whole_nbytes is not None:
            return self.whole_nbytes
        return int(self.stored().sum())

    def summary(self) -> dict[str, Any]:
        """What the marker repeats, for listing and retention without reading manifests."""
        out: dict[str, Any] = {
            "step": self.step,
            "created": self.created,
            "level": self.level,
            "nbytes": self.nbytes,
            "tokens_seen": self.tokens_seen,
        }
        if self.meta.get("metrics"):
            out["metrics"] = self.meta["metrics"]
        if self.meta.get("tags"):
            out["tags"] = self.meta["tags"]
        if self.meta.get("approximate"):
            out["approximate"] = True
        return out


# -- building -------------------------------------------------------------------------------------


class StoredObject(NamedTuple):
    """One stored object as a manifest indexes it."""

    name: str
    size: int
    """Decoded size (what chunks address)."""
    digests: bytes
    """A digest of each block as stored, in object order."""
    codec: str = "raw"
    stored: int | None = None
    """Bytes on storage (None: the size, as for a raw object)."""
    frames: Sequence[int] = ()
    """Each compressed block's stored size (compressed objects only)."""
    raw_digests: bytes = b""
    """A digest of each block once decoded (compressed objects only)."""

    @property
    def stored_bytes(self) -> int:
        """Bytes on storage."""
        return self.size if self.stored is None else self.stored


class ManifestBuilder:
    """Accumulates tables in append order; :meth:`build` turns them into a :class:`Manifest`."""

    def __init__(self, **header: Any) -> None:
        self.header = header
        self._objects: dict[str, int] = {}
        self.object_names: list[str] = []
        self.object_sizes: list[int] = []
        self.object_codecs: list[str] = []
        self.block_parts: list[bytes] = []
        self.object_stored: list[int] = []
        self.frame_parts: list[list[int]] = []
        self.raw_block_parts: list[bytes] = []
        self.tensors: list[tuple[str, int, str, Shape]] = []
        self.tensor_nshards: list[int] = []
        self.shard_kind: list[int] = []
        self.shard_geo: list[int] = []
        self.shard_chunks: list[list[tuple[int, int, int]]] = []
        self.values: list[tuple[str, int, str]] = []
        self.value_chunks: list[list[tuple[int, int, int]]] = []

    def add_object(
        self,
        name: str,
        size: int,
        digests: bytes,
        codec: str = "raw",
        stored: int | None = None,
        frames: Sequence[int] = (),
        raw_digests: bytes = b"",
    ) -> int:
        """Index of the object, adding it on first sight (an object may back many chunks).
        ``size`` is the decoded size; a compressed object also gives its stored size, frame
        sizes and decoded-block digests."""
        found = self._objects.get(name)
        if found is not None:
            return found
        i = len(self.object_names)
        self._objects[name] = i
        self.object_names.append(name)
        self.object_sizes.append(size)
        self.object_codecs.append(codec)
        self.block_parts.append(digests)
        self.object_stored.append(size if stored is None else stored)
        if codec != "raw":
            self.frame_parts.append(list(frames))
            self.raw_block_parts.append(raw_digests)
        return i

    def add_stored(self, obj: StoredObject) -> int:
        """:meth:`add_object` of a written object's record."""
        return self.add_object(
            obj.name,
            obj.size,
            obj.digests,
            obj.codec,
            stored=obj.stored,
            frames=obj.frames,
            raw_digests=obj.raw_digests,
        )

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

    def add_value(
        self, key: str, rank: int, codec: str, chunks: list[tuple[int, int, int]]
    ) -> None:
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
            object_stored=np.array(self.object_stored, np.int64),
            frames=np.array([f for fs in self.frame_parts for f in fs], np.int64),
            raw_blocks=b"".join(self.raw_block_parts),
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


def id_step(snapshot_id: str) -> int:
    return int(check_snapshot_id(snapshot_id).split("-")[1])


def referenced_objects(manifests: Iterable[Manifest]) -> set[str]:
    out: set[str] = set()
    for m in manifests:
        out.update(m.object_names)
    return out


def check_level(level: object, name: str = "level") -> str:
    """``level`` when it is one of :data:`LEVELS`; :class:`InvalidArgumentError` naming the
    parameter ``name`` otherwise. The one validation of a resume level a user gives."""
    if not isinstance(level, str) or level not in LEVELS:
        raise InvalidArgumentError(f"{name} must be one of {LEVELS}, got {level!r}")
    return level


def level_rank(level: str) -> int:
    return LEVELS.index(level)


def keys_summary(keys: Sequence[str], limit: int = 5) -> str:
    """The first ``limit`` keys, then how many more (:func:`trainsnap.errors.listed`)."""
    return listed((repr(k) for k in keys), limit=limit)
