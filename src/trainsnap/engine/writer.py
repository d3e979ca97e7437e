"""Writing objects: hash, compress, store under the content address, one writer per name."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from trainsnap import faults
from trainsnap.format import compression
from trainsnap.format.checksums import Hasher
from trainsnap.format.manifest import StoredObject, object_key
from trainsnap.storage.base import Storage


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

    def manifest_row(self) -> StoredObject:
        stored = self.size if self.stored < 0 else self.stored
        return StoredObject(
            self.name,
            self.size,
            self.digests,
            self.codec,
            stored,
            self.frames,
            self.raw_digests,
        )


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
        parts = [compression.compress_block(b, codec) for b in blocks]
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
