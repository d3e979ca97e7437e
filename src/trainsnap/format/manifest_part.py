"""The parts of a manifest the ranks of a load need.

A load reads the manifest from storage once, on the coordinator; every other rank receives only
what concerns it (:mod:`trainsnap.protocol.manifest_share`), in pieces that many ranks share:

* a **shared part** for each distinct :class:`Wants` -- one top-level key and the regions a rank
  holds under it, so that the data-parallel replicas of a model share the model's part even when
  their (ZeRO-sharded) optimizer parts all differ -- holding the global entries under it: of a
  tensor whose destination is sharded, only the saved shards that meet those regions (every other
  tensor keeps all its shards: a placeholder filled from the snapshot needs them, and a sharded
  one with no destination must still be refused as such);
* an **own part** for each rank: its per-rank entries under its keys, or the lowest rank's where
  it has none (so a load on another world size is still refused as rank-bound, not as a missing
  key);
* each carries the header (step, level, topology, versions, ...) whole, the tree under its keys,
  and the objects its chunks name with their block checksums: every block read is still verified.

A rank merges its parts (:func:`merge`) into one :class:`~trainsnap.format.manifest.Manifest`,
so its planning code is the same whether it holds the whole manifest or its parts. The
coordinator's work is one cut per distinct wants and one small cut per rank; no rank holds the
world's shards.

Pure: no torch, no I/O. A part does not tile its tensors (it holds only what meets the ranks'
shards), so it is handed between ranks as an object, never encoded as a manifest.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainsnap.format import tree
from trainsnap.format.manifest import FLAT, Manifest, ManifestBuilder
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
        root = manifest.tree
        self._items = [] if root is None else list(tree.items(root))
        """The saved tree's top-level items, in its order."""
        self._at: dict[str, list[int]] = {}
        """Dotted top-level key -> its items' positions."""
        for i, (k, _) in enumerate(self._items):
            self._at.setdefault(tree.join("", k), []).append(i)

    def shared(self, wants: Wants) -> Manifest:
        """The global entries under ``wants.tops``, cut to ``wants.regions``; its tree."""
        part = self._cut(
            [(t, wants.regions) for t in self._tensors.global_rows(wants.tops)],
            self._values.global_rows(wants.tops),
        )
        at = sorted({i for top in set(wants.tops) for i in self._at.get(top, ())})
        if self.m.tree is not None:  # the saved tree's items under ``tops``, in its order
            part.tree = tree.mapping(tree.kind(self.m.tree), [self._items[i] for i in at])
            assert part.whole_rows is not None
            part.whole_rows[2].extend(at)
        return part

    def own(self, wants: Sequence[Wants], rank: int) -> Manifest:
        """Rank ``rank``'s per-rank entries under the keys of its ``wants`` (the lowest rank's
        of a key it has none of). Costs the per-rank keys under those keys, not the world."""
        tensors = [(t, w.regions) for w in wants for t in self._tensors.own_rows(w.tops, rank)]
        values = [v for w in wants for v in self._values.own_rows(w.tops, rank)]
        part = self._cut(tensors, values)
        part.tree = None
        return part

    def _cut(
        self, tensors: Sequence[tuple[int, Mapping[str, tuple[Region, ...]]]], values: Sequence[int]
    ) -> Manifest:
        m = self.m
        builder = ManifestBuilder(**_header(m))
        objects = _Objects(builder)
        ss = m.shard_start()
        for t, wanted in tensors:
            key, shape = m.tensor_keys[t], m.tensor_shapes[t]
            regions = wanted.get(key)
            kept = range(int(ss[t]), int(ss[t + 1])) if regions is None else _meeting(m, t, regions)
            new = builder.add_tensor(key, int(m.tensor_ranks[t]), m.tensor_dtypes[t], shape)
            for s in kept:
                builder.add_shard(new, m.shard_region(s, shape), objects.chunks(m, s))
        base = m.value_chunk_base()
        for v in values:
            chunks = objects.chunks(m, base + v)
            builder.add_value(m.value_keys[v], int(m.value_ranks[v]), m.value_codecs[v], chunks)
        part = builder.build()
        part.whole_nbytes = m.nbytes
        part.whole_rows = ([t for t, _ in tensors], list(values), [])
        return part


def merge(parts: Sequence[Manifest]) -> Manifest:
    """One manifest of a rank's ``parts`` (from one snapshot, cut by :class:`PartIndex`), for
    its planning: their entries and objects (each object once), and their trees' top-level
    keys, all in the whole manifest's order, whatever the order of ``parts``."""
    if len(parts) == 1:
        return parts[0]
    rows = [m.whole_rows for m in parts]
    assert all(r is not None for r in rows), "parts are cut by PartIndex"
    first = parts[0]
    builder = ManifestBuilder(**_header(first))
    objects = _Objects(builder)
    for _, p, t in sorted(_order(rows, 0)):
        m = parts[p]
        ss, shape, key = m.shard_start(), m.tensor_shapes[t], m.tensor_keys[t]
        new = builder.add_tensor(key, int(m.tensor_ranks[t]), m.tensor_dtypes[t], shape)
        for s in range(int(ss[t]), int(ss[t + 1])):
            builder.add_shard(new, m.shard_region(s, shape), objects.chunks(m, s))
    for _, p, v in sorted(_order(rows, 1)):
        m = parts[p]
        chunks = objects.chunks(m, m.value_chunk_base() + v)
        builder.add_value(m.value_keys[v], int(m.value_ranks[v]), m.value_codecs[v], chunks)
    merged = builder.build()
    merged.whole_nbytes = first.nbytes
    trees = [(p, m.tree) for p, m in enumerate(parts) if m.tree is not None]
    if trees:
        items = {p: tree.items(t) for p, t in trees}
        merged.tree = tree.mapping(
            tree.kind(trees[0][1]), [items[p][i] for _, p, i in sorted(_order(rows, 2))]
        )
    return merged


def _order(rows: Sequence[Any], what: int) -> list[tuple[int, int, int]]:
    """(row in the whole manifest, part, row in the part) of every tensor (``what`` 0), value
    (1) or top-level tree item (2) of the parts."""
    return [(row, p, i) for p, r in enumerate(rows) for i, row in enumerate(r[what])]


def tree_order(root: Any) -> list[str]:
    """The saved tree's top-level keys, dotted, in their order."""
    return [] if root is None else [tree.join("", k) for k, _ in tree.items(root)]


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
    """Rows of a table (tensors or values) by key and by (key, rank), and the keys of global and
    of per-rank rows each in sorted order, so that the entries under a dotted prefix are a
    binary search away and a rank's own rows a lookup."""

    def __init__(self, keys: Sequence[str], ranks: Sequence[int]) -> None:
        self._global_rows: dict[str, list[int]] = {}
        self._own: dict[tuple[str, int], list[int]] = {}
        self._lowest: dict[str, tuple[int, int]] = {}  # key -> (rank, row) of its lowest rank
        for row, (key, rank) in enumerate(zip(keys, ranks, strict=True)):
            if rank == -1:
                self._global_rows.setdefault(key, []).append(row)
                continue
            self._own.setdefault((key, rank), []).append(row)
            if key not in self._lowest or rank < self._lowest[key][0]:
                self._lowest[key] = (rank, row)
        self._global = sorted(self._global_rows)
        self._scoped = sorted(self._lowest)

    def global_rows(self, tops: Sequence[str]) -> list[int]:
        """Global rows under ``tops``, in table order."""
        return sorted(r for key in _under(self._global, tops) for r in self._global_rows[key])

    def own_rows(self, tops: Sequence[str], rank: int) -> list[int]:
        """Per-rank rows of ``rank`` under ``tops`` (the lowest rank's of a key ``rank`` has
        none of, unless the key also has a global row), in table order."""
        out: list[int] = []
        for key in _under(self._scoped, tops):
            mine = self._own.get((key, rank))
            if mine is None and key not in self._global_rows:
                mine = [self._lowest[key][1]]
            out += mine or ()
        out.sort()
        return out


def _under(ordered: list[str], tops: Sequence[str]) -> dict[str, None]:
    """The keys of ``ordered`` (sorted) that are one of ``tops`` or lie under one."""
    keys: dict[str, None] = {}
    for top in tops:
        at = bisect.bisect_left(ordered, top)
        if at < len(ordered) and ordered[at] == top:
            keys[top] = None
        # Every key that starts with "top." sorts between "top." and "top/" ("/" follows ".").
        lo = bisect.bisect_left(ordered, top + ".")
        hi = bisect.bisect_left(ordered, top + "/", lo)
        keys.update(dict.fromkeys(ordered[lo:hi]))
    return keys


def _meeting(m: Manifest, tensor: int, regions: Sequence[Region]) -> list[int]:
    """Shard rows of ``tensor`` that may share elements with one of ``regions``: exact for
    boxes against boxes, by row-major span otherwise (a superset, never fewer)."""
    shape = m.tensor_shapes[tensor]
    ss = m.shard_start()
    lo, hi = int(ss[tensor]), int(ss[tensor + 1])
    boxes = [r for r in regions if isinstance(r, Box)]
    if len(boxes) == len(regions) and shape and FLAT not in m.shard_kind[lo:hi].tolist():
        ndim = len(shape)
        g0 = int(m.geo_start()[lo])
        geo = m.shard_geo[g0 : g0 + 2 * ndim * (hi - lo)]
        if hi - lo > _FEW:
            return [lo + int(i) for i in np.flatnonzero(_meets(geo.reshape(-1, 2, ndim), boxes))]
        flat = geo.tolist()  # a few shards (a tensor-parallel split): numpy costs more
        out = []
        for i in range(hi - lo):
            at = 2 * ndim * i
            offsets, sizes = flat[at : at + ndim], flat[at + ndim : at + 2 * ndim]
            if any(_box_meets(offsets, sizes, box) for box in boxes):
                out.append(lo + i)
        return out
    spans = [linear_span(r, shape) for r in regions]
    out = []
    for s in range(lo, hi):
        a, b = linear_span(m.shard_region(s, shape), shape)
        if any(a < y and x < b for x, y in spans):
            out.append(s)
    return out


_FEW = 32
"""Shards of one tensor up to which meeting is tested in Python, not numpy."""


def _box_meets(offsets: Sequence[int], sizes: Sequence[int], box: Box) -> bool:
    for o, z, b, n in zip(offsets, sizes, box.offsets, box.sizes, strict=True):
        if o >= b + n or b >= o + z:
            return False
    return True


def _meets(geo: np.ndarray, boxes: Sequence[Box]) -> np.ndarray:
    """Which of the shard boxes ``geo`` (shards x (offsets, sizes) x dims) meet any of ``boxes``."""
    offsets, sizes = geo[:, 0, :], geo[:, 1, :]
    meets = np.zeros(len(geo), bool)
    for box in boxes:
        start, size = np.array(box.offsets), np.array(box.sizes)
        meets |= np.all((offsets < start + size) & (start < offsets + sizes), axis=1)
    return meets


class _Objects:
    """The objects of a part being built, each added once (by name) and renumbered."""

    def __init__(self, builder: ManifestBuilder) -> None:
        self._builder = builder
        self._new: dict[str, int] = {}

    def chunks(self, m: Manifest, owner: int) -> list[tuple[int, int, int]]:
        """The chunks of shard (or value) row ``owner`` of ``m``, their objects added."""
        cs = m.chunk_start()
        out = []
        for c in range(int(cs[owner]), int(cs[owner + 1])):
            o = int(m.chunk_object[c])
            out.append((self._object(m, o), int(m.chunk_offset[c]), int(m.chunk_length[c])))
        return out

    def _object(self, m: Manifest, o: int) -> int:
        name = m.object_names[o]
        new = self._new.get(name)
        if new is None:
            compressed = m.compressed(o)
            new = self._new[name] = self._builder.add_object(
                name,
                int(m.object_sizes[o]),
                m.object_blocks(o),
                m.object_codecs[o],
                stored=int(m.stored()[o]),
                frames=m.object_frames(o).tolist() if compressed else (),
                raw_digests=m.object_raw_blocks(o) if compressed else b"",
            )
        return new
