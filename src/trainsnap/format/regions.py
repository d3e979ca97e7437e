"""Shard geometry: where a shard sits in its logical tensor, and what two shards share.

Pure: no I/O, no torch. A shard is a :class:`Box` (global offsets and sizes, the shape of a
``DTensor`` local shard or a Megatron TP slice) or a :class:`Flat` range of the row-major
flattening of the logical tensor (ZeRO / FSDP1 / distributed-optimizer buffers).

Both kinds store their elements in an *affine layout*: the storage index of global element ``g``
is ``base + sum(g[i] * stride[i])``. Copying between any two shards therefore reduces to a few
:class:`Piece` objects -- a box of elements with an affine layout on each side -- which a reader
turns into one ranged read (when contiguous on both sides) or one strided copy.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from math import prod

from trainsnap.errors import InvalidArgumentError

Shape = tuple[int, ...]
Shape2 = tuple[Shape, Shape]


def row_major_strides(shape: Sequence[int]) -> Shape:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return tuple(strides)


@dataclass(frozen=True, slots=True)
class Box:
    """An axis-aligned box of a tensor: ``offsets[i] <= index[i] < offsets[i] + sizes[i]``."""

    offsets: Shape
    sizes: Shape

    def __reduce__(self) -> tuple[type[Box], Shape2]:
        # The default for slotted frozen dataclasses walks dataclasses.fields() per object, a
        # cost per box that the coordinator pays for every shard of every rank.
        return (Box, (self.offsets, self.sizes))

    @property
    def numel(self) -> int:
        return prod(self.sizes)

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @staticmethod
    def full(shape: Sequence[int]) -> Box:
        return Box((0,) * len(shape), tuple(shape))

    def check(self, shape: Shape) -> None:
        if len(self.offsets) != len(shape) or len(self.sizes) != len(shape):
            raise InvalidArgumentError(
                f"box {self} has {len(self.sizes)} dimensions, tensor has {len(shape)}"
            )
        for o, s, n in zip(self.offsets, self.sizes, shape, strict=True):
            if o < 0 or s < 0 or o + s > n:
                raise InvalidArgumentError(f"box {self} does not fit in shape {shape}")


@dataclass(frozen=True, slots=True)
class Flat:
    """Elements ``start <= i < start + length`` of the row-major flattening of a tensor."""

    start: int
    length: int

    def __reduce__(self) -> tuple[type[Flat], tuple[int, int]]:
        return (Flat, (self.start, self.length))

    @property
    def numel(self) -> int:
        return self.length

    def check(self, shape: Shape) -> None:
        if self.start < 0 or self.length < 0 or self.start + self.length > prod(shape):
            raise InvalidArgumentError(f"flat range {self} does not fit in shape {shape}")


Region = Box | Flat


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements copied from a source shard's storage to a destination shard's storage.

    Element ``i`` (a multi-index within ``sizes``) is at storage index
    ``src_offset + sum(i[k] * src_strides[k])`` in the source and likewise in the destination.
    Dimensions are canonical: no size-1 dimensions, mergeable dimensions merged.
    """

    sizes: Shape
    src_offset: int
    src_strides: Shape
    dst_offset: int
    dst_strides: Shape

    @property
    def numel(self) -> int:
        return prod(self.sizes)

    def src_span(self) -> tuple[int, int]:
        """Storage index range [lo, hi) of the source that holds this piece."""
        return self.src_offset, self.src_offset + _extent(self.sizes, self.src_strides)

    def dst_span(self) -> tuple[int, int]:
        return self.dst_offset, self.dst_offset + _extent(self.sizes, self.dst_strides)

    @property
    def src_contiguous(self) -> bool:
        return _is_contiguous(self.sizes, self.src_strides)

    @property
    def dst_contiguous(self) -> bool:
        return _is_contiguous(self.sizes, self.dst_strides)

    def split(self, max_src_span: int) -> list[Piece]:
        """Cut along the outermost dimension so that each part's source span is at most
        ``max_src_span`` elements (or a single row of that dimension, if one row is larger)."""
        lo, hi = self.src_span()
        if hi - lo <= max_src_span or not self.sizes:
            return [self]
        n0, s0, d0 = self.sizes[0], self.src_strides[0], self.dst_strides[0]
        row = _extent(self.sizes[1:], self.src_strides[1:])
        per = max(1, (max_src_span - row) // s0 + 1) if s0 else n0
        out = []
        for i in range(0, n0, per):
            k = min(per, n0 - i)
            out.append(
                _canonical(
                    (k, *self.sizes[1:]),
                    self.src_offset + i * s0,
                    (s0, *self.src_strides[1:]),
                    self.dst_offset + i * d0,
                    (d0, *self.dst_strides[1:]),
                )
            )
        if per == 1 and row > max_src_span and len(self.sizes) > 1:
            return [q for p in out for q in p.split(max_src_span)]
        return out


def _extent(sizes: Shape, strides: Shape) -> int:
    if any(s == 0 for s in sizes):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(sizes, strides, strict=True))


def _is_contiguous(sizes: Shape, strides: Shape) -> bool:
    expect = 1
    for n, st in zip(reversed(sizes), reversed(strides), strict=True):
        if st != expect:
            return False
        expect *= n
    return True


def _canonical(sizes: Shape, src_off: int, src_st: Shape, dst_off: int, dst_st: Shape) -> Piece:
    dims = [(n, a, b) for n, a, b in zip(sizes, src_st, dst_st, strict=True) if n != 1]
    merged: list[tuple[int, int, int]] = []
    for n, a, b in reversed(dims):
        if merged:
            m, ma, mb = merged[-1]
            if a == m * ma and b == m * mb:
                merged[-1] = (n * m, ma, mb)
                continue
        merged.append((n, a, b))
    merged.reverse()
    return Piece(
        sizes=tuple(d[0] for d in merged),
        src_offset=src_off,
        src_strides=tuple(d[1] for d in merged),
        dst_offset=dst_off,
        dst_strides=tuple(d[2] for d in merged),
    )


# -- layouts and intersections --------------------------------------------------------------------


def _layout(region: Region, shape: Shape) -> tuple[int, Shape]:
    """(base, strides) such that global element g lives at storage index base + g . strides."""
    if isinstance(region, Box):
        st = row_major_strides(region.sizes)
        return -sum(o * s for o, s in zip(region.offsets, st, strict=True)), st
    return -region.start, row_major_strides(shape)


def flat_to_boxes(start: int, stop: int, shape: Sequence[int]) -> list[Box]:
    """The row-major range ``[start, stop)`` of ``shape`` as at most ``2 * ndim - 1`` boxes."""
    shape = tuple(shape)
    if start >= stop:
        return []
    if not shape:
        return [Box((), ())]
    inner = prod(shape[1:])
    rest = shape[1:]
    zeros = (0,) * len(rest)
    if inner == 0:
        return []
    i0, r0 = divmod(start, inner)
    i1, r1 = divmod(stop, inner)
    if i0 == i1:
        return [Box((i0, *b.offsets), (1, *b.sizes)) for b in flat_to_boxes(r0, r1, rest)]
    out: list[Box] = []
    if r0:
        out += [Box((i0, *b.offsets), (1, *b.sizes)) for b in flat_to_boxes(r0, inner, rest)]
        i0 += 1
    if i1 > i0:
        out.append(Box((i0, *zeros), (i1 - i0, *rest)))
    if r1:
        out += [Box((i1, *b.offsets), (1, *b.sizes)) for b in flat_to_boxes(0, r1, rest)]
    return out


def box_intersection(first: Box, second: Box) -> Box | None:
    lo = tuple(max(x, y) for x, y in zip(first.offsets, second.offsets, strict=True))
    hi = tuple(
        min(x + n, y + m)
        for x, n, y, m in zip(first.offsets, first.sizes, second.offsets, second.sizes, strict=True)
    )
    if any(h <= first for first, h in zip(lo, hi, strict=True)):
        return None
    return Box(lo, tuple(h - first for first, h in zip(lo, hi, strict=True)))


def _as_boxes(region: Region, shape: Shape) -> list[Box]:
    if isinstance(region, Box):
        return [region] if region.numel else []
    return flat_to_boxes(region.start, region.start + region.length, shape)


def pieces(src: Region, dst: Region, shape: Shape) -> list[Piece]:
    """What ``dst`` needs from ``src``, as canonical pieces (empty when they do not meet)."""
    if isinstance(src, Flat) and isinstance(dst, Flat):
        lo = max(src.start, dst.start)
        hi = min(src.start + src.length, dst.start + dst.length)
        if hi <= lo:
            return []
        return [_canonical((hi - lo,), lo - src.start, (1,), lo - dst.start, (1,))]
    sbase, sst = _layout(src, shape)
    dbase, dst_st = _layout(dst, shape)
    out = []
    for sb in _as_boxes(src, shape):
        for db in _as_boxes(dst, shape):
            inter = box_intersection(sb, db)
            if inter is None:
                continue
            so = sbase + sum(o * s for o, s in zip(inter.offsets, sst, strict=True))
            do = dbase + sum(o * s for o, s in zip(inter.offsets, dst_st, strict=True))
            out.append(_canonical(inter.sizes, so, sst, do, dst_st))
    return out


# -- finding the shards that meet a region: sort and sweep, never all pairs ----------------------


def linear_span(region: Region, shape: Shape) -> tuple[int, int]:
    """Row-major index range [lo, hi) that contains every element of the region."""
    if isinstance(region, Flat):
        return region.start, region.start + region.length
    if region.numel == 0:
        return 0, 0
    st = row_major_strides(shape)
    lo = sum(o * s for o, s in zip(region.offsets, st, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(region.offsets, region.sizes, st, strict=True))
    return lo, last + 1


class RegionIndex:
    """The shards of one tensor, indexed by linear span for overlap queries.

    Shards are sorted by span start, with the running maximum of span ends; a query binary-searches
    the last shard starting before its end and walks back while the running maximum still reaches
    its start. Disjoint row-like partitions cost O(log n + k); column-like partitions, whose spans
    all overlap, cost O(n) per query with an exact test each.
    """

    __slots__ = ("_ends", "_maxend", "_order", "_regions", "_shape", "_starts")

    def __init__(self, regions: Sequence[Region], shape: Shape) -> None:
        self._regions = list(regions)
        self._shape = shape
        spans = [linear_span(r, shape) for r in self._regions]
        self._order = sorted(
            (i for i in range(len(spans)) if spans[i][1] > spans[i][0]),
            key=lambda i: spans[i][0],
        )
        self._starts = [spans[i][0] for i in self._order]
        self._ends = [spans[i][1] for i in self._order]
        running, self._maxend = 0, []
        for e in self._ends:
            running = max(running, e)
            self._maxend.append(running)

    def candidates(self, region: Region) -> Iterator[int]:
        """Indices of shards whose span meets the region's span (a superset of those meeting it)."""
        lo, hi = linear_span(region, self._shape)
        if hi <= lo:
            return
        j = bisect.bisect_left(self._starts, hi) - 1
        while j >= 0 and self._maxend[j] > lo:
            if self._ends[j] > lo:
                yield self._order[j]
            j -= 1

    def overlapping(self, region: Region) -> list[tuple[int, list[Piece]]]:
        """(shard index, pieces) for every shard that shares elements with ``region``, by index."""
        out = []
        for i in self.candidates(region):
            ps = pieces(self._regions[i], region, self._shape)
            if ps:
                out.append((i, ps))
        out.sort(key=lambda t: t[0])
        return out


def tiling_problems(regions: Sequence[Region], shape: Shape, limit: int = 10) -> list[str]:
    """Why ``regions`` do not tile ``shape`` exactly (empty when they do): out of bounds, overlap,
    or a gap (a volume that does not add up once overlaps are excluded)."""
    problems: list[str] = []
    for r in regions:
        try:
            r.check(shape)
        except InvalidArgumentError as e:
            problems.append(str(e))
    if problems:
        return problems[:limit]
    index = RegionIndex(regions, shape)
    for i, r in enumerate(regions):
        for j in index.candidates(r):
            if j < i and pieces(regions[j], r, shape):
                problems.append(f"shards {regions[j]} and {r} overlap")
                if len(problems) >= limit:
                    return problems
    total = sum(r.numel for r in regions)
    if not problems and total != prod(shape):
        problems.append(f"shards cover {total} of {prod(shape)} elements (a gap)")
    return problems
