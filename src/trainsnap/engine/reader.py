"""Verified reads of a snapshot's stored objects.

Every byte a load uses comes by one road: a plan of records
(:mod:`trainsnap.engine.read_plan`) that :class:`~trainsnap.engine.read_executor.ReadExecutor`
runs on the I/O pool, each record by the strategy the reader's
:class:`~trainsnap.engine.read_plan.ReadPolicy` picks, through one of the :class:`Reader`'s three
public reads -- one per kind of storage request:

- :meth:`Reader.read` -- a ranged read into destination parts: an :class:`ObjectRead` of a
  block or more, and each run of a whole-range copy. Storage: the range's whole blocks streamed
  into the parts (``read_steps``); a block cut by either end, once (``read_into``).
- :meth:`Reader.read_gathered` -- a gathered read of several small ranges of one object (the
  small :class:`ObjectRead` s of a plan, in runs). Storage: one ``read_into`` of the blocks a
  run covers.
- :meth:`Reader.read_windows` -- a windowed stream (a windowed :class:`CopyRead`). Storage: a
  window at a time, ``read_uncached`` past the page cache where none of it is cached, else
  ``read_steps``.

Compressed objects take the same three entry points (their frames are read with ``read_into``).
Besides them the reader only answers where a payload lives (:meth:`Reader.payload_runs`,
:meth:`Reader.payload_size`, :meth:`Reader.checked_payload_size`); a payload range into one
buffer is :func:`trainsnap.engine.read_executor.read_payload`, a plan of its own.
Whatever the road, each block is checked by :meth:`Reader._verify` -- the one place a digest
is compared -- before its bytes are used: as stored, and, for a compressed object, its frame as
stored and its block once decoded. A block a read did not use up is kept
(:class:`~trainsnap.engine.block_cache.BlockCache`), so each stored block is read and verified
once per process. A range costs at most one block of extra bytes at each end.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from trainsnap import faults, tunables
from trainsnap.engine.block_cache import BlockCache
from trainsnap.engine.buffers import BouncePool, Parts, scatter_copy
from trainsnap.engine.read_plan import CopyRead, ObjectRead, ReadPolicy, Run
from trainsnap.errors import CorruptError
from trainsnap.format import compression
from trainsnap.format.manifest import Manifest, object_key
from trainsnap.storage.base import (
    NotRegularFileError,
    ShortReadError,
    Storage,
    read_steps,
    read_uncached,
)

__all__ = ["Reader"]


class Reader:
    """Verified reads of a committed snapshot's objects (shard bytes, value bytes).

    Thread-safe: the executor's threads share one reader (and its block cache)."""

    def __init__(
        self, storage: Storage, manifest: Manifest, policy: ReadPolicy | None = None
    ) -> None:
        self.storage = storage
        self.m = manifest
        self.hasher = manifest.hasher
        self.policy = policy if policy is not None else ReadPolicy.from_tunables()
        self.bytes_read = 0
        """Bytes this reader fetched from storage."""
        self.blocks = BlockCache(tunables.get().block_cache)
        """Verified blocks a read did not use up, for the later reads that need them."""
        self._scratch = threading.local()
        self._chunk_pos: dict[int, list[int]] = {}
        self._sized: set[int] = set()
        self._lock = threading.Lock()
        self._direct = self.policy.direct and manifest.block_size % 4096 == 0
        self._cached: set[int] = set()
        """Objects a window of which was found in the page cache: their other windows are read
        through it without asking (a warm load would otherwise open each window twice)."""

    # -- the three reads --------------------------------------------------------------------

    def read(self, read: ObjectRead) -> None:
        """Fill ``read.parts`` with bytes ``[start, stop)`` of object ``read.obj``, every block
        verified.

        Whole blocks inside the range are read straight into the parts and verified as each
        lands (:meth:`_stream_blocks`); a block cut by either end of the range is read into a
        per-thread scratch block, verified, copied, and kept for the read that needs the rest
        of it. Cost: the range plus at most a block at each end; O(blocks + parts) Python work.
        """
        obj, start, stop, parts, key = read
        assert sum(len(p) for p in parts) == stop - start
        if self.m.compressed(obj):
            self._read_compressed_parts(obj, start, stop, parts, key)
            return
        bs = self.m.block_size
        size = int(self.m.object_sizes[obj])
        cursor = Parts(parts)
        pos = start
        while pos < stop:
            b = pos // bs
            b_lo, b_hi = b * bs, min((b + 1) * bs, size)
            if pos == b_lo and stop >= b_hi:
                run_hi = size if stop == size else stop // bs * bs
                self._whole_blocks(obj, b, run_hi, cursor.take(run_hi - pos), key)
                pos = run_hi
                continue
            block = self._kept_block(obj, b, b_hi - b_lo, key)
            hi = min(stop, b_hi)
            scatter_copy(block[pos - b_lo : hi - b_lo], cursor.take(hi - pos))
            pos = hi

    def read_gathered(self, reads: Sequence[ObjectRead], pool: BouncePool) -> None:
        """Fill the parts of several small reads of one object (sorted by start): the blocks
        covering them are read once into a bounce buffer from ``pool``, each verified once,
        and each range copied out; blocks a read shares with ranges outside ``reads`` are kept.
        Packed small tensors and values share blocks: this is what keeps a load from hashing
        one block per tensor. Cost: the blocks covered, once; O(reads + blocks) Python work."""
        obj = reads[0].obj
        lo = min(r.start for r in reads)
        hi = max(r.stop for r in reads)
        if self.m.compressed(obj):
            decoded = memoryview(bytearray(hi - lo))
            self._read_compressed(obj, lo, hi, decoded, reads[0].key)
            for r in reads:
                scatter_copy(decoded[r.start - lo : r.stop - lo], r.parts)
            return
        bs = self.m.block_size
        lo = lo // bs * bs
        hi = min(int(self.m.object_sizes[obj]), -(-hi // bs) * bs)
        stops = [r.stop for r in reads]

        def key_of(block: int) -> str:  # the first read that needs the block
            return reads[min(bisect_right(stops, block * bs), len(reads) - 1)].key

        with pool.buffer(hi - lo) as buf:
            self._fill_blocks(obj, lo, buf, _partly_used(reads, lo, hi, bs), key_of)
            for r in reads:
                scatter_copy(buf[r.start - lo : r.stop - lo], r.parts)

    def read_windows(self, copy: CopyRead, window: memoryview) -> None:
        """Hand ``copy``'s payload range to ``copy.place`` a window at a time: the stored
        blocks a window covers are read once into ``window`` (whole blocks: at most a block
        more than asked at each end), each verified as it lands, and ``place`` is given the
        window's part of the range while it is still in the processor's cache. A window none
        of whose bytes is cached comes straight from the device when the storage can
        (:meth:`_read_uncached`); a block the range cuts is kept for the read of its rest.
        Cost: the range's blocks; O(windows) Python work."""
        bs = self.m.block_size
        span = max(bs, len(window) // bs * bs)
        key, place = copy.key, copy.place
        for o, oo, po, n in copy.runs:
            if self.m.compressed(o):
                decoded = memoryview(bytearray(n))
                self._read_compressed(o, oo, oo + n, decoded, key)
                place(po, decoded)
                continue
            size = int(self.m.object_sizes[o])
            pos, end = oo, oo + n
            while pos < end:
                lo = pos // bs * bs
                hi = min(size, lo + span, -(-end // bs) * bs)
                view = window[: hi - lo]
                if not self._read_uncached(o, lo, window, hi - lo, key):
                    self._whole_blocks(o, lo // bs, hi, [view], key)
                top = min(end, hi)
                if pos > lo:  # the block's first bytes are another read's
                    self.blocks.put(o, lo // bs, view[: min(bs, hi - lo)])
                if top < hi:  # and its last
                    last = (top // bs) * bs
                    self.blocks.put(o, last // bs, view[last - lo :])
                place(po + pos - oo, view[pos - lo : top - lo])
                pos = top

    # -- where payloads live ----------------------------------------------------------------

    def payload_runs(self, owner: int, start: int, stop: int) -> list[Run]:
        """Where bytes ``[start, stop)`` of a payload (a shard's or value's bytes) live: one
        :class:`~trainsnap.engine.read_plan.Run` per chunk touched, in payload order."""
        rows = self.m.chunks_of(owner)
        pos = self._chunk_pos.get(owner)
        if pos is None:
            pos = [0]
            for c in rows:
                pos.append(pos[-1] + int(self.m.chunk_length[c]))
            self._chunk_pos[owner] = pos
        out = []
        for j, c in enumerate(rows):
            lo, hi = max(start, pos[j]), min(stop, pos[j + 1])
            if lo < hi:
                oo = int(self.m.chunk_offset[c]) + lo - pos[j]
                out.append(Run(int(self.m.chunk_object[c]), oo, lo, hi - lo))
        return out

    def payload_size(self, owner: int) -> int:
        return sum(int(self.m.chunk_length[c]) for c in self.m.chunks_of(owner))

    def checked_payload_size(self, owner: int, key: str) -> int:
        """The payload's size, once the objects it lives in are known to hold it: each object
        is as large as recorded, and the payload's chunks do not overlap. A caller may then
        allocate that many bytes: a crafted manifest cannot make it allocate more than the
        stored objects hold. One ``stat`` per object, the first time it is asked about."""
        spans = sorted(
            (int(self.m.chunk_object[c]), int(self.m.chunk_offset[c]), int(self.m.chunk_length[c]))
            for c in self.m.chunks_of(owner)
        )
        for obj in sorted({obj for obj, _, _ in spans} - self._sized):
            try:
                actual = self.storage.stat(object_key(self.m.object_names[obj]))
            except NotRegularFileError as e:
                why = f"is not a regular file of the root ({e.strerror})"
                raise self._fail(obj, why, key) from e
            except FileNotFoundError as e:
                raise self._fail(obj, "is missing", key) from e
            if actual < int(self.m.stored()[obj]):
                raise self._fail(obj, "is truncated", key)
            self._sized.add(obj)
        for (obj_a, start_a, length_a), (obj_b, start_b, _) in itertools.pairwise(spans):
            if obj_a == obj_b and start_a + length_a > start_b:
                raise self._fail(obj_a, "holds overlapping chunks of one payload", key)
        return sum(length for _, _, length in spans)

    # -- the one check ----------------------------------------------------------------------

    def _verify(
        self, obj: int, block: int, data: Sequence[memoryview], key: str, decoded: bool = False
    ) -> None:
        """Check block ``block`` of object ``obj`` (its bytes: one buffer, or a scatter list of
        them) against its digest in the manifest. Every strategy passes each block through
        here before its bytes are used: a raw object's blocks as stored; a compressed
        object's frames as stored, then (``decoded``) its blocks once decoded. Raises
        :class:`~trainsnap.errors.CorruptError` naming ``key``. O(block bytes)."""
        d = self.hasher.digest_size
        if decoded:
            expected = self.m.object_raw_blocks(obj)[block * d : (block + 1) * d]
        else:
            at = int(self.m.block_start()[obj]) + block
            expected = self.m.blocks[at * d : (at + 1) * d]
        if self.hasher.digest_parts(data) == expected:
            return
        if decoded:
            raise self._fail(obj, f"block {block} fails its checksum once decoded", key)
        what = "frame" if self.m.compressed(obj) else "block"
        raise self._fail(obj, f"{what} {block} fails its checksum", key)

    def _check(self, obj: int, first_block: int, data: memoryview, key: str) -> None:
        """:meth:`_verify` each block of ``data``, blocks ``first_block ..`` of ``obj``."""
        bs = self.m.block_size
        for i in range(0, len(data), bs):
            self._verify(obj, first_block + i // bs, [data[i : i + bs]], key)

    def _fail(self, obj: int, what: str, key: str) -> CorruptError:
        name = self.m.object_names[obj]
        return CorruptError(
            f"snapshot {self.m.snapshot_id}: object {name} ({what}) while reading {key!r}. The "
            "snapshot is damaged; restore an older one (CheckpointManager.restore falls back "
            "automatically) and run `trainsnap verify` on the root.",
            snapshot_id=self.m.snapshot_id,
            key=key,
            path=object_key(name),
        )

    # -- storage requests -------------------------------------------------------------------

    @contextlib.contextmanager
    def _reading(self, obj: int, key: str) -> Iterator[None]:
        """Storage errors of a request for object ``obj`` as the load's errors, naming the key."""
        faults.point("load_read")
        try:
            yield
        except NotRegularFileError as e:
            raise self._fail(obj, f"is not a regular file of the root ({e.strerror})", key) from e
        except FileNotFoundError as e:
            raise self._fail(obj, "is missing", key) from e
        except ShortReadError as e:
            raise self._fail(obj, "is truncated", key) from e

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_read += nbytes

    def _get(self, obj: int, start: int, out: memoryview, key: str) -> None:
        with self._reading(obj, key):
            self.storage.read_into(object_key(self.m.object_names[obj]), start, out)
        self._count(len(out))

    def _scratch_block(self) -> memoryview:
        buf = getattr(self._scratch, "buf", None)
        if buf is None:
            # no block is larger than the largest object: a crafted block size costs nothing
            sizes = self.m.object_sizes
            largest = int(sizes.max()) if len(sizes) else 0
            buf = self._scratch.buf = memoryview(bytearray(min(self.m.block_size, largest)))
        return buf

    def _kept_block(self, obj: int, block: int, size: int, key: str) -> memoryview:
        """Block ``block`` (``size`` bytes) of ``obj``, verified: from :attr:`blocks`, or read
        into the thread's scratch block, verified and kept for the next read of it."""
        held = self.blocks.get(obj, block)
        if held is not None:
            return memoryview(held)
        scratch = self._scratch_block()[:size]
        self._get(obj, block * self.m.block_size, scratch, key)
        self._verify(obj, block, [scratch], key)
        self.blocks.put(obj, block, scratch)
        return scratch

    def _whole_blocks(
        self, obj: int, first: int, stop: int, parts: list[memoryview], key: str
    ) -> None:
        """Blocks ``first ..`` up to byte ``stop`` of ``obj``, whole, into ``parts``: streamed
        (:meth:`_stream_blocks`), except those already held, which are copied."""
        bs = self.m.block_size
        last = -(-stop // bs)
        if not self.blocks.has_any(obj, first, last):
            self._stream_blocks(obj, first, parts, key)
            return
        cursor = Parts(parts)
        b = first
        while b < last:
            held = self.blocks.get(obj, b)
            if held is not None:
                scatter_copy(memoryview(held), cursor.take(len(held)))
                b += 1
                continue
            end = b + 1
            while end < last and self.blocks.get(obj, end) is None:
                end += 1
            self._stream_blocks(obj, b, cursor.take(min(stop, end * bs) - b * bs), key)
            b = end

    def _stream_blocks(self, obj: int, first: int, parts: list[memoryview], key: str) -> None:
        """Read whole blocks ``first, first + 1, ...`` of ``obj`` into ``parts``, verifying each
        block as soon as it lands: hashed while still in the processor's cache, a block costs
        a fraction of what hashing it back from memory after a large read does."""
        bs = self.m.block_size
        cursor = Parts(parts)
        total = sum(len(p) for p in parts)
        steps = [cursor.take(min(bs, total - pos)) for pos in range(0, total, bs)]

        def verify(i: int) -> None:
            self._verify(obj, first + i, steps[i], key)

        with self._reading(obj, key):
            name = object_key(self.m.object_names[obj])
            read_steps(self.storage, name, first * bs, steps, verify)
        self._count(total)

    def _read_uncached(self, obj: int, start: int, window: memoryview, n: int, key: str) -> bool:
        """Blocks from byte ``start`` (``n`` bytes) into ``window`` straight from the device
        when none is cached, by the page cache or by :attr:`blocks`
        (:func:`~trainsnap.storage.base.read_uncached`), then verified; False, with nothing
        read, where the storage cannot. The window is a bounce buffer either way, so this
        costs no extra copy, and saves the kernel's copy and its page-cache work."""
        bs = self.m.block_size
        if not self._direct or obj in self._cached:
            return False
        if self.blocks.has_any(obj, start // bs, -(-(start + n) // bs)):
            return False
        with self._reading(obj, key):
            name = object_key(self.m.object_names[obj])
            if not read_uncached(self.storage, name, start, window, n):
                self._cached.add(obj)
                return False
        self._check(obj, start // bs, window[:n], key)
        self._count(n)
        return True

    def _fill_blocks(
        self, obj: int, lo: int, buf: memoryview, keep: set[int], key_of: Callable[[int], str]
    ) -> None:
        """Fill ``buf`` with the verified blocks of ``obj`` from byte ``lo`` (a block
        boundary): held ones copied, each run of the others read once and verified (errors
        name ``key_of(block)``); the blocks in ``keep`` are then held for later reads."""
        bs = self.m.block_size
        first, last = lo // bs, -(-(lo + len(buf)) // bs)
        b = first
        while b < last:
            held = self.blocks.get(obj, b)
            if held is not None:
                buf[(b - first) * bs : (b - first) * bs + len(held)] = held
                b += 1
                continue
            end = b + 1
            while end < last and self.blocks.get(obj, end) is None:
                end += 1
            view = buf[(b - first) * bs : min(len(buf), (end - first) * bs)]
            self._get(obj, b * bs, view, key_of(b))
            for k in range(b, end):
                self._verify(obj, k, [view[(k - b) * bs : (k - b + 1) * bs]], key_of(k))
            for k in keep.intersection(range(b, end)):
                self.blocks.put(obj, k, view[(k - b) * bs : (k - b + 1) * bs])
            b = end

    # -- compressed objects -----------------------------------------------------------------

    def _read_compressed_parts(
        self, obj: int, start: int, stop: int, parts: list[memoryview], key: str
    ) -> None:
        if len(parts) == 1:
            self._read_compressed(obj, start, stop, parts[0], key)
            return
        decoded = memoryview(bytearray(stop - start))
        self._read_compressed(obj, start, stop, decoded, key)
        scatter_copy(decoded, parts)

    def _read_compressed(self, obj: int, start: int, stop: int, out: memoryview, key: str) -> None:
        """Read the frames of the blocks covering [start, stop) of compressed object ``obj``
        that are not held, once; verify each frame as stored and each block as decoded; copy
        the range out. A block the range cuts is kept, decoded, for the read of its rest."""
        bs = self.m.block_size
        size = int(self.m.object_sizes[obj])
        b0, b1 = start // bs, (stop - 1) // bs
        held = [self.blocks.get(obj, b) for b in range(b0, b1 + 1)]
        missing = [b for b, kept in enumerate(held, b0) if kept is None]
        stored, offsets, lo = memoryview(b""), np.zeros(0, np.int64), 0
        if missing:
            offsets = np.concatenate([[0], np.cumsum(self.m.object_frames(obj))])
            lo, hi = int(offsets[missing[0]]), int(offsets[missing[-1] + 1])
            stored = memoryview(bytearray(hi - lo))
            self._get(obj, lo, stored, key)
        codec = self.m.object_codecs[obj]
        for b, kept in enumerate(held, b0):
            n = min(bs, size - b * bs)
            if kept is not None:
                block = memoryview(kept)
            else:
                frame = stored[int(offsets[b]) - lo : int(offsets[b + 1]) - lo]
                self._verify(obj, b, [frame], key)
                try:
                    block = memoryview(compression.decompress_block(frame, codec, n))
                except ValueError as e:
                    raise self._fail(obj, f"frame {b} does not decode ({e})", key) from e
                self._verify(obj, b, [block], key, decoded=True)
            a, z = max(start, b * bs), min(stop, b * bs + n)
            out[a - start : z - start] = block[a - b * bs : z - b * bs]
            if kept is None and z - a < n:  # the rest of the block is another read's
                self.blocks.put(obj, b, block)


def _partly_used(reads: Sequence[ObjectRead], lo: int, hi: int, block_size: int) -> set[int]:
    """The blocks of ``[lo, hi)`` (block-aligned) that ``reads`` do not use up: another read
    may need the rest of their bytes."""
    used: dict[int, int] = {}
    for r in reads:
        for b in range(r.start // block_size, -(-r.stop // block_size)):
            a, z = max(r.start, b * block_size), min(r.stop, (b + 1) * block_size)
            used[b] = used.get(b, 0) + z - a
    return {
        b
        for b in range(lo // block_size, -(-hi // block_size))
        if used.get(b, 0) < min(hi, (b + 1) * block_size) - b * block_size
    }
