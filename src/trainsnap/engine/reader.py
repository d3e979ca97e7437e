"""Verified ranged reads: every block a reader touches is verified against its digest before
the caller can use the bytes; a reader fetches whole blocks, so a range costs at most one block
of extra bytes at each end.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator

import numpy as np

from trainsnap import faults, tunables
from trainsnap.engine.block_cache import BlockCache
from trainsnap.engine.buffers import BouncePool, Parts, scatter_copy
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


def _partly_used(
    segments: list[tuple[int, int, list[memoryview]]], lo: int, hi: int, block_size: int
) -> set[int]:
    """The blocks of ``[lo, hi)`` (block-aligned) that ``segments`` do not use up: another
    read may need the rest of their bytes."""
    used: dict[int, int] = {}
    for start, stop, _ in segments:
        for b in range(start // block_size, -(-stop // block_size)):
            a, z = max(start, b * block_size), min(stop, (b + 1) * block_size)
            used[b] = used.get(b, 0) + z - a
    return {
        b
        for b in range(lo // block_size, -(-hi // block_size))
        if used.get(b, 0) < min(hi, (b + 1) * block_size) - b * block_size
    }


class Reader:
    """Verified reads of a committed snapshot's payloads (shard bytes, value bytes)."""

    def __init__(self, storage: Storage, manifest: Manifest) -> None:
        self.storage = storage
        self.m = manifest
        self.hasher = manifest.hasher
        self._scratch = threading.local()
        self._chunk_pos: dict[int, list[int]] = {}
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._direct = tunables.get().direct_reads > 0 and manifest.block_size % 4096 == 0
        self.blocks = BlockCache(tunables.get().block_cache)
        """Verified blocks a read did not use up, for the later reads that need them."""
        self._cached: set[int] = set()
        """Objects a window of which was found in the page cache: their other windows are read
        through it without asking (a warm load would otherwise open each window twice)."""

    def _block(self) -> memoryview:
        buf = getattr(self._scratch, "buf", None)
        if buf is None:
            # no block is larger than the largest object: a crafted block size costs nothing
            sizes = self.m.object_sizes
            largest = int(sizes.max()) if len(sizes) else 0
            buf = self._scratch.buf = memoryview(bytearray(min(self.m.block_size, largest)))
        return buf

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

    @contextlib.contextmanager
    def _reading(self, obj: int, key: str) -> Iterator[None]:
        """Storage errors of a read of object ``obj`` as the load's errors, naming the key."""
        faults.point("load_read")
        try:
            yield
        except NotRegularFileError as e:
            raise self._fail(obj, f"is not a regular file of the root ({e.strerror})", key) from e
        except FileNotFoundError as e:
            raise self._fail(obj, "is missing", key) from e
        except ShortReadError as e:
            raise self._fail(obj, "is truncated", key) from e

    def _get(self, obj: int, start: int, out: memoryview, key: str) -> None:
        with self._reading(obj, key):
            self.storage.read_into(object_key(self.m.object_names[obj]), start, out)
        with self._lock:
            self.bytes_read += len(out)

    def _get_steps(
        self,
        obj: int,
        start: int,
        steps: list[list[memoryview]],
        done: Callable[[int], None],
        key: str,
    ) -> None:
        with self._reading(obj, key):
            read_steps(self.storage, object_key(self.m.object_names[obj]), start, steps, done)

    def _check(self, obj: int, first_block: int, data: memoryview, key: str) -> None:
        d = self.hasher.digest_size
        bs = self.m.block_size
        expected = self.m.object_blocks(obj)
        for i in range(0, len(data), bs):
            b = first_block + i // bs
            if self.hasher.digest(data[i : i + bs]) != expected[b * d : (b + 1) * d]:
                raise self._fail(obj, f"block {b} fails its checksum", key)

    def _read_compressed(self, obj: int, start: int, stop: int, out: memoryview, key: str) -> None:
        """Read the frames of the blocks covering [start, stop) once, verify each frame as
        stored and each block as decoded, and copy the range out."""
        bs = self.m.block_size
        size = int(self.m.object_sizes[obj])
        b0, b1 = start // bs, (stop - 1) // bs
        held = [self.blocks.get(obj, b) for b in range(b0, b1 + 1)]
        if all(block is not None for block in held):
            for b, block in enumerate(held, b0):
                assert block is not None
                a, z = max(start, b * bs), min(stop, b * bs + len(block))
                out[a - start : z - start] = block[a - b * bs : z - b * bs]
            return
        frames = self.m.object_frames(obj)
        offsets = np.concatenate([[0], np.cumsum(frames)])
        lo, hi = int(offsets[b0]), int(offsets[b1 + 1])
        stored = memoryview(bytearray(hi - lo))
        self._get(obj, lo, stored, key)
        d = self.hasher.digest_size
        digests, raw_digests = self.m.object_blocks(obj), self.m.object_raw_blocks(obj)
        codec = self.m.object_codecs[obj]
        for b in range(b0, b1 + 1):
            frame = stored[int(offsets[b]) - lo : int(offsets[b + 1]) - lo]
            if self.hasher.digest(frame) != digests[b * d : (b + 1) * d]:
                raise self._fail(obj, f"frame {b} fails its checksum", key)
            n = min(bs, size - b * bs)
            try:
                block = compression.decompress_block(frame, codec, n)
            except ValueError as e:
                raise self._fail(obj, f"frame {b} does not decode ({e})", key) from e
            if self.hasher.digest(block) != raw_digests[b * d : (b + 1) * d]:
                raise self._fail(obj, f"block {b} fails its checksum once decoded", key)
            a, z = max(start, b * bs), min(stop, b * bs + n)
            out[a - start : z - start] = block[a - b * bs : z - b * bs]
            if z - a < n:  # the rest of the block is another read's
                self.blocks.put(obj, b, memoryview(block))

    def _scatter_compressed(
        self, obj: int, segments: list[tuple[int, int, list[memoryview]]], key: str
    ) -> None:
        """Decode the blocks covering all segments once, then copy each segment out."""
        lo = min(a for a, _, _ in segments)
        hi = max(z for _, z, _ in segments)
        decoded = memoryview(bytearray(hi - lo))
        self._read_compressed(obj, lo, hi, decoded, key)
        for a, z, parts in segments:
            scatter_copy(decoded[a - lo : z - lo], parts)

    def read_object(self, obj: int, start: int, stop: int, out: memoryview, key: str) -> None:
        """Fill ``out`` with bytes ``[start, stop)`` of object ``obj``, every block verified."""
        self.read_object_parts(obj, start, stop, [out], key)

    def read_object_parts(
        self, obj: int, start: int, stop: int, parts: list[memoryview], key: str
    ) -> None:
        """Fill ``parts`` (destination buffers, back to back: the rows of a column piece, or a
        single buffer) with bytes ``[start, stop)`` of object ``obj``, every block verified.

        Whole blocks inside the range are read straight into the parts and verified as they
        land (see :meth:`_stream_blocks`); a block cut by either end of the range is read into
        a per-thread scratch block, verified, and copied.
        """
        assert sum(len(p) for p in parts) == stop - start
        if self.m.compressed(obj):
            if len(parts) == 1:
                self._read_compressed(obj, start, stop, parts[0], key)
            else:
                self._scatter_compressed(obj, [(start, stop, parts)], key)
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

    def _kept_block(self, obj: int, block: int, size: int, key: str) -> memoryview:
        """Block ``block`` (``size`` bytes) of ``obj``, verified: from :attr:`blocks`, or read
        into the thread's scratch block, verified and kept there for the next read of it."""
        held = self.blocks.get(obj, block)
        if held is not None:
            return memoryview(held)
        scratch = self._block()[:size]
        self._get(obj, block * self.m.block_size, scratch, key)
        self._check(obj, block, scratch, key)
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
            self._stream_blocks(obj, first, first * bs, parts, key)
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
            n = min(stop, end * bs) - b * bs
            self._stream_blocks(obj, b, b * bs, cursor.take(n), key)
            b = end

    def _stream_blocks(
        self, obj: int, first: int, start: int, parts: list[memoryview], key: str
    ) -> None:
        """Read whole blocks ``first, first + 1, ...`` (from byte ``start``) into ``parts``,
        verifying each block as soon as it lands: hashed while still in the processor's
        cache, a block costs a fraction of what hashing it back from memory after a large read
        does."""
        bs = self.m.block_size
        cursor = Parts(parts)
        total = sum(len(p) for p in parts)
        steps = [cursor.take(min(bs, total - pos)) for pos in range(0, total, bs)]
        d = self.hasher.digest_size
        expected = self.m.object_blocks(obj)

        def verify(i: int) -> None:
            b = first + i
            if self.hasher.digest_parts(steps[i]) != expected[b * d : (b + 1) * d]:
                raise self._fail(obj, f"block {b} fails its checksum", key)

        self._get_steps(obj, start, steps, verify, key)
        with self._lock:
            self.bytes_read += total

    def _read_uncached(self, obj: int, start: int, window: memoryview, n: int, key: str) -> bool:
        """Blocks from byte ``start`` (``n`` bytes) into ``window`` straight from the device
        when none is cached (:func:`~trainsnap.storage.base.read_uncached`), then verified;
        False, with nothing read, where the storage cannot. The window is a bounce buffer
        either way, so this costs no extra copy, and saves the kernel's copy and its page-cache
        work (the bytes land in memory, not in the cache, so they are hashed from memory)."""
        if not self._direct or obj in self._cached:
            return False
        with self._reading(obj, key):
            if not read_uncached(
                self.storage, object_key(self.m.object_names[obj]), start, window, n
            ):
                self._cached.add(obj)
                return False
        self._check(obj, start // self.m.block_size, window[:n], key)
        with self._lock:
            self.bytes_read += n
        return True

    def read_scatter(
        self,
        obj: int,
        segments: list[tuple[int, int, list[memoryview]]],
        key: str,
        pool: BouncePool,
    ) -> None:
        """Read the blocks covering several small ranges of object ``obj`` once, verify each
        block once, and copy each range ``(start, stop, parts)`` to its parts. Packed small
        tensors share blocks: this is what keeps a load from hashing one block per tensor."""
        if self.m.compressed(obj):
            self._scatter_compressed(obj, segments, key)
            return
        bs = self.m.block_size
        size = int(self.m.object_sizes[obj])
        lo = min(s for s, _, _ in segments) // bs * bs
        hi = min(size, -(-max(e for _, e, _ in segments) // bs) * bs)
        with pool.buffer(hi - lo) as buf:
            self._fill_blocks(obj, lo, buf, _partly_used(segments, lo, hi, bs), key)
            for start, stop, parts in segments:
                scatter_copy(buf[start - lo : stop - lo], parts)

    def _fill_blocks(self, obj: int, lo: int, buf: memoryview, keep: set[int], key: str) -> None:
        """Fill ``buf`` with the verified blocks of ``obj`` from byte ``lo`` (a block
        boundary): held ones copied, each run of the others read once and verified; the blocks
        in ``keep`` are then held for later reads."""
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
            self._get(obj, b * bs, view, key)
            self._check(obj, b, view, key)
            for k in keep.intersection(range(b, end)):
                self.blocks.put(obj, k, view[(k - b) * bs : (k - b + 1) * bs])
            b = end

    def read_payload_windows(
        self,
        owner: int,
        start: int,
        stop: int,
        window: memoryview,
        key: str,
        deliver: Callable[[int, memoryview], None],
    ) -> None:
        """Bytes ``[start, stop)`` of a payload, a window at a time: the stored blocks a window
        covers are read once into ``window`` (whole blocks: at most a block more than asked at
        each end of the range), each verified as it lands, and ``deliver(payload offset, bytes)``
        is handed the window's part of the range (valid only during the call) while it is still
        in the processor's cache. A window none of whose bytes is cached comes straight from the
        device when the storage can (:meth:`_read_uncached`)."""
        bs = self.m.block_size
        span = max(bs, len(window) // bs * bs)
        for o, oo, po, n in self.payload_runs(owner, start, stop):
            if self.m.compressed(o):
                decoded = memoryview(bytearray(n))
                self.read_object(o, oo, oo + n, decoded, key)
                deliver(po, decoded)
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
                deliver(po + pos - oo, view[pos - lo : top - lo])
                pos = top

    def payload_runs(self, owner: int, start: int, stop: int) -> list[tuple[int, int, int, int]]:
        """Where bytes ``[start, stop)`` of a payload (shard or value row) live:
        (object, object offset, payload offset, length) per chunk touched."""
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
                out.append((int(self.m.chunk_object[c]), oo, lo, hi - lo))
        return out

    def read_payload(self, owner: int, start: int, stop: int, out: memoryview, key: str) -> None:
        for o, oo, po, n in self.payload_runs(owner, start, stop):
            self.read_object(o, oo, oo + n, out[po - start : po - start + n], key)

    def payload_size(self, owner: int) -> int:
        return sum(int(self.m.chunk_length[c]) for c in self.m.chunks_of(owner))

    def checked_payload_size(self, owner: int, key: str) -> int:
        """The payload's size, once the objects it lives in are known to hold it: each object
        is as large as recorded, and the payload's chunks do not overlap. A caller may then
        allocate that many bytes: a crafted manifest cannot make it allocate more than the
        stored objects hold."""
        spans = sorted(
            (int(self.m.chunk_object[c]), int(self.m.chunk_offset[c]), int(self.m.chunk_length[c]))
            for c in self.m.chunks_of(owner)
        )
        for obj in sorted({obj for obj, _, _ in spans}):
            name = object_key(self.m.object_names[obj])
            try:
                actual = self.storage.stat(name)
            except NotRegularFileError as e:
                raise self._fail(
                    obj, f"is not a regular file of the root ({e.strerror})", key
                ) from e
            except FileNotFoundError as e:
                raise self._fail(obj, "is missing", key) from e
            if actual < int(self.m.stored()[obj]):
                raise self._fail(obj, "is truncated", key)
        for (obj_a, start_a, length_a), (obj_b, start_b, _) in itertools.pairwise(spans):
            if obj_a == obj_b and start_a + length_a > start_b:
                raise self._fail(obj_a, "holds overlapping chunks of one payload", key)
        return sum(length for _, _, length in spans)
