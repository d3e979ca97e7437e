"""The load's common case planned in bulk: tensors read whole from their one saved shard.

A load on the topology that saved it reads each tensor whole from its one saved shard: the
shard's chunks land back to back in the destination's bytes. :func:`whole_shards` finds those
tensors and :func:`whole_reads` plans their reads (records of the load's read plan,
:class:`~trainsnap.engine.read_plan.ObjectRead`) with a few array operations over the
manifest's tables, with no shard geometry and no pieces; every other tensor goes through the
general planner (:func:`trainsnap.protocol.rank_load.load_tensors`). Planning holds the GIL the
readers need, so it is paid twice once they run: in its own time and in theirs. Cost: O(number
of chunks) array operations, no Python work per piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np

from trainsnap.engine.read_plan import ObjectRead
from trainsnap.format.manifest import BOX, FLAT, I64, Manifest
from trainsnap.format.regions import Flat, Region


def _ragged(starts: I64, counts: I64) -> I64:
    """The indices ``starts[i] .. starts[i] + counts[i] - 1`` of every ``i``, concatenated."""
    total = int(counts.sum())
    if not total:
        return np.zeros(0, np.int64)
    firsts = np.cumsum(counts) - counts
    return np.repeat(starts - firsts, counts) + np.arange(total, dtype=np.int64)


def _geometry(region: Region) -> tuple[int, ...]:
    """A region as the manifest stores a shard's geometry (flat: start, length; box: offsets
    then sizes)."""
    if isinstance(region, Flat):
        return (region.start, region.length)
    return region.offsets + region.sizes


def whole_shards(manifest: Manifest, tensors: Sequence[int], regions: Sequence[Region]) -> I64:
    """For each saved tensor ``tensors[i]`` wanted as ``regions[i]``: the row of its only saved
    shard when that shard is exactly the region, else -1."""
    t = np.asarray(tensors, np.int64)
    if not len(t) or not len(manifest.shard_kind):
        return np.full(len(t), -1, np.int64)
    ss, gs = manifest.shard_start(), manifest.geo_start()
    first = ss[t]
    alone = ss[t + 1] - first == 1
    row = np.where(alone, first, 0)
    geometry = [_geometry(r) for r in regions]
    kind = np.fromiter((FLAT if isinstance(r, Flat) else BOX for r in regions), np.int64, len(t))
    width = np.fromiter(map(len, geometry), np.int64, len(t))
    same = alone & (manifest.shard_kind[row] == kind) & (gs[row + 1] - gs[row] == width)
    if not same.any():
        return np.full(len(t), -1, np.int64)
    # Compare the candidates' stored numbers with the regions', all at once.
    pick = np.flatnonzero(same)
    wanted = np.fromiter(chain.from_iterable(geometry[i] for i in pick), np.int64)
    differs = manifest.shard_geo[_ragged(gs[row[pick]], width[pick])] != wanted
    ends = np.zeros(len(pick) + 1, np.int64)
    np.cumsum(width[pick], out=ends[1:])
    mismatches = np.concatenate([[0], np.cumsum(differs)])
    same[pick] = mismatches[ends[1:]] == mismatches[ends[:-1]]
    return np.where(same, row, -1)


def whole_reads(
    manifest: Manifest, wholes: Sequence[tuple[memoryview, int, str]]
) -> list[ObjectRead]:
    """The reads of destinations filled whole from one saved shard each: ``(destination bytes,
    shard row, key)``; the shard's chunks, in order, fill the bytes back to back (validated
    when the manifest was decoded: a shard's chunks hold exactly its bytes)."""
    shards = np.fromiter((shard for _, shard, _ in wholes), np.int64, len(wholes))
    cs = manifest.chunk_start()
    counts = cs[shards + 1] - cs[shards]
    rows = _ragged(cs[shards], counts)
    objects = manifest.chunk_object[rows].tolist()
    offsets = manifest.chunk_offset[rows].tolist()
    lengths = manifest.chunk_length[rows].tolist()
    reads = []
    c = 0
    for (out, _, key), n in zip(wholes, counts.tolist(), strict=True):
        pos = 0
        for j in range(c, c + n):
            offset, length = offsets[j], lengths[j]
            # most tensors are one chunk: the destination as it is, not a slice of it
            part = out if length == len(out) else out[pos : pos + length]
            reads.append(ObjectRead(objects[j], offset, offset + length, [part], key))
            pos += length
        c += n
    return reads
