"""The I/O engine: a thread pool that hashes and writes objects, and verified ranged reads.

Hashing (xxhash, hashlib) and the read/write system calls release the GIL, so a few threads
keep the disk busy while Python only schedules. Every block a reader touches is verified against
its digest before the caller can use the bytes; a reader fetches whole blocks, so a range costs
at most one block of extra bytes at each end.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from . import compress, faults
from .checksum import Hasher
from .errors import CorruptError
from .manifest import Manifest, object_key
from .storage.base import ShortReadError, Storage

T = TypeVar("T")


def run_all(tasks: Iterable[Callable[[], T]], threads: int) -> list[T]:
    """Run tasks on a pool; on the first failure cancel what has not started, wait for what has
    (no thread may touch caller memory after this returns), and raise that failure."""
    tasks = list(tasks)
    if not tasks:
        return []
    if threads <= 1 or len(tasks) == 1:
        return [t() for t in tasks]
    with ThreadPoolExecutor(max_workers=min(threads, len(tasks))) as pool:
        futures: list[Future[T]] = [pool.submit(t) for t in tasks]
        _done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in futures if f.done() and not f.cancelled() and f.exception()]
        if failed:
            for f in pending:
                f.cancel()
            wait(pending)
            exc = failed[0].exception()
            assert exc is not None
            raise exc
        return [f.result() for f in futures]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (writable if the tensor is)."""
    assert t.device.type == "cpu" and t.is_contiguous(), "caller stages first"
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    array: Any = flat.view(torch.uint8).numpy()
    return memoryview(array).cast("B")


# -- writing --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WrittenObject:
    name: str
    size: int
    """Decoded size (what chunks address)."""
    digests: bytes
    """Digests of the blocks as stored."""
    written: bool
    """False when an object with this name (hence these bytes) was already stored."""
    codec: str = "raw"
    stored: int = -1
    """Bytes on storage (the size, unless compressed)."""
    frames: tuple[int, ...] = ()
    raw_digests: bytes = b""

    def manifest_row(self) -> tuple[str, int, bytes, str, int, tuple[int, ...], bytes]:
        stored = self.size if self.stored < 0 else self.stored
        return (self.name, self.size, self.digests, self.codec, stored, self.frames,
                self.raw_digests)  # fmt: skip


def write_object(
    storage: Storage, hasher: Hasher, data: memoryview, codec: str = "raw"
) -> WrittenObject:
    """Hash ``data`` (compressing it first, block by block, for a codec other than raw), name
    it by its stored content and store it unless it is already there."""
    frames: tuple[int, ...] = ()
    if codec == "raw":
        stored_view, raw_digests = data, b""
    else:
        bs = hasher.block_size
        blocks = [data[i : i + bs] for i in range(0, len(data), bs)]
        raw_digests = b"".join(hasher.digest(b) for b in blocks)
        parts = [compress.compress_block(b, codec) for b in blocks]
        frames = tuple(len(p) for p in parts)
        stored_view = memoryview(b"".join(parts))
    digests = (
        hasher.block_digests(stored_view)
        if codec == "raw"
        else b"".join(hasher.digest(p) for p in _frames(stored_view, frames))
    )
    size = len(stored_view)
    name = hasher.object_name(size, digests)
    key = object_key(name)
    with _one_writer(name):  # the same bytes written by another thread: wait, then reuse
        return _store(storage, key, name, data, stored_view, digests, codec, frames, raw_digests)


_writing: dict[str, threading.Event] = {}
_writing_lock = threading.Lock()


@contextmanager
def _one_writer(name: str) -> Iterator[None]:
    """Writers of the same object in this process take turns: identical chunks in one save
    (all-zero moments, say) are written once, and the later writers find the object stored
    (or, if the first one failed, write it themselves)."""
    while True:
        with _writing_lock:
            event = _writing.get(name)
            if event is None:
                event = _writing[name] = threading.Event()
                break
        event.wait()
    try:
        yield
    finally:
        with _writing_lock:
            del _writing[name]
        event.set()


def _store(
    storage: Storage,
    key: str,
    name: str,
    data: memoryview,
    stored_view: memoryview,
    digests: bytes,
    codec: str,
    frames: tuple[int, ...],
    raw_digests: bytes,
) -> WrittenObject:
    size = len(stored_view)
    row = {"codec": codec, "stored": size, "frames": frames, "raw_digests": raw_digests}
    try:
        if storage.stat(key) == size:
            # Reused: refresh it so a collector's grace period covers it until we commit.
            storage.refresh(key, stored_view)
            return WrittenObject(name, len(data), digests, False, **row)  # type: ignore[arg-type]
    except FileNotFoundError:
        pass
    faults.point("before_write")
    storage.put(key, stored_view)
    faults.point("after_write")
    on_disk = storage.stat(key)
    if on_disk != size:
        raise OSError(f"object {key} reads back {on_disk} bytes after writing {size}")
    return WrittenObject(name, len(data), digests, True, **row)  # type: ignore[arg-type]


def _frames(stored: memoryview, frames: tuple[int, ...]) -> list[memoryview]:
    out, pos = [], 0
    for n in frames:
        out.append(stored[pos : pos + n])
        pos += n
    return out


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


# -- reading --------------------------------------------------------------------------------------


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
            old.close()
        self.mapped += size
        self.maps += 1
        return _map(size)

    def close(self) -> None:
        with self._cv:
            for region in self._free:
                self.mapped -= len(region)
                region.close()
            self._free.clear()


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

    def _block(self) -> memoryview:
        buf = getattr(self._scratch, "buf", None)
        if buf is None:
            buf = self._scratch.buf = memoryview(bytearray(self.m.block_size))
        return buf

    def _fail(self, o: int, what: str, key: str) -> CorruptError:
        name = self.m.object_names[o]
        return CorruptError(
            f"snapshot {self.m.snapshot_id}: object {name} ({what}) while reading {key!r}. The "
            "snapshot is damaged; restore an older one (CheckpointManager.restore falls back "
            "automatically) and run `trainsnap verify` on the root.",
            snapshot_id=self.m.snapshot_id,
            key=key,
            path=object_key(name),
        )

    def _get(self, o: int, start: int, out: memoryview, key: str) -> None:
        faults.point("load_read")
        try:
            self.storage.read_into(object_key(self.m.object_names[o]), start, out)
        except FileNotFoundError as e:
            raise self._fail(o, "is missing", key) from e
        except ShortReadError as e:
            raise self._fail(o, "is truncated", key) from e
        with self._lock:
            self.bytes_read += len(out)

    def _check(self, o: int, first_block: int, data: memoryview, key: str) -> None:
        d = self.hasher.digest_size
        bs = self.m.block_size
        expected = self.m.object_blocks(o)
        for i in range(0, len(data), bs):
            b = first_block + i // bs
            if self.hasher.digest(data[i : i + bs]) != expected[b * d : (b + 1) * d]:
                raise self._fail(o, f"block {b} fails its checksum", key)

    def _read_compressed(self, o: int, start: int, stop: int, out: memoryview, key: str) -> None:
        """Read the frames of the blocks covering [start, stop) once, verify each frame as
        stored and each block as decoded, and copy the range out."""
        bs = self.m.block_size
        size = int(self.m.object_sizes[o])
        b0, b1 = start // bs, (stop - 1) // bs
        frames = self.m.object_frames(o)
        offsets = np.concatenate([[0], np.cumsum(frames)])
        lo, hi = int(offsets[b0]), int(offsets[b1 + 1])
        stored = memoryview(bytearray(hi - lo))
        self._get(o, lo, stored, key)
        d = self.hasher.digest_size
        digests, raw_digests = self.m.object_blocks(o), self.m.object_raw_blocks(o)
        codec = self.m.object_codecs[o]
        for b in range(b0, b1 + 1):
            frame = stored[int(offsets[b]) - lo : int(offsets[b + 1]) - lo]
            if self.hasher.digest(frame) != digests[b * d : (b + 1) * d]:
                raise self._fail(o, f"frame {b} fails its checksum", key)
            n = min(bs, size - b * bs)
            try:
                block = compress.decompress_block(frame, codec, n)
            except ValueError as e:
                raise self._fail(o, f"frame {b} does not decode ({e})", key) from e
            if self.hasher.digest(block) != raw_digests[b * d : (b + 1) * d]:
                raise self._fail(o, f"block {b} fails its checksum once decoded", key)
            a, z = max(start, b * bs), min(stop, b * bs + n)
            out[a - start : z - start] = block[a - b * bs : z - b * bs]

    def _scatter_compressed(
        self, o: int, segments: list[tuple[int, int, memoryview]], key: str
    ) -> None:
        """Decode the blocks covering all segments once, then copy each segment out."""
        lo = min(a for a, _, _ in segments)
        hi = max(z for _, z, _ in segments)
        decoded = memoryview(bytearray(hi - lo))
        self._read_compressed(o, lo, hi, decoded, key)
        for a, z, out in segments:
            out[:] = decoded[a - lo : z - lo]

    def read_object(self, o: int, start: int, stop: int, out: memoryview, key: str) -> None:
        """Fill ``out`` with bytes ``[start, stop)`` of object ``o``, every block verified.

        Whole blocks inside the range are read straight into ``out``; a block cut by either
        end of the range is read into a per-thread scratch block, verified, and copied.
        """
        assert len(out) == stop - start
        if self.m.compressed(o):
            self._read_compressed(o, start, stop, out, key)
            return
        bs = self.m.block_size
        size = int(self.m.object_sizes[o])
        pos = start
        while pos < stop:
            b = pos // bs
            b_lo, b_hi = b * bs, min((b + 1) * bs, size)
            if pos == b_lo and stop >= b_hi:
                # A run of whole blocks: read directly, verify in place.
                n_whole = (stop - b_lo) // bs
                run_hi = min(b_lo + n_whole * bs, size) if n_whole else b_hi
                if stop == size:
                    run_hi = size
                dst = out[pos - start : run_hi - start]
                self._get(o, pos, dst, key)
                self._check(o, b, dst, key)
                pos = run_hi
                continue
            scratch = self._block()[: b_hi - b_lo]
            self._get(o, b_lo, scratch, key)
            self._check(o, b, scratch, key)
            hi = min(stop, b_hi)
            out[pos - start : hi - start] = scratch[pos - b_lo : hi - b_lo]
            pos = hi

    def read_scatter(
        self,
        o: int,
        segments: list[tuple[int, int, memoryview]],
        key: str,
        pool: BouncePool,
    ) -> None:
        """Read the blocks covering several small ranges of object ``o`` once, verify each block
        once, and copy each range ``(start, stop, out)`` to its ``out``. Packed small tensors
        share blocks: this is what keeps a load from hashing one block per tensor."""
        if self.m.compressed(o):
            self._scatter_compressed(o, segments, key)
            return
        bs = self.m.block_size
        size = int(self.m.object_sizes[o])
        lo = min(s for s, _, _ in segments) // bs * bs
        hi = min(size, -(-max(e for _, e, _ in segments) // bs) * bs)
        with pool.buffer(hi - lo) as buf:
            self._get(o, lo, buf, key)
            self._check(o, lo // bs, buf, key)
            for start, stop, out in segments:
                out[:] = buf[start - lo : stop - lo]

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
