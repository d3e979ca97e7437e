"""A load's reads as a plan of named records, and the policy that says how each is read.

A plan is built once, for tensors and plain values alike, from two records:

- :class:`ObjectRead`: bytes ``[start, stop)`` of one stored object go straight into ``parts``
  (destination memory, back to back: a whole tensor, the rows of a column slice, a value's
  buffer).
- :class:`CopyRead`: a payload range whose destination is not laid out like its stored bytes
  (short rows, a re-cut box): read through a bounce buffer, then ``place(payload offset,
  bytes)`` copies the bytes into place -- window by window (``windowed``), or once with the
  whole range (a strided copy needs all of it).

:class:`ReadPolicy` holds every threshold that chooses between those (built from
:mod:`trainsnap.tunables`); :func:`piece_reads` applies it to one piece of a tensor, and
:class:`~trainsnap.engine.read_executor.ReadExecutor` to each record when it runs the plan.
docs/ARCHITECTURE.md ("Read path") gives the reasons for each threshold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from math import prod
from typing import NamedTuple

import torch

from trainsnap import tunables
from trainsnap.engine.buffers import Parts, Rows
from trainsnap.format.regions import Piece


class Run(NamedTuple):
    """Where bytes of a payload (a shard's or a value's bytes) live: payload bytes
    ``[payload_offset, payload_offset + length)`` are bytes ``[offset, offset + length)`` of
    object ``obj``."""

    obj: int
    offset: int
    payload_offset: int
    length: int


class ObjectRead(NamedTuple):
    """Bytes ``[start, stop)`` of object ``obj`` go straight to ``parts`` (destination memory,
    back to back; their lengths add up to ``stop - start``), for ``key`` (named by errors)."""

    obj: int
    start: int
    stop: int
    parts: list[memoryview]
    key: str


Place = Callable[[int, memoryview], None]
"""``place(payload offset, bytes)``: copy bytes of a payload range into their destination. The
bytes are valid only during the call."""


class CopyRead(NamedTuple):
    """Payload bytes ``[start, stop)`` (stored as ``runs``) reach their destination through a
    bounce buffer and ``place``: a window at a time when ``windowed`` (``place`` takes any
    window, in order), else once with the whole range."""

    runs: list[Run]
    start: int
    stop: int
    place: Place
    key: str
    windowed: bool


Record = ObjectRead | CopyRead


@dataclass(frozen=True, slots=True)
class ReadPolicy:
    """How a plan's records are read (docs/ARCHITECTURE.md, "Read path", says why each)."""

    min_row: int
    """Destination rows at least this many bytes long are read in place, shorter ones copied
    from windows."""
    window: int
    """Bytes of a windowed copy read, verified and copied at a time."""
    coalesce_max: int
    """Most bytes one gathered read of small ranges covers."""
    copy_max: int
    """Most source bytes of one whole-range copy (a task of its own)."""
    direct: bool
    """Whether windows none of whose bytes is cached are read past the page cache."""

    @classmethod
    def from_tunables(cls, values: tunables.Tunables | None = None) -> ReadPolicy:
        t = values if values is not None else tunables.get()
        return cls(
            min_row=t.min_row,
            window=t.read_window,
            coalesce_max=t.coalesce_max,
            copy_max=min(t.copy_max, t.read_budget // 4),
            direct=t.direct_reads > 0,
        )


def object_reads(runs: list[Run], parts: list[memoryview], key: str) -> list[ObjectRead]:
    """The reads that fill ``parts`` (back to back) with the payload bytes ``runs`` locate."""
    cursor = Parts(parts)
    return [
        ObjectRead(r.obj, r.offset, r.offset + r.length, cursor.take(r.length), key) for r in runs
    ]


@dataclass(slots=True)
class Destination:
    """A tensor's memory as the reads of its pieces see it."""

    view: memoryview
    """The bytes of ``work``."""
    work: torch.Tensor
    """Contiguous CPU tensor the reads fill."""
    itemsize: int
    in_place: bool
    """Whether ``work`` is the destination itself (its bytes may be read into directly)."""
    key: str


RunsOf = Callable[[int, int], list[Run]]
"""Where bytes ``[start, stop)`` of one payload live."""


def piece_reads(
    piece: Piece, runs_of: RunsOf, dest: Destination, policy: ReadPolicy
) -> list[Record]:
    """The records that fill ``piece`` of ``dest`` from the payload ``runs_of`` locates.

    A piece contiguous in the snapshot whose destination is contiguous too, or made of rows of
    at least ``policy.min_row`` bytes, is read in place; one with shorter rows is copied window
    by window into its rows; any other piece is copied whole (cut into ``policy.copy_max``
    spans) with one strided copy. O(rows) for a piece read into its rows, else O(1) a span."""
    isz, key = dest.itemsize, dest.key
    in_place = dest.in_place and piece.src_contiguous
    if in_place and (piece.dst_contiguous or _row_elements(piece) * isz >= policy.min_row):
        src0, n = piece.src_offset * isz, piece.numel * isz
        if piece.dst_contiguous:
            dst0 = piece.dst_offset * isz
            parts = [dest.view[dst0 : dst0 + n]]
        else:
            parts = _destination_rows(dest.view, piece, isz)
        return list(object_reads(runs_of(src0, src0 + n), parts, key))
    windowed = in_place and piece.dst_strides[-1] == 1
    records: list[Record] = []
    for part in piece.split(max(1, policy.copy_max // isz)):
        lo, hi = part.src_span()
        place: Place
        if windowed:
            place = _RowsPlace(part, dest.view, isz, lo * isz)
        else:
            place = partial(_strided_copy, part, lo, dest.work)
        records.append(
            CopyRead(runs_of(lo * isz, hi * isz), lo * isz, hi * isz, place, key, windowed)
        )
    return records


class _RowsPlace:
    """Windows of a short-row piece into its rows (:class:`~trainsnap.engine.buffers.Rows`,
    made on the first window: on the I/O thread, not while planning)."""

    __slots__ = ("first", "itemsize", "piece", "rows", "view")

    def __init__(self, piece: Piece, view: memoryview, itemsize: int, first: int) -> None:
        self.piece, self.view, self.itemsize, self.first = piece, view, itemsize, first
        self.rows: Rows | None = None

    def __call__(self, offset: int, data: memoryview) -> None:
        if self.rows is None:
            p = self.piece
            self.rows = Rows(p.sizes, p.dst_strides, p.dst_offset, self.itemsize, self.view)
        self.rows.fill(offset - self.first, data)


def _strided_copy(part: Piece, low: int, work: torch.Tensor, _offset: int, buf: memoryview) -> None:
    """Copy a piece from ``buf``, which holds source elements ``[low, ...)``, into ``work``.
    Every tensor viewing ``buf`` dies with this frame, so the buffer can be unmapped after."""
    src = torch.frombuffer(buf, dtype=torch.uint8).view(work.dtype)
    src = src.as_strided(part.sizes, part.src_strides, part.src_offset - low)
    dst = work.as_strided(part.sizes, part.dst_strides, work.storage_offset() + part.dst_offset)
    dst.copy_(src)


def _row_elements(piece: Piece) -> int:
    """Elements of the longest runs a piece fills contiguously in its destination (its
    innermost dimensions whose destination strides are row-major)."""
    run = 1
    for size, stride in zip(reversed(piece.sizes), reversed(piece.dst_strides), strict=True):
        if stride != run:
            break
        run *= size
    return run


def _destination_rows(out: memoryview, piece: Piece, itemsize: int) -> list[memoryview]:
    """The destination bytes of a source-contiguous piece as one buffer per row, in source
    order: a read fills them back to back, so the piece lands in place with no copy."""
    row = _row_elements(piece)
    outer = 0
    while prod(piece.sizes[outer:]) != row:
        outer += 1
    # Plain Python, not numpy: numpy lets go of the GIL while it fills an array, and taking it
    # back from the I/O threads costs up to a switch interval per call.
    starts = [piece.dst_offset * itemsize]
    for size, stride in zip(piece.sizes[:outer], piece.dst_strides[:outer], strict=True):
        step = stride * itemsize
        starts = [first + i * step for first in starts for i in range(size)]
    nbytes = row * itemsize
    return [out[first : first + nbytes] for first in starts]
