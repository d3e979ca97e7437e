"""Host buffers: the bytes of a tensor without a copy, contiguous gathers, and the bounce
buffers of a load (mappings reused within a byte budget).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import accumulate
from typing import Any

import torch

from trainsnap.format.regions import flat_to_boxes


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (writable if the tensor is).

    Built from the data pointer, not with ``view``/``reshape``/``numpy``: those release the GIL,
    and while the I/O pool runs each release waits for a worker to hand it back. The view keeps
    the tensor alive through the ctypes array it is made from. O(1)."""
    assert tensor.is_cpu and tensor.is_contiguous(), "caller stages first"
    assert not (tensor.is_conj() or tensor.is_neg()), "caller resolves the lazy bits first"
    return raw_bytes(tensor)


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """:func:`tensor_bytes` of a tensor the caller has already found to be a contiguous CPU
    tensor with no lazy bits (its checks cost as much as the view)."""
    nbytes = tensor.nbytes
    if nbytes == 0:
        return memoryview(b"")
    array: Any = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    array.owner = tensor
    return memoryview(array).cast("B")


def gather(parts: list[memoryview], size: int) -> memoryview:
    """One contiguous buffer holding ``parts`` back to back (a single part is not copied)."""
    if len(parts) == 1:
        return parts[0]
    buf = bytearray(size)
    pos = 0
    for p in parts:
        buf[pos : pos + len(p)] = p
        pos += len(p)
    assert pos == size
    return memoryview(buf)


class Parts:
    """Consecutive destination bytes spread over several buffers (the rows of a column piece),
    handed out in order: :meth:`take` returns the views that the next ``n`` bytes fill.

    A take finds its first and last buffer by bisection and hands the whole buffers between
    them out as they are: a column piece has thousands of rows, and a loop over them in Python
    would cost more than reading them."""

    def __init__(self, buffers: list[memoryview]) -> None:
        self._buffers = buffers
        self._ends = list(accumulate(map(len, buffers)))
        self._pos = 0

    def take(self, nbytes: int) -> list[memoryview]:
        if not nbytes:
            return []
        start, end = self._pos, self._pos + nbytes
        if end > (self._ends[-1] if self._ends else 0):
            raise ValueError(f"take({nbytes}) past the end of the parts ({self._ends[-1:]})")
        self._pos = end
        bufs, ends = self._buffers, self._ends
        i = bisect_right(ends, start)  # the buffer holding byte ``start``
        j = bisect_left(ends, end, i)  # the buffer holding byte ``end - 1``
        first, last = bufs[i], bufs[j]
        first_lo = start - (ends[i] - len(first))
        last_hi = end - (ends[j] - len(last))
        if i == j:
            return [first if first_lo == 0 and last_hi == len(first) else first[first_lo:last_hi]]
        head = first[first_lo:] if first_lo else first
        tail = last if last_hi == len(last) else last[:last_hi]
        return [head, *bufs[i + 1 : j], tail]


class Rows:
    """Destination bytes laid out as a strided box (a column slice of a tensor), filled from
    its source bytes in row-major order, in windows cut anywhere (an element may straddle two).

    ``sizes``, ``strides`` and ``offset`` are in elements of ``itemsize`` bytes, the last
    stride 1; each window is copied with at most ``2 * len(sizes) - 1`` strided copies."""

    def __init__(
        self,
        sizes: tuple[int, ...],
        strides: tuple[int, ...],
        offset: int,
        itemsize: int,
        out: memoryview,
    ) -> None:
        assert sizes and strides[-1] == 1, "rows are contiguous"
        self.sizes = (*sizes[:-1], sizes[-1] * itemsize)
        self.strides = (*(s * itemsize for s in strides[:-1]), 1)
        self.base = offset * itemsize
        row_major = [1] * len(self.sizes)
        for i in range(len(self.sizes) - 2, -1, -1):
            row_major[i] = row_major[i + 1] * self.sizes[i + 1]
        self.row_major = row_major
        self.out = torch.frombuffer(out, dtype=torch.uint8)

    def fill(self, start: int, data: memoryview) -> None:
        """Copy ``data``, source bytes ``[start, start + len(data))``, into place."""
        src = torch.frombuffer(data, dtype=torch.uint8)
        for box in flat_to_boxes(start, start + len(data), self.sizes):
            at = sum(o * r for o, r in zip(box.offsets, self.row_major, strict=True)) - start
            dst = self.base + sum(o * s for o, s in zip(box.offsets, self.strides, strict=True))
            piece = src[at : at + box.numel].view(box.sizes)
            self.out.as_strided(box.sizes, self.strides, dst).copy_(piece)


def scatter_copy(source: memoryview, parts: list[memoryview]) -> None:
    """Copy ``source`` into ``parts`` back to back (their lengths add up to its length)."""
    pos = 0
    for part in parts:
        part[:] = source[pos : pos + len(part)]
        pos += len(part)


def _map(nbytes: int) -> mmap.mmap:
    """An anonymous private mapping for bounce buffers (huge pages asked for where the kernel
    offers them: fewer page faults the first time it is filled).

    Mappings, not heap memory: freed heap chunks stay in per-thread malloc arenas, so a load
    that cycled buffers through eight I/O threads would hold several times its budget in
    resident memory; an unmapped region goes back to the operating system."""
    try:  # private: pages come straight from the allocator, not from shared memory
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (AttributeError, TypeError):  # platforms without these flags
        region = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            region.madvise(mmap.MADV_HUGEPAGE)
    return region


_POOL_ROUND = 2 << 20
"""Pool mappings are sized in multiples of this (a huge page), so that pieces of nearly the same
size share them."""


class BouncePool:
    """The bounce buffers of one load, within a byte budget, reused from piece to piece.

    At most ``limit`` bytes of buffers are handed out at once (a buffer larger than the limit is
    counted as the limit: it runs alone), and the mappings kept for reuse never hold more than
    ``limit`` bytes beyond the one being mapped. Reuse matters: filling a fresh mapping costs a
    page fault per page, several times the copy itself. :meth:`close` unmaps everything.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.mapped = 0
        self.maps = 0
        """Mappings made (for tests and tuning: reuse keeps this low)."""
        self._free: list[mmap.mmap] = []
        self._cv = threading.Condition()

    @contextmanager
    def buffer(self, nbytes: int) -> Iterator[memoryview]:
        """A buffer of ``nbytes`` (waits while the budget is in use)."""
        if nbytes < (1 << 20):
            yield memoryview(bytearray(nbytes))
            return
        n = min(nbytes, self.limit)
        with self._cv:
            self._cv.wait_for(lambda: self.used + n <= self.limit)
            self.used += n
            self.peak = max(self.peak, self.used)
            region = self._take(nbytes)
        base = memoryview(region)
        view = base[:nbytes]
        try:
            yield view
        finally:
            view.release()
            base.release()
            with self._cv:
                self._free.append(region)
                self.used -= n
                self._cv.notify_all()

    def _take(self, nbytes: int) -> mmap.mmap:
        fits = [r for r in self._free if len(r) >= nbytes]
        if fits:
            region = min(fits, key=len)
            self._free.remove(region)
            return region
        size = -(-nbytes // _POOL_ROUND) * _POOL_ROUND
        self._free.sort(key=len)
        while self._free and self.mapped + size > self.limit:
            old = self._free.pop()  # the largest that does not fit
            self.mapped -= len(old)
            _unmap(old)
        self.mapped += size
        self.maps += 1
        return _map(size)

    def close(self) -> None:
        with self._cv:
            for region in self._free:
                self.mapped -= len(region)
                _unmap(region)
            self._free.clear()


def _unmap(region: mmap.mmap) -> None:
    """Unmap ``region`` now, or when the last view of it dies: a read that failed leaves views
    in the frames of the error being raised, and the load must raise that error, not this."""
    with contextlib.suppress(BufferError):
        region.close()
