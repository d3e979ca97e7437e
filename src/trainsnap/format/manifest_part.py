"""The part of a manifest one group of ranks needs for a load.

A load reads the manifest from storage once, on the coordinator; every other rank receives only
the part that concerns it (:mod:`trainsnap.protocol.manifest_share`). A part is itself a
:class:`~trainsnap.format.manifest.Manifest`, so the rank's planning code is the same whether it
holds the whole manifest or a part:

* the header (step, level, topology, versions, ...) whole;
* the tree, and the tensor and value entries, under the top-level keys the state asks for;
* of a tensor whose destination on these ranks is sharded, only the saved shards that meet those
  shards (every other tensor keeps all its shards: a placeholder filled from the snapshot needs
  them, and a sharded one with no destination must still be refused as such);
* of a per-rank entry, the entries of these ranks, or the lowest rank's when none of them has
  one (so a load on another world size is still refused as rank-bound, not as a missing key);
* the objects those chunks name, with their block checksums: every block read is still verified.

Pure: no torch, no I/O. A part does not tile its tensors (it holds only what meets the group's
shards), so it is handed between ranks as an object, never encoded as a manifest.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainsnap.format import tree
from trainsnap.format.manifest import BOX, Manifest, ManifestBuilder
from trainsnap.format.regions import Box, Region, linear_span


@dataclass(frozen=True, slots=True)
class Wants:
    """What a rank's state asks of a snapshot, known before the manifest is read."""

    tops: tuple[str, ...]
    """Dotted top-level keys: the entries at or under them are wanted."""
    regions: Mapping[str, tuple[Region, ...]]
    """Tensors filled in place by a shard: key -> the regions this rank holds."""


class PartIndex:
    """A manifest indexed once for cutting many parts from it (the coordinator's side)."""

    def __init__(self, manifest: Manifest) -> None:
        self.m = manifest
        self._tensors = _KeyIndex(manifest.tensor_keys, manifest.tensor_ranks.tolist())
        self._values = _KeyIndex(manifest.value_keys, manifest.value_ranks.tolist())

    def part(self, wants: Wants, ranks: Collection[int]) -> Manifest:
        """The part of the manifest that ranks ``ranks``, all with these ``wants``, need."""
        m = self.m
        builder = ManifestBuilder(**_header(m))
        objects: dict[int, int] = {}
        ss, cs = m.shard_start(), m.chunk_start()
        for t in self._tensors.rows(wants.tops, ranks):
            shape = m.tensor_shapes[t]
            kept: Sequence[int] = range(int(ss[t]), int(ss[t + 1]))
            regions = wants.regions.get(m.tensor_keys[t])
            if regions is not None:
                kept = _meeting(m, t, regions)
            new = builder.add_tensor(
                m.tensor_keys[t], int(m.tensor_ranks[t]), m.tensor_dtypes[t], shape
            )
            for s in kept:
                chunks = _chunks(m, builder, objects, int(cs[s]), int(cs[s + 1]))
                builder.add_shard(new, m.shard_region(s, shape), chunks)
        base = m.value_chunk_base()
        for v in self._values.rows(wants.tops, ranks):
            owner = base + v
            chunks = _chunks(m, builder, objects, int(cs[owner]), int(cs[owner + 1]))
            builder.add_value(m.value_keys[v], int(m.value_ranks[v]), m.value_codecs[v], chunks)
        part = builder.build()
        part.tree = _tree_part(m.tree, wants.tops)
        part.whole_nbytes = m.nbytes
        return part


def _header(m: Manifest) -> dict[str, object]:
    return {
        "snapshot_id": m.snapshot_id,
        "created": m.created,
        "step": m.step,
        "level": m.level,
        "algorithm": m.algorithm,
        "block_size": m.block_size,
        "tokens_seen": m.tokens_seen,
        "samples_seen": m.samples_seen,
        "data_cursor": m.data_cursor,
        "state_kinds": dict(m.state_kinds),
        "versions": m.versions,
        "topology": m.topology,
        "parent": m.parent,
        "meta": m.meta,
        "format_version": m.format_version,
    }


class _KeyIndex:
    """Rows of a table (tensors or values) by key, and the keys in sorted order, so that the
    entries under a dotted prefix are one binary search away."""

    def __init__(self, keys: Sequence[str], ranks: Sequence[int]) -> None:
        self._rows: dict[str, list[int]] = {}
        for row, key in enumerate(keys):
            self._rows.setdefault(key, []).append(row)
        self._sorted = sorted(self._rows)
        self._ranks = ranks

    def rows(self, tops: Sequence[str], ranks: Collection[int]) -> list[int]:
        """Rows under ``tops``: global entries, and the per-rank entries of ``ranks`` (or the
        lowest rank's, when none of ``ranks`` has one), in table order."""
        out: list[int] = []
        for key in self._keys_under(tops):
            rows = self._rows[key]
            if len(rows) == 1 and self._ranks[rows[0]] == -1:
                out.append(rows[0])
                continue
            mine = [r for r in rows if self._ranks[r] == -1 or self._ranks[r] in ranks]
            out += mine or [min(rows, key=lambda r: self._ranks[r])]
        out.sort()
        return out

    def _keys_under(self, tops: Sequence[str]) -> dict[str, None]:
        keys: dict[str, None] = {}
        for top in tops:
            if top in self._rows:
                keys[top] = None
            # Every key that starts with "top." sorts between "top." and "top/" ("/" follows ".").
            lo = bisect.bisect_left(self._sorted, top + ".")
            hi = bisect.bisect_left(self._sorted, top + "/", lo)
            keys.update(dict.fromkeys(self._sorted[lo:hi]))
        return keys


def _meeting(m: Manifest, tensor: int, regions: Sequence[Region]) -> list[int]:
    """Shard rows of ``tensor`` that may share elements with one of ``regions``: exact for
    boxes against boxes, by row-major span otherwise (a superset, never fewer)."""
    shape = m.tensor_shapes[tensor]
    ss = m.shard_start()
    lo, hi = int(ss[tensor]), int(ss[tensor + 1])
    kinds = m.shard_kind[lo:hi]
    boxes = [r for r in regions if isinstance(r, Box)]
    if len(boxes) == len(regions) and bool(np.all(kinds == BOX)) and shape:
        ndim = len(shape)
        g0 = int(m.geo_start()[lo])
        geo = m.shard_geo[g0 : g0 + 2 * ndim * (hi - lo)].reshape(hi - lo, 2, ndim)
        offsets, sizes = geo[:, 0, :], geo[:, 1, :]
        meets = np.zeros(hi - lo, bool)
        for box in boxes:
            start, size = np.array(box.offsets), np.array(box.sizes)
            meets |= np.all((offsets < start + size) & (start < offsets + sizes), axis=1)
        return [lo + int(i) for i in np.flatnonzero(meets)]
    spans = [linear_span(r, shape) for r in regions]
    out = []
    for s in range(lo, hi):
        a, b = linear_span(m.shard_region(s, shape), shape)
        if any(a < y and x < b for x, y in spans):
            out.append(s)
    return out


def _chunks(
    m: Manifest, builder: ManifestBuilder, objects: dict[int, int], lo: int, hi: int
) -> list[tuple[int, int, int]]:
    """Chunk rows ``[lo, hi)`` with their objects added to the part (renumbered)."""
    out = []
    for c in range(lo, hi):
        o = int(m.chunk_object[c])
        new = objects.get(o)
        if new is None:
            compressed = m.compressed(o)
            new = objects[o] = builder.add_object(
                m.object_names[o],
                int(m.object_sizes[o]),
                m.object_blocks(o),
                m.object_codecs[o],
                stored=int(m.stored()[o]),
                frames=m.object_frames(o).tolist() if compressed else (),
                raw_digests=m.object_raw_blocks(o) if compressed else b"",
            )
        out.append((new, int(m.chunk_offset[c]), int(m.chunk_length[c])))
    return out


def _tree_part(root: Any, tops: Sequence[str]) -> Any:
    """The saved tree's top-level keys among ``tops`` (None stays None: no tree saved)."""
    if root is None:
        return None
    wanted = set(tops)
    return tree.mapping(
        tree.kind(root), [(k, c) for k, c in tree.items(root) if tree.join("", k) in wanted]
    )
