"""Validation of a decoded manifest: every number bounded before any arithmetic, then types,
ranges and cross-table consistency, vectorised (a manifest of a million shards validates in a
fraction of a second). Pure.
"""

from __future__ import annotations

import re
from typing import Final

import numpy as np
import numpy.typing as npt

from trainsnap.errors import IncompatibleError, TrainsnapError
from trainsnap.format import tree
from trainsnap.format.checksums import Hasher
from trainsnap.format.manifest import (
    BOX,
    FLAT,
    LEVELS,
    OBJECT_CODECS,
    VALUE_CODECS,
    Manifest,
)
from trainsnap.format.values import itemsize

_HEX_RE: Final = re.compile(r"[0-9a-f]+")


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
    if manifest.tree is not None:
        p += tree.problems(manifest.tree, set(manifest.tensor_keys) | set(manifest.value_keys))
    return p


LIMIT = 1 << 62
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
        ("objects.sizes", manifest.object_sizes, LIMIT),
        ("objects.stored", manifest.object_stored, LIMIT),
        ("objects.frames", manifest.frames, 2 * manifest.block_size + 4096),
        ("tensors.nshards", manifest.tensor_nshards, nshards),
        ("shards.nchunks", manifest.shard_nchunks, nchunks),
        ("values.nchunks", manifest.value_nchunks, nchunks),
        ("chunks.offset", manifest.chunk_offset, LIMIT),
        ("chunks.length", manifest.chunk_length, LIMIT),
        ("shards.geometry", manifest.shard_geo, LIMIT),
    ]
    for name, column, top in columns:
        if len(column) and (int(column.min()) < 0 or int(column.max()) > top):
            return [f"{name} holds a number outside [0, {top}]"]
    for name, column in (
        ("object sizes", manifest.object_sizes),
        ("chunk lengths", manifest.chunk_length),
        ("tensor counts", np.concatenate([manifest.tensor_nshards, manifest.value_nchunks])),
    ):
        if float(np.sum(column, dtype=np.float64)) >= LIMIT:
            return [f"the {name} add up to 2^62 or more"]
    return _shape_problems(manifest)


def _shape_problems(manifest: Manifest) -> list[str]:
    for key, shape in zip(manifest.tensor_keys, manifest.tensor_shapes, strict=False):
        if len(shape) > MAX_NDIM:
            return [f"tensor {key!r} has {len(shape)} dimensions (at most {MAX_NDIM})"]
        numel = 1
        for n in shape:  # Python ints: exact
            if not 0 <= n < LIMIT:
                return [f"tensor {key!r} has a dimension {n} outside [0, 2^62)"]
            numel *= n
        if numel * 16 >= LIMIT:
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
    world = manifest.world_size
    if (nt and int(manifest.tensor_ranks.max()) >= world) or (
        nv and int(manifest.value_ranks.max()) >= world
    ):
        p.append(f"a rank at or above the world size {world}")
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
