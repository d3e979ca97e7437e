"""The disk's limit: the same bytes written and read back by a thread pool, with no format, no
hashing and no placement logic.

``save`` cuts the concatenation of the tensors' bytes into one file per thread and writes each
with ``writev``, fsyncing every file and then the directory; ``load`` reads those files back
with ``preadv`` straight into the destination tensors. Given ``ranges`` (see
:func:`trainsnap_read_ranges`), ``load`` instead reads byte ranges of another method's files
into one scratch buffer: what the disk allows for exactly the bytes that method's load reads;
with ``direct`` as well, it reads them past the page cache (``O_DIRECT``, each range widened to
whole pages, into a page-aligned buffer): what the device allows without the kernel's copy.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from benchmarks._framework.method import Method, State
from benchmarks._framework.state import MiB, tensor_view
from benchmarks._framework.system import fsync_dir

T = TypeVar("T")

_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024
_MAX_IO = 1 << 30  # bytes per system call (Linux caps one call near 2 GiB)
RANGE_PIECE = 32 * MiB  # the largest range one read of ``ranges`` mode asks for
PAGE = 4096  # the alignment of a direct read's offset, length and memory

Range = tuple[str, int, int]
"""(path, offset, length) of bytes to read."""


@dataclass(frozen=True, slots=True)
class _Job:
    """Read (or write) ``buffers`` consecutively at ``offset`` of the file ``path``."""

    path: Path
    offset: int
    buffers: list[memoryview]


@dataclass(frozen=True, slots=True)
class RawLayout:
    """The concatenation of the tensors' bytes cut into ``len(files)`` nearly equal files.

    ``files[i]`` lists (tensor index, byte offset in the tensor, length) in file order.
    """

    files: list[list[tuple[int, int, int]]]
    sizes: list[int]

    @staticmethod
    def plan(nbytes: Sequence[int], file_count: int) -> RawLayout:
        total = sum(nbytes)
        file_count = max(1, min(file_count, total)) if total else 1
        bounds = [total * (i + 1) // file_count for i in range(file_count)]
        files: list[list[tuple[int, int, int]]] = [[] for _ in range(file_count)]
        sizes = [0] * file_count
        current, position = 0, 0
        for index, size in enumerate(nbytes):
            offset = 0
            while offset < size:
                while position >= bounds[current]:
                    current += 1
                take = min(size - offset, bounds[current] - position)
                files[current].append((index, offset, take))
                sizes[current] += take
                offset += take
                position += take
        return RawLayout(files, sizes)


def _pieces(views: Sequence[memoryview], parts: list[tuple[int, int, int]]) -> list[memoryview]:
    pieces = []
    for index, offset, length in parts:
        for low in range(offset, offset + length, _MAX_IO):
            pieces.append(views[index][low : min(offset + length, low + _MAX_IO)])
    return pieces


def _batches(buffers: list[memoryview]) -> Iterator[list[memoryview]]:
    """``buffers`` in groups one system call takes (``IOV_MAX`` buffers, ``_MAX_IO`` bytes)."""
    batch: list[memoryview] = []
    size = 0
    for buffer in buffers:
        if batch and (len(batch) == _IOV_MAX or size + len(buffer) > _MAX_IO):
            yield batch
            batch, size = [], 0
        batch.append(buffer)
        size += len(buffer)
    if batch:
        yield batch


def _advance(buffers: list[memoryview], count: int) -> list[memoryview]:
    """``buffers`` less their first ``count`` bytes."""
    index = 0
    while index < len(buffers) and count >= len(buffers[index]):
        count -= len(buffers[index])
        index += 1
    rest = buffers[index:]
    if rest and count:
        rest[0] = rest[0][count:]
    return rest


def _write(job: _Job) -> int:
    fd = os.open(job.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for first in _batches(job.buffers):
            batch = first
            while batch:
                batch = _advance(batch, os.writev(fd, batch))
        os.fsync(fd)
    finally:
        os.close(fd)
    return sum(len(buffer) for buffer in job.buffers)


def _read(job: _Job, flags: int = 0) -> int:
    fd = os.open(job.path, os.O_RDONLY | flags)
    position = job.offset
    try:
        for first in _batches(job.buffers):
            batch = first
            while batch:
                count = os.preadv(fd, batch, position)
                if count == 0 and flags:
                    return position - job.offset  # a page-widened range ends with the file
                if count == 0:
                    raise OSError(f"{job.path}: short read at byte {position}")
                position += count
                batch = _advance(batch, count)
    finally:
        os.close(fd)
    return position - job.offset


def _read_direct(job: _Job) -> int:
    return _read(job, os.O_DIRECT)


def direct_io_works(directory: Path) -> bool:
    """Whether the file system of ``directory`` takes ``O_DIRECT`` opens (tmpfs does not)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / ".direct-probe"
    probe.write_bytes(b"")
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


def _in_parallel(threads: int, function: Callable[[_Job], T], jobs: list[_Job]) -> list[T]:
    if threads <= 1 or len(jobs) == 1:
        return [function(job) for job in jobs]
    with ThreadPoolExecutor(max_workers=min(threads, len(jobs))) as pool:
        return list(pool.map(function, jobs))


def raw_file_name(index: int) -> str:
    return f"part-{index:04d}.bin"


class RawLimit(Method):
    """The disk's limit for the same bytes on ``threads`` threads (see the module's docstring).

    With ``ranges`` (a function of the destination and the directory), the method only loads:
    it reads those byte ranges, cut at 32 MiB, into one touched buffer kept between loads (as a
    load's destination is), and does not place them (``verifiable`` is False); with ``direct``
    too, past the page cache, each piece widened to whole pages.
    """

    name = "raw"

    def __init__(
        self,
        threads: int,
        *,
        ranges: Callable[[State, Path], list[Range]] | None = None,
        direct: bool = False,
        name: str = "raw",
        label: str = "raw",
    ) -> None:
        if direct and ranges is None:
            raise ValueError("direct reads are for ranges mode")
        self.threads = threads
        self.ranges = ranges
        self.direct = direct
        self.name, self.label = name, label
        self.can_save = self.verifiable = ranges is None
        self.range_jobs: list[_Job] = []
        self.buffer = memoryview(bytearray(0))
        self.last_bytes = 0

    def _file_jobs(self, tensors: State, directory: Path) -> tuple[list[_Job], RawLayout]:
        views = [tensor_view(tensor) for tensor in tensors.values()]
        layout = RawLayout.plan([len(view) for view in views], self.threads)
        jobs = [
            _Job(directory / raw_file_name(i), 0, _pieces(views, parts))
            for i, parts in enumerate(layout.files)
        ]
        return jobs, layout

    def save(self, state: State, directory: Path) -> None:
        jobs, _ = self._file_jobs(state, directory)
        _in_parallel(self.threads, _write, jobs)
        fsync_dir(directory)

    def prepare_load(self, destination: State, directory: Path) -> None:
        if self.ranges is None:
            return
        pieces = [
            (path, start, min(offset + length, start + RANGE_PIECE) - start)
            for path, offset, length in self.ranges(destination, directory)
            for start in range(offset, offset + length, RANGE_PIECE)
        ]
        if self.direct:  # whole pages, each piece at a page of the buffer
            pieces = [
                (path, start // PAGE * PAGE, -(-(start + n) // PAGE) * PAGE - start // PAGE * PAGE)
                for path, start, n in pieces
            ]
        size = sum(length for _, _, length in pieces)
        if len(self.buffer) < size:
            self.buffer = self._new_buffer(size)
        self.range_jobs, at = [], 0
        for path, offset, length in pieces:
            self.range_jobs.append(_Job(Path(path), offset, [self.buffer[at : at + length]]))
            at += length
        self.last_bytes = size

    def _new_buffer(self, size: int) -> memoryview:
        if not self.direct:
            return memoryview(bytearray(size))  # zero-filled: every page touched
        region = mmap.mmap(-1, size)  # page-aligned, as direct reads need
        view = memoryview(region)
        for at in range(0, size, RANGE_PIECE):  # every page touched
            view[at : at + RANGE_PIECE] = bytes(min(RANGE_PIECE, size - at))
        return view

    def load(self, destination: State, directory: Path) -> None:
        if self.ranges is not None:
            _in_parallel(self.threads, _read_direct if self.direct else _read, self.range_jobs)
            return
        jobs, layout = self._file_jobs(destination, directory)
        got = _in_parallel(self.threads, _read, jobs)
        if got != layout.sizes:
            raise OSError(f"raw read: file sizes {got} differ from the layout's {layout.sizes}")
        self.last_bytes = sum(got)


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ``spans`` (start, end), overlapping and touching ones merged."""
    spans = sorted(spans)
    merged = [spans[0]]
    for start, end in spans[1:]:
        if start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def trainsnap_read_ranges(
    destination: State, directory: Path, *, rank: int, same_world: bool
) -> list[Range]:
    """The byte ranges of the snapshot's object files in ``directory`` that this rank's
    ``ts.load`` of ``destination`` reads (found with trainsnap's own load planner), merged per
    object."""
    import trainsnap as ts
    from trainsnap.engine.reader import Reader
    from trainsnap.format.manifest import object_key
    from trainsnap.protocol import commit, rank_load
    from trainsnap.state.template import targets

    storage = ts.open_storage(directory)
    (info,) = ts.list_snapshots(storage)
    manifest = commit.open_snapshot(storage, info.id)
    reader = Reader(storage, manifest)
    spans: dict[int, list[tuple[int, int]]] = {}
    indexes: dict[int, Any] = {}
    for target, tensor_index in rank_load.match(manifest, targets(destination), rank, same_world):
        itemsize = target.itemsize
        for shard, pieces in rank_load._overlaps(
            manifest, tensor_index, target.item.region, indexes
        ):
            for piece in pieces:
                low, high = piece.src_span()
                runs = reader.payload_runs(shard, low * itemsize, high * itemsize)
                for obj, offset, _, length in runs:
                    spans.setdefault(obj, []).append((offset, offset + length))
    return [
        (str(directory / object_key(manifest.object_names[obj])), start, end - start)
        for obj, object_spans in spans.items()
        for start, end in _merged(object_spans)
    ]
