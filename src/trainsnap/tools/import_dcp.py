"""Import a ``torch.distributed.checkpoint`` (DCP) directory as a committed trainsnap snapshot.

A DCP directory written by ``dcp.save`` with ``FileSystemWriter`` holds a pickled ``.metadata``
(every tensor's dtype, global shape and chunks; where each chunk's item lives: file, offset,
length) and ``.distcp`` files that concatenate items. In torch's default format each tensor item
is a complete ``torch.save`` archive of that chunk (a zip whose data record holds the raw
storage), and each non-tensor item is ``torch.save`` of the object.

Nothing is loaded whole. For each tensor item only the zip directory and the small pickle are
read (``torch.load(..., map_location="meta")`` gives dtype, shape, strides and storage offset
without touching the data); the chunk's bytes are then read straight from the data record in
pieces of at most one object (``chunk_size``), hashed block by block and written as
content-addressed objects. Each chunk becomes a box shard of its logical tensor. A chunk whose
storage is not its row-major bytes (a transposed view that DCP saved as is) is the one exception:
that item is loaded (it alone) and made contiguous. Non-tensor items become JSON values when
they load with ``weights_only=True`` as plain data, and are skipped with a warning otherwise.

The snapshot commits like any save: objects, then the manifest, then the marker.
"""

from __future__ import annotations

import io
import logging
import os
import re
import stat
import struct
import threading
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, Any, Final, Protocol, cast

import torch

from trainsnap import tunables
from trainsnap.engine.buffers import tensor_bytes
from trainsnap.engine.pool import run_all
from trainsnap.engine.writer import WrittenObject, write_object
from trainsnap.errors import (
    CorruptError,
    IncompatibleError,
    InvalidArgumentError,
    NotFoundError,
    TrainsnapError,
)
from trainsnap.format import values
from trainsnap.format.checksums import Hasher
from trainsnap.format.layout import layout_objects
from trainsnap.format.manifest import STATE_KINDS, Manifest, ManifestBuilder, keys_summary
from trainsnap.format.regions import Box, tiling_problems
from trainsnap.integrations.dcp_metadata import read_metadata
from trainsnap.protocol import commit
from trainsnap.protocol.assemble import library_versions, now_iso
from trainsnap.protocol.snapshot_info import SnapshotInfo
from trainsnap.storage import Root, Storage, open_storage

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]
"""Called with (bytes just written, total bytes to write)."""

_ZIP_MAGIC: Final = b"PK\x03\x04"
_RECORD_RE: Final = re.compile(r"(^|/)data/\d+$")
_RANK_FILE_RE: Final = re.compile(r"^__(\d+)_\d+\.distcp$")


# -- sources: where a payload's bytes come from ---------------------------------------------------


def _pread_into(fd: int, out: memoryview, pos: int) -> int:
    """Read into ``out`` at file offset ``pos`` without a shared file position (threads)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [out], pos)
    data = os.pread(fd, len(out), pos)
    out[: len(data)] = data
    return len(data)


class _Source(Protocol):
    size: int

    def read(self, off: int, out: memoryview) -> None: ...


@dataclass(frozen=True, slots=True)
class _Where:
    """One DCP item, for errors that name the key, the file and the fix."""

    key: str
    path: str
    offset: int

    def damaged(self, why: str) -> CorruptError:
        return CorruptError(
            f"DCP item {self.key!r} at {self.path}:{self.offset} {why}. The checkpoint is "
            "damaged or incomplete: copy it again, or re-save it with dcp.save.",
            key=self.key,
            path=self.path,
        )

    def unsupported(self, why: str) -> IncompatibleError:
        return IncompatibleError(
            f"DCP item {self.key!r} at {self.path}:{self.offset} {why}, which import-dcp does "
            "not read. Load the checkpoint with dcp.load and ts.save it instead.",
            key=self.key,
            path=self.path,
        )


@dataclass(slots=True)
class _FileRange:
    """Bytes ``[offset, offset + size)`` of an open file: a chunk stored row-major."""

    fd: int
    offset: int
    size: int
    where: _Where

    def read(self, off: int, out: memoryview) -> None:
        pos = 0
        while pos < len(out):
            n = _pread_into(self.fd, out[pos:], self.offset + off + pos)
            if n <= 0:
                raise self.where.damaged("ends before its recorded length")
            pos += n


@dataclass(slots=True)
class _Bytes:
    data: bytes
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.size = len(self.data)

    def read(self, off: int, out: memoryview) -> None:
        out[:] = self.data[off : off + len(out)]


@dataclass(slots=True)
class _Materialized:
    """A chunk whose stored storage is not its row-major bytes: loaded (this item alone) on
    first use, made contiguous, and dropped once every part of it has been copied."""

    load: Callable[[], torch.Tensor]
    size: int
    uses: int = 0
    _tensor: torch.Tensor | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def read(self, off: int, out: memoryview) -> None:
        with self._lock:
            if self._tensor is None:
                self._tensor = self.load().contiguous()
            t = self._tensor
            self.uses -= 1
            if self.uses <= 0:
                self._tensor = None
        out[:] = tensor_bytes(t)[off : off + len(out)]


class _View(io.RawIOBase):
    """A read-only, seekable window on bytes ``[offset, offset + length)`` of a file, so that
    ``torch.load`` and ``zipfile`` see one DCP item as a file of its own and read only what
    they ask for."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self._fd, self._offset, self._length, self._pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buf: Any) -> int:
        out = memoryview(buf).cast("B")
        n = max(0, min(len(out), self._length - self._pos))
        if n == 0:
            return 0
        got = _pread_into(self._fd, out[:n], self._offset + self._pos)
        self._pos += got
        return got


class _Files:
    """Open ``.distcp`` files by relative path, refusing any path outside the directory."""

    def __init__(self, base: Path) -> None:
        self.base = base.resolve()
        self._fds: dict[str, int] = {}
        self._sizes: dict[str, int] = {}

    def fd(self, rel: str) -> int:
        if rel not in self._fds:
            path = (self.base / rel).resolve()
            if not path.is_relative_to(self.base):
                raise CorruptError(
                    f"DCP checkpoint {self.base}: item file {rel!r} lies outside the directory",
                    path=str(self.base),
                )
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            except FileNotFoundError:
                raise NotFoundError(
                    f"DCP checkpoint {self.base} lacks its data file {rel!r}: the directory is "
                    "incomplete; copy it whole",
                    path=str(path),
                ) from None
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                os.close(fd)
                raise CorruptError(
                    f"DCP checkpoint {self.base}: item file {rel!r} is not a regular file",
                    path=str(path),
                )
            self._fds[rel], self._sizes[rel] = fd, info.st_size
        return self._fds[rel]

    def item(self, info: Any, key: str) -> tuple[int, _Where]:
        """The open file of a DCP item and where it is, refusing (before anything is read or
        allocated) an item whose recorded range runs past its file's end."""
        fd = self.fd(info.relative_path)
        where = _Where(key, str(self.base / info.relative_path), int(info.offset))
        if info.offset + info.length > self._sizes[info.relative_path]:
            raise where.damaged(
                f"of {info.length} bytes runs past the end of its "
                f"{self._sizes[info.relative_path]}-byte file"
            )
        return fd, where

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@contextmanager
def _open_files(base: Path) -> Iterator[_Files]:
    files = _Files(base)
    try:
        yield files
    finally:
        files.close()


# -- reading the DCP ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Tensor:
    key: str
    dtype: str
    shape: tuple[int, ...]
    shards: list[tuple[Box, _Source]] = field(default_factory=list)


@dataclass(slots=True)
class _Collected:
    tensors: list[_Tensor]
    values: list[tuple[str, bytes]]
    skipped: list[str]


def _read_metadata(base: Path, trust_pickle: bool) -> Any:
    if not (base / ".metadata").is_file():
        raise NotFoundError(
            f"{base} is not a torch.distributed.checkpoint directory (no .metadata file); give "
            "the directory dcp.save(..., checkpoint_id=...) wrote",
            path=str(base),
        )
    try:
        return read_metadata(base / ".metadata", trust=trust_pickle)
    except TrainsnapError:
        raise
    except Exception as e:
        raise CorruptError(
            f"DCP checkpoint {base}: its .metadata cannot be read ({type(e).__name__}: {e}); "
            "the directory is damaged or was written by an incompatible torch",
            path=str(base / ".metadata"),
        ) from e


def _storage_info(metadata: Any, base: Path, index: Any) -> Any:
    info = (metadata.storage_data or {}).get(index)
    if info is None or not hasattr(info, "relative_path"):
        raise IncompatibleError(
            f"DCP checkpoint {base}: no file location for {index.fqn!r}; only checkpoints written "
            "by FileSystemWriter can be imported (load others with dcp.load and ts.save them)",
            path=str(base),
            key=index.fqn,
        )
    if getattr(info, "transform_descriptors", None):
        raise IncompatibleError(
            f"DCP checkpoint {base}: {index.fqn!r} was written through storage extensions "
            f"{list(info.transform_descriptors)} (compression...), which import-dcp does not "
            "decode; load it with dcp.load and ts.save it instead",
            path=str(base),
            key=index.fqn,
        )
    return info


def _record_start(view: _View, where: _Where) -> tuple[int, int]:
    """(offset of the storage record's data in the item, its size): from the zip directory
    and the record's local header, reading neither the record nor anything else."""
    try:
        with zipfile.ZipFile(view) as z:
            records = [i for i in z.infolist() if _RECORD_RE.search(i.filename)]
            order = [i for i in z.infolist() if i.filename.endswith("/byteorder")]
            big = order and z.read(order[0]).decode(errors="replace") != "little"
    except zipfile.BadZipFile as e:
        raise where.damaged(f"is not a readable zip archive ({e})") from e
    if big:
        raise where.unsupported("was written on a big-endian machine")
    if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED:
        raise where.unsupported("does not hold exactly one uncompressed storage record")
    rec = records[0]
    view.seek(rec.header_offset)
    head = view.read(30)
    if len(head) != 30 or head[:4] != _ZIP_MAGIC:
        raise where.damaged("has a bad zip local header")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return rec.header_offset + 30 + name_len + extra_len, rec.file_size


def _tensor_source(files: _Files, info: Any, key: str, dtype: torch.dtype, box: Box) -> _Source:
    """Where the row-major bytes of one chunk are, checked against the DCP metadata."""
    fd, where = files.item(info, key)
    view = _View(fd, info.offset, info.length)
    if view.read(4) != _ZIP_MAGIC:
        raise where.unsupported("is not a torch.save archive (a safetensors-format DCP?)")
    view.seek(0)
    try:
        meta = torch.load(cast(IO[bytes], view), map_location="meta", weights_only=True)
    except Exception as e:  # whatever torch raises for a bad archive
        raise where.damaged(f"cannot be read ({type(e).__name__}: {e})") from e
    if not isinstance(meta, torch.Tensor) or meta.dtype != dtype or meta.shape != box.sizes:
        raise where.damaged(f"holds {meta!r} where the metadata promised {dtype} {box.sizes}")
    nbytes = box.numel * dtype.itemsize
    if not meta.is_contiguous():
        return _Materialized(partial(_load_item, fd, info, where), nbytes)
    view.seek(0)
    start, record_size = _record_start(view, where)
    first = meta.storage_offset() * dtype.itemsize
    if first + nbytes > record_size or start + record_size > info.length:
        raise where.damaged("has a storage record shorter than its tensor")
    return _FileRange(fd, info.offset + start + first, nbytes, where)


def _load_item(fd: int, info: Any, where: _Where) -> torch.Tensor:
    view = cast(IO[bytes], _View(fd, info.offset, info.length))
    t = torch.load(view, map_location="cpu", weights_only=True)
    if not isinstance(t, torch.Tensor):
        raise where.damaged("does not hold a tensor")
    return t


def _value(files: _Files, info: Any, key: str) -> bytes | None:
    """The item as trainsnap JSON, or None when it is not plain data (or will not load without
    running code from the checkpoint)."""
    fd, where = files.item(info, key)
    raw = bytearray(info.length)
    _FileRange(fd, info.offset, info.length, where).read(0, memoryview(raw))
    try:
        obj = torch.load(io.BytesIO(raw), weights_only=True)
        return values.encode_plain(obj, key)
    except Exception:  # any failure: not something we can decode safely as plain data
        return None


def _collect(metadata: Any, base: Path, files: _Files) -> _Collected:
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    tensors, values, skipped = [], [], []
    for key in sorted(metadata.state_dict_metadata):
        entry = metadata.state_dict_metadata[key]
        if isinstance(entry, TensorStorageMetadata):
            tensors.append(_tensor(metadata, base, files, key, entry, MetadataIndex))
            continue
        data = _value(files, _storage_info(metadata, base, MetadataIndex(key)), key)
        if data is None:
            skipped.append(key)
        else:
            values.append((key, data))
    return _Collected(tensors, values, skipped)


def _tensor(metadata: Any, base: Path, files: _Files, key: str, entry: Any, index: Any) -> _Tensor:
    dtype = entry.properties.dtype
    try:
        name = values.dtype_name(dtype)
    except TrainsnapError as e:
        raise IncompatibleError(f"DCP tensor {key!r}: {e}", key=key, path=str(base)) from e
    out = _Tensor(key, name, tuple(int(n) for n in entry.size))
    seen: set[Box] = set()
    for chunk in sorted(entry.chunks, key=lambda c: tuple(c.offsets)):
        box = Box(tuple(int(o) for o in chunk.offsets), tuple(int(n) for n in chunk.sizes))
        if box.numel == 0 or box in seen:
            continue  # empty local shards cover nothing; an exact replica is stored once
        seen.add(box)
        info = _storage_info(metadata, base, index(key, chunk.offsets))
        out.shards.append((box, _tensor_source(files, info, key, dtype, box)))
    problems = tiling_problems([b for b, _ in out.shards], out.shape)
    if problems:
        raise CorruptError(
            f"DCP checkpoint {base}: the chunks of {key!r} do not tile its shape {out.shape} "
            "(its metadata is inconsistent); re-save it with dcp.save",
            key=key,
            path=str(base),
            problems=problems,
        )
    return out


# -- writing the snapshot -------------------------------------------------------------------------


def _write_objects(
    storage: Storage, hasher: Hasher, payloads: list[_Source], progress: Progress | None
) -> tuple[list[WrittenObject], list[list[tuple[int, int, int]]]]:
    """Lay payloads out in objects as a save does (large ones cut, small ones packed) and write
    each; at most ``read_budget`` bytes of objects are in memory at once."""
    t = tunables.get()
    layout = layout_objects(
        [p.size for p in payloads], chunk_size=t.chunk_size, pack_threshold=t.pack_threshold
    )
    for obj in layout.objects:
        for p, _, _ in obj.parts:
            src = payloads[p]
            if isinstance(src, _Materialized):
                src.uses += 1
    total = sum(o.size for o in layout.objects)
    lock = threading.Lock()

    def task(index: int) -> WrittenObject:
        obj = layout.objects[index]
        buf = memoryview(bytearray(obj.size))
        pos = 0
        for p, off, n in obj.parts:
            payloads[p].read(off, buf[pos : pos + n])
            pos += n
        written = write_object(storage, hasher, buf)
        if progress is not None:
            with lock:
                progress(obj.size, total)
        return written

    threads = max(1, min(t.io_threads, t.read_budget // t.chunk_size))
    written = run_all([partial(task, i) for i in range(len(layout.objects))], threads)
    return written, layout.chunks


def _world_size(metadata: Any) -> int:
    """Ranks that wrote the checkpoint, from FileSystemWriter's ``__<rank>_<n>.distcp`` names."""
    ranks = {
        int(found.group(1))
        for info in (metadata.storage_data or {}).values()
        if (found := _RANK_FILE_RE.match(getattr(info, "relative_path", "")))
    }
    return max(ranks) + 1 if ranks else 1


def _state_kinds(keys: list[str]) -> dict[str, bool]:
    """Guessed from the usual top-level names (``model``, ``optim``/``optimizer``); anything
    else is ``extra``. Informative only: a plain-state load ignores kinds."""
    tops = {k.split(".", 1)[0] for k in keys}
    kinds = dict.fromkeys(STATE_KINDS, False)
    kinds["model"] = "model" in tops
    kinds["optimizer"] = bool(tops & {"optim", "optimizer"})
    kinds["extra"] = bool(tops - {"model", "optim", "optimizer"})
    return kinds


def _manifest(
    cap: _Collected,
    written: list[WrittenObject],
    chunks: list[list[tuple[int, int, int]]],
    hasher: Hasher,
    header: Mapping[str, Any],
) -> Manifest:
    b = ManifestBuilder(algorithm=hasher.algorithm, block_size=hasher.block_size, **header)
    index = [b.add_object(w.name, w.size, w.digests) for w in written]
    rows = iter(chunks)
    for t in cap.tensors:
        ti = b.add_tensor(t.key, -1, t.dtype, t.shape)
        for box, _ in t.shards:
            b.add_shard(ti, box, [(index[o], off, n) for o, off, n in next(rows)])
    for key, _ in cap.values:
        b.add_value(key, -1, values.JSON, [(index[o], off, n) for o, off, n in next(rows)])
    return b.build()


def import_dcp(
    dcp_dir: str | os.PathLike[str],
    root: Root,
    *,
    step: int = 0,
    progress: Progress | None = None,
    trust_pickle: bool = False,
) -> SnapshotInfo:
    """Turn the DCP directory ``dcp_dir`` into a committed snapshot of ``root`` at ``step``.

    Every tensor chunk becomes a box shard of its logical tensor (keys are DCP's flattened
    names, e.g. ``model.layers.0.weight``), so the snapshot loads with ``ts.load`` on any
    topology. Non-tensor entries that are plain data become values; others are skipped with a
    warning. The DCP ``.metadata`` is a pickle: it is read with an allow-list of torch's DCP
    metadata classes and plain builtins, and a file naming anything else is refused
    (``IncompatibleError``) unless ``trust_pickle`` -- only for checkpoints you trust.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidArgumentError(f"step must be a non-negative int, got {step!r}")
    base = Path(dcp_dir)
    md = _read_metadata(base, trust_pickle)
    storage = open_storage(root)
    hasher = Hasher(block_size=tunables.get().block_size)
    with _open_files(base) as files:
        c = _collect(md, base, files)
        payloads: list[_Source] = [src for t in c.tensors for _, src in t.shards]
        payloads += [_Bytes(data) for _, data in c.values]
        written, chunks = _write_objects(storage, hasher, payloads, progress)
    if c.skipped:
        log.warning(
            "import of %s skips %d non-tensor entr(y/ies) that are not plain data (they would "
            "need unpickling code from the checkpoint): %s",
            base,
            len(c.skipped),
            keys_summary(c.skipped),
        )
    header = {
        "snapshot_id": commit.new_snapshot_id(step),
        "created": now_iso(),
        "step": step,
        "level": "weights",
        "state_kinds": _state_kinds([t.key for t in c.tensors] + [k for k, _ in c.values]),
        "versions": library_versions({}),
        "topology": {"world_size": _world_size(md), "coordinator": 0, "mesh": {}},
        "meta": {"imported_from": {"format": "torch.distributed.checkpoint", "path": str(base)}},
    }
    m = _manifest(c, written, chunks, hasher, header)
    commit.write_commit(storage, m, writer={"world_size": 1, "tool": "trainsnap import-dcp"})
    log.info(
        "imported %s as snapshot %s: %d tensors, %d values, %d bytes",
        base,
        m.snapshot_id,
        len(c.tensors),
        len(c.values),
        m.nbytes,
    )
    return SnapshotInfo.from_manifest(m, storage.url)
