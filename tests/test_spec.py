"""Shard geometry: intersections, decomposition and planned coverage, by property tests."""

from __future__ import annotations

import itertools
from math import prod

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainsnap.format.regions import (
    Box,
    Flat,
    Piece,
    Region,
    RegionIndex,
    flat_to_boxes,
    pieces,
    tiling_problems,
)

shapes = st.lists(st.integers(1, 6), min_size=0, max_size=4).map(tuple)


def _grid_partition(draw: st.DrawFn, shape: tuple[int, ...]) -> list[Region]:
    """Boxes from random cuts along each dimension (uneven, like DTensor/Megatron shards)."""
    cuts = []
    for n in shape:
        inner = sorted(draw(st.sets(st.integers(1, max(1, n - 1)), max_size=3)) - {n})
        cuts.append([0, *[c for c in inner if 0 < c < n], n])
    boxes: list[Region] = [Box((), ())]
    for d in range(len(shape)):
        nxt: list[Region] = []
        for b in boxes:
            assert isinstance(b, Box)
            for lo, hi in zip(cuts[d], cuts[d][1:], strict=False):
                nxt.append(Box((*b.offsets, lo), (*b.sizes, hi - lo)))
        boxes = nxt
    return boxes


def _flat_partition(draw: st.DrawFn, shape: tuple[int, ...]) -> list[Region]:
    n = prod(shape)
    cuts = sorted(draw(st.sets(st.integers(1, max(1, n - 1)), max_size=5)) - {n})
    bounds = [0, *cuts, n]
    return [Flat(a, b - a) for a, b in itertools.pairwise(bounds) if b > a]


@st.composite
def partitions(draw: st.DrawFn, shape: tuple[int, ...]) -> list[Region]:
    if draw(st.booleans()):
        return _flat_partition(draw, shape)
    return _grid_partition(draw, shape)


def _apply(p: Piece, src: np.ndarray, dst: np.ndarray) -> None:
    s = np.lib.stride_tricks.as_strided(
        src[p.src_offset :], p.sizes, [x * src.itemsize for x in p.src_strides]
    )
    d = np.lib.stride_tricks.as_strided(
        dst[p.dst_offset :], p.sizes, [x * dst.itemsize for x in p.dst_strides]
    )
    d[...] = s


def _storage(region: Region, full: np.ndarray) -> np.ndarray:
    """The region's elements in its own row-major layout, as a shard would store them."""
    if isinstance(region, Flat):
        return full.reshape(-1)[region.start : region.start + region.length].copy()
    idx = tuple(slice(o, o + n) for o, n in zip(region.offsets, region.sizes, strict=True))
    return full[idx].reshape(-1).copy()


@settings(max_examples=300, deadline=None)
@given(data=st.data(), shape=shapes)
def test_planned_reads_cover_every_target_element_exactly_once(data, shape):
    full = np.arange(prod(shape), dtype=np.int64).reshape(shape)
    sources = data.draw(partitions(shape))
    targets = data.draw(partitions(shape))
    assert not tiling_problems(sources, shape)
    index = RegionIndex(sources, shape)
    for t in targets:
        dst = np.full(t.numel, -1, np.int64)
        hits = np.zeros(t.numel, np.int64)
        for i, ps in index.overlapping(t):
            src = _storage(sources[i], full)
            for p in ps:
                _apply(p, src, dst)
                ones = np.zeros(t.numel, np.int64)
                mark = np.lib.stride_tricks.as_strided(
                    ones[p.dst_offset :], p.sizes, [x * 8 for x in p.dst_strides]
                )
                mark[...] = 1
                hits += ones
        assert (hits == 1).all(), "every target element is written exactly once"
        assert (dst == _storage(t, full)).all()


@settings(max_examples=200, deadline=None)
@given(data=st.data(), shape=shapes)
def test_flat_range_decomposes_into_boxes_in_order(data, shape):
    n = prod(shape)
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    boxes = flat_to_boxes(a, b, shape)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    full = np.arange(n).reshape(shape)
    got = [] if not boxes else np.concatenate([_storage(x, full) for x in boxes])
    assert list(got) == list(range(a, b))


@settings(max_examples=200, deadline=None)
@given(data=st.data(), shape=shapes)
def test_piece_split_keeps_every_element(data, shape):
    full = np.arange(prod(shape), dtype=np.int64).reshape(shape)
    src = data.draw(partitions(shape))
    dst = data.draw(partitions(shape))
    limit = data.draw(st.integers(1, 20))
    for s in src:
        for d in dst:
            for p in pieces(s, d, shape):
                parts = p.split(limit)
                assert sum(q.numel for q in parts) == p.numel
                for q in parts:
                    lo, hi = q.src_span()
                    assert hi - lo <= max(limit, _row_extent(q))
                want = np.full(d.numel, -1)
                got = np.full(d.numel, -1)
                _apply(p, _storage(s, full), want)
                for q in parts:
                    _apply(q, _storage(s, full), got)
                assert (want == got).all()


def _row_extent(p: Piece) -> int:
    return 1 if not p.sizes else 1 + (p.sizes[-1] - 1) * p.src_strides[-1]


def test_column_shards_give_strided_pieces():
    shape = (4, 6)
    left, right = Box((0, 0), (4, 3)), Box((0, 3), (4, 3))
    whole = Box((0, 0), (4, 6))
    (p,) = pieces(left, whole, shape)
    assert p.sizes == (4, 3) and p.src_contiguous and not p.dst_contiguous
    (q,) = pieces(whole, right, shape)
    assert q.src_offset == 3 and q.src_strides == (6, 1)
    assert q.dst_contiguous and not q.src_contiguous


def test_row_shards_give_one_contiguous_piece():
    shape = (8, 5)
    (p,) = pieces(Box((2, 0), (4, 5)), Box((0, 0), (8, 5)), shape)
    assert p.sizes == (20,) and p.src_contiguous and p.dst_contiguous and p.dst_offset == 10


def test_tiling_problems_name_gaps_and_overlaps():
    shape = (4, 4)
    assert tiling_problems([Box((0, 0), (2, 4)), Box((2, 0), (2, 4))], shape) == []
    assert "gap" in tiling_problems([Box((0, 0), (2, 4))], shape)[0]
    assert "overlap" in tiling_problems([Box((0, 0), (3, 4)), Box((2, 0), (2, 4))], shape)[0]
    assert "fit" in tiling_problems([Box((0, 0), (5, 4))], shape)[0]
    assert tiling_problems([Flat(0, 10), Flat(10, 6)], shape) == []
    assert "overlap" in tiling_problems([Flat(0, 10), Flat(9, 7)], shape)[0]


@pytest.mark.parametrize("n", [1, 64, 4096])
def test_index_queries_are_not_all_pairs_for_row_partitions(n):
    shape = (n * 4, 8)
    regions = [Box((4 * i, 0), (4, 8)) for i in range(n)]
    index = RegionIndex(regions, shape)
    hits = list(index.candidates(Box((4 * (n // 2), 0), (4, 8))))
    assert hits == [n // 2]
