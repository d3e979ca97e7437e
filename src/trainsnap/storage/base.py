"""The storage protocol every backend implements.

Nine methods on keys relative to the root (``objects/ab/abcd...``, ``snapshots/<id>/...``). Five
are the protocol proper: ``put`` makes a whole object visible atomically (or not at all), ``get``
reads a byte range, ``stat`` gives a size, ``list`` walks a prefix, ``delete`` removes. Four more
exist because a part of the library needs exactly that and cannot build it from the five:
``read_into`` (a range straight into the caller's memory: loads without a copy),
``put_if_absent`` (an atomic create: the writer generations that fence a superseded job),
``mtime`` and ``refresh`` (an object's age, and making it young again: the collector's grace
period protects an object a save in flight reuses). Capabilities are attributes, not
subclasses: a backend may also offer ``read_steps`` (see :func:`read_steps`), which loads use
to verify each block while it is still in the cache. Backend errors leave a backend as
builtins: ``FileNotFoundError`` for a missing key, ``OSError`` for the rest.
"""

from __future__ import annotations

import errno
import errno as _errno
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, runtime_checkable

from trainsnap.errors import CorruptError, InvalidArgumentError, TrainsnapError

Buffer = bytes | bytearray | memoryview

_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class ShortReadError(OSError):
    """An object ended before the requested range: it is shorter than its writer made it."""


class NotRegularFileError(FileNotFoundError):
    """What stands under a key is not an object of this root: a symbolic link (followed, it
    could lead anywhere outside the root), a FIFO (opening it would block), a device or a
    directory. A ``FileNotFoundError``, so that it is never read as an object; readers that
    name problems name it for what it is."""


class LinkedDirectoryError(NotRegularFileError, CorruptError):
    """A directory of a root (``objects/``, ``snapshots/<id>/``, ``lease/``) is a symbolic link:
    nothing under it is read, written or deleted. Also a :class:`~trainsnap.errors.CorruptError`,
    so that it reaches the user as a trainsnap error naming the path and the fix wherever it is
    not handled as an absent key."""

    def __init__(self, path: str) -> None:
        why = (
            "a directory of the root is a symbolic link; trainsnap never follows links out of a "
            "root (replace the link by a directory)"
        )
        FileNotFoundError.__init__(self, errno.ELOOP, why, path)
        CorruptError.__init__(self, f"{path}: {why}", path=path)
        self.args = (errno.ELOOP, why)

    def __str__(self) -> str:
        return self.message


class StoreError(OSError, TrainsnapError):
    """A store's failure that no builtin names (an HTTP 500, a parse error of its answer):
    an ``OSError`` for storage code (retried when its ``errno`` is transient), a
    :class:`~trainsnap.errors.TrainsnapError` naming the store and the key for the user."""

    def __init__(
        self,
        message: str,
        *,
        errno: int | None = None,
        key: str | None = None,
        path: str | None = None,
    ) -> None:
        OSError.__init__(self, errno or _errno.EIO, message)
        TrainsnapError.__init__(self, message, key=key, path=path)
        self.args = (message,)

    def __str__(self) -> str:
        return self.message


class StoreRefusedError(StoreError, CorruptError):
    """The store answered something a reader does not take: a body longer than asked for, a
    listing past its caps. Never retried (asking again gets the same); a
    :class:`~trainsnap.errors.CorruptError` for the user."""


def check_key(key: str) -> str:
    """A relative, normalised key: no absolute path, no ``..``, no empty or hidden segments.

    Every key reaching a backend passes here, so a crafted manifest cannot name a path outside
    the root whatever it contains.
    """
    if not isinstance(key, str) or not key:
        raise InvalidArgumentError(f"storage key {key!r} is empty or not a string", key=str(key))
    parts = key.split("/")
    for part in parts:
        if part in ("", ".", "..") or not _SEGMENT.fullmatch(part):
            raise InvalidArgumentError(
                f"storage key {key!r} is not a plain relative path (segment {part!r})", key=key
            )
    return key


def check_prefix(prefix: str) -> str:
    if prefix == "":
        return prefix
    return check_key(prefix.rstrip("/")) + ("/" if prefix.endswith("/") else "")


@runtime_checkable
class Storage(Protocol):
    """A root that holds immutable objects under relative keys."""

    url: str
    """Where it is, as the user would write it."""

    readinto_is_zero_copy: bool
    """True when :meth:`read_into` reads straight into the caller's memory (no bounce copy)."""

    def put(self, key: str, data: Buffer | Sequence[Buffer]) -> None:
        """Make ``key`` hold exactly ``data`` (or the concatenation of the buffers), durably and
        atomically: a reader sees the whole new content or the previous state, never a part."""
        ...

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``key`` (to the end when ``end`` is None)."""
        ...

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        """Fill ``out`` (a writable 1-D byte memoryview) with bytes from ``start``; raise
        ``OSError`` if the object is shorter."""
        ...

    def stat(self, key: str) -> int:
        """Size in bytes; ``FileNotFoundError`` when absent."""
        ...

    def list(self, prefix: str) -> Iterator[str]:
        """Keys under ``prefix`` (a directory-like prefix ending in ``/``, or empty), any order."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; absent keys are not an error (deletion is idempotent)."""
        ...

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        """Create ``key`` with ``data`` only if it does not exist (atomically); False if it did.
        Used for the root's writer generations (fencing)."""
        ...

    def mtime(self, key: str) -> float:
        """Last modification time (seconds since the epoch); ``FileNotFoundError`` if absent."""
        ...

    def refresh(self, key: str, data: Buffer | Sequence[Buffer]) -> None:
        """Make an existing object count as recently written (its content unchanged), so that a
        collector's grace period protects it while a save that reuses it is in flight."""
        ...


def as_buffers(data: Buffer | Sequence[Buffer]) -> list[memoryview]:
    if isinstance(data, bytes | bytearray | memoryview):
        return [memoryview(data).cast("B")]
    return [memoryview(b).cast("B") for b in data]


Steps = Sequence[Sequence[memoryview]]
"""Consecutive bytes of an object, step by step: each step is the list of buffers (a scatter
list) its bytes fill in order."""


def read_steps(
    storage: Storage, key: str, start: int, steps: Steps, done: Callable[[int], None]
) -> None:
    """Fill ``steps`` with the bytes of ``key`` from ``start`` on, calling ``done(i)`` once step
    ``i`` holds its bytes; ``done`` may raise to stop the read.

    A backend with a ``read_steps`` method of this signature fills one step at a time and calls
    ``done(i)`` before reading step ``i + 1``: a reader verifies a block right after it lands,
    while it is still in the processor's cache, instead of reading it back from memory later.
    Other backends get the whole range in one ``read_into`` (one request to an object store),
    then every ``done``."""
    native = getattr(storage, "read_steps", None)
    if native is not None:
        native(key, start, steps, done)
        return
    buffers = [b for step in steps for b in step]
    if len(buffers) == 1:
        storage.read_into(key, start, buffers[0])
    else:
        whole = memoryview(bytearray(sum(len(b) for b in buffers)))
        storage.read_into(key, start, whole)
        pos = 0
        for b in buffers:
            b[:] = whole[pos : pos + len(b)]
            pos += len(b)
    for i in range(len(steps)):
        done(i)


def read_uncached(storage: Storage, key: str, start: int, out: memoryview, length: int) -> bool:
    """Read bytes ``[start, start + length)`` of ``key`` into ``out`` past the page cache, where
    the backend can (a ``read_uncached`` method of this signature) and none of those bytes is
    cached; False, with nothing read, otherwise: the caller then reads as usual. ``out`` may be
    longer than ``length`` (a direct read fills whole device blocks)."""
    native = getattr(storage, "read_uncached", None)
    return bool(native is not None and native(key, start, out, length))
