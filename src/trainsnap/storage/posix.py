"""A root on a POSIX file system (local disk, NVMe, NFS, Lustre).

``put`` writes a hidden temporary file next to the destination, fsyncs it, renames it over the
key and fsyncs the directory: after ``put`` returns the object survives a power loss, and a
reader never sees a partial object under its real name. Reads use ``preadv`` straight into the
caller's memory; a page-aligned buffer can take bytes that are not in the page cache straight from
the device (:meth:`PosixStorage.read_uncached`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import secrets
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from stat import S_ISDIR, S_ISREG

from trainsnap import faults
from trainsnap.errors import TrainsnapError
from trainsnap.storage.base import (
    Buffer,
    LinkedDirectoryError,
    NotRegularFileError,
    ShortReadError,
    Steps,
    as_buffers,
    check_key,
    check_prefix,
)

_HAS_PREADV = hasattr(os, "preadv")
_READ_PATHS = 1 << 16
"""Checked read paths a root keeps (then starts again)."""
_HAS_FADVISE = hasattr(os, "posix_fadvise")
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024
_O_BINARY = getattr(os, "O_BINARY", 0)
# Reads never follow a link and never block on a FIFO: a hostile root cannot make a reader
# leave it or hang.
_O_READ = os.O_RDONLY | _O_BINARY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_DIRECT_ALIGN = 4096
"""Offset, length and memory alignment of a direct read (a page: every device's logical block
and DMA alignment divide it)."""


class PosixStorage:
    readinto_is_zero_copy = _HAS_PREADV

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.root = Path(path).absolute()
        self.url = str(self.root)
        self.fsync = fsync
        self._durable_dirs: set[Path] = set()
        self._lock = threading.Lock()
        self._deferring = 0
        self._pending_dirs: set[Path] = set()
        self._checked_dirs: set[Path] = set()
        self._read_paths: dict[str, str] = {}
        self._direct = _O_DIRECT != 0 and _cachestat is not None

    def __repr__(self) -> str:
        return f"PosixStorage({self.url!r})"

    def _path(self, key: str) -> Path:
        """The file of ``key``; refused when a directory between the root and it is a symbolic
        link (a read, write or delete through it would land outside the root)."""
        path = self.root / check_key(key)
        self._check_dirs(path.parent)
        return path

    def _read_path(self, key: str) -> str:
        """:meth:`_path` of a key to read, kept once checked: a load opens each object several
        times from its I/O threads, and the checks are Python work each call (their
        directories' checks are kept anyway; the last component is opened without following a
        link)."""
        path = self._read_paths.get(key)
        if path is None:
            path = str(self._path(key))
            with self._lock:
                if len(self._read_paths) >= _READ_PATHS:
                    self._read_paths.clear()
                self._read_paths[key] = path
        return path

    def _check_dirs(self, directory: Path) -> None:
        if directory in self._checked_dirs:
            return
        part = directory
        while part != self.root:
            if part.is_symlink():
                raise LinkedDirectoryError(str(part))
            part = part.parent
        if directory.is_dir():
            with self._lock:
                self._checked_dirs.add(directory)

    def _open_object(self, path: str | Path, flags: int = 0) -> int:
        """A descriptor of the regular file at ``path``, opened without following a link."""
        try:
            fd = os.open(path, _O_READ | flags)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW met a link
                raise NotRegularFileError(
                    errno.ELOOP, "a symbolic link where an object should be", str(path)
                ) from e
            raise
        mode = os.fstat(fd).st_mode
        if not S_ISREG(mode):
            os.close(fd)
            raise NotRegularFileError(
                errno.ENOENT, "not a regular file where an object should be", str(path)
            )
        return fd

    # -- writing ----------------------------------------------------------------------------

    def _ensure_dir(self, data: Path) -> None:
        if data in self._durable_dirs:
            return
        missing = []
        p = data
        while not p.exists():
            missing.append(p)
            p = p.parent
        data.mkdir(parents=True, exist_ok=True)
        if self.fsync:
            # A new directory's entry lives in its parent: sync the parents so a crash cannot
            # forget the directory an object was renamed into.
            parents = {m.parent for m in missing}
            if not self._defer_dirs(parents):
                for parent in sorted(parents):
                    _fsync_dir(parent)
        with self._lock:
            self._durable_dirs.add(data)

    def _defer_dirs(self, dirs: set[Path]) -> bool:
        """Inside :meth:`deferred_dir_sync`, queue ``dirs`` for its closing fsyncs (True);
        outside it, False (the caller syncs them now)."""
        with self._lock:
            if self._deferring:
                self._pending_dirs |= dirs
                return True
        return False

    def put(self, key: str, data: Buffer | Sequence[Buffer]) -> None:
        dest = self._path(key)
        self._ensure_dir(dest.parent)
        tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        bufs = as_buffers(data)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_BINARY, 0o644)
        try:
            first, second = _split_at(bufs, sum(len(b) for b in bufs) // 2)
            _write_all(fd, first)
            faults.point("mid_write")
            _write_all(fd, second)
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quiet(tmp)
            raise
        os.close(fd)
        try:
            os.replace(tmp, dest)
        except BaseException:
            _unlink_quiet(tmp)
            raise
        if self.fsync and not self._defer_dirs({dest.parent}):
            _fsync_dir(dest.parent)

    @contextmanager
    def deferred_dir_sync(self) -> Iterator[None]:
        """Inside, renamed objects' directories (and the parents of directories made for
        them) are fsynced once at the end rather than after every object: a rank writing a
        hundred objects into a few directories syncs each directory once. A directory fsync
        forces a journal commit, which on ext4 waits for the data of every file written so far.
        Everything put inside is durable when the block exits, before the rank reports its
        objects (and so before any manifest names them)."""
        with self._lock:
            self._deferring += 1
        try:
            yield
        finally:
            with self._lock:
                self._deferring -= 1
                dirs = self._pending_dirs if self._deferring == 0 else set()
                if self._deferring == 0:
                    self._pending_dirs = set()
            for d in sorted(dirs):
                _fsync_dir(d)

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        dest = self._path(key)
        self._ensure_dir(dest.parent)
        tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_BINARY, 0o644)
        try:
            _write_all(fd, as_buffers(data))
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, dest)  # fails if dest exists: atomic create-if-absent with content
        except FileExistsError:
            return False
        finally:
            _unlink_quiet(tmp)
        if self.fsync:
            _fsync_dir(dest.parent)
        return True

    def mtime(self, key: str) -> float:
        return self._regular_stat(self._path(key)).st_mtime

    def refresh(self, key: str, data: Buffer | Sequence[Buffer]) -> None:
        path = self._path(key)
        self._regular_stat(path)
        os.utime(path, follow_symlinks=False)

    @staticmethod
    def _regular_stat(path: Path) -> os.stat_result:
        st = os.lstat(path)
        if S_ISDIR(st.st_mode):  # a directory holds objects but is not one (as on S3)
            raise FileNotFoundError(errno.ENOENT, "not an object but a directory", str(path))
        if not S_ISREG(st.st_mode):
            raise NotRegularFileError(
                errno.ENOENT,
                "not a regular file (a symbolic link, FIFO or device) where an object should be",
                str(path),
            )
        return st

    # -- reading ----------------------------------------------------------------------------

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        path = self._path(key)
        with os.fdopen(self._open_object(path), "rb") as f:
            f.seek(start)
            if end is None:
                return f.read()
            data = f.read(end - start)
        if len(data) != end - start:
            raise ShortReadError(
                f"{path}: short read ({len(data)} of {end - start} bytes at {start})"
            )
        return data

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        path = self._read_path(key)
        fd = self._open_object(path)
        try:
            _read_all(fd, [out], start, path)
        finally:
            os.close(fd)

    def read_steps(self, key: str, start: int, steps: Steps, done: Callable[[int], None]) -> None:
        """One descriptor, one ``preadv`` per step (a scatter list straight into the caller's
        buffers), ``done(i)`` between steps (see :func:`trainsnap.storage.base.read_steps`)."""
        path = self._read_path(key)
        fd = self._open_object(path)
        try:
            if _HAS_FADVISE and len(steps) > 1:
                # A doubled readahead window: the next blocks are on their way while one is
                # verified (docs/PERFORMANCE.md).
                os.posix_fadvise(fd, start, 0, os.POSIX_FADV_SEQUENTIAL)
            pos = start
            for i, step in enumerate(steps):
                pos = _read_all(fd, step, pos, path)
                done(i)
        finally:
            os.close(fd)

    def read_uncached(self, key: str, start: int, out: memoryview, length: int) -> bool:
        """Read bytes ``[start, start + length)`` of ``key`` into ``out`` straight from the
        device (``O_DIRECT``) when none of them is in the page cache, ``start`` and ``out`` are
        page-aligned and ``out`` holds ``length`` rounded up to a page; False, with nothing
        read, otherwise, and for good once the file system refuses direct I/O.

        The bytes then cost no kernel copy and no page-cache work (docs/PERFORMANCE.md). Cached
        bytes are read from the cache as usual: a direct read would go to the device for them,
        and would first write back any that are dirty."""
        if not (self._direct and length > 0 and start % _DIRECT_ALIGN == 0) or out.readonly:
            return False
        want = -(-length // _DIRECT_ALIGN) * _DIRECT_ALIGN
        if len(out) < want or _address(out) % _DIRECT_ALIGN:
            return False
        path = self._read_path(key)
        try:
            fd = self._open_object(path, _O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._direct = False  # this file system has no direct I/O (tmpfs, some FUSE)
            return False
        try:
            if _cachestat is None or _cachestat(fd, start, length) != 0:
                return False  # cached in part, or the kernel cannot tell
            pos, end = 0, want
            while pos < length:
                try:
                    n = os.preadv(fd, [out[pos:end]], start + pos)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self._direct = False  # opened, but refuses the reads: the caller reads
                    return False  # the whole range again through the cache
                if n == 0 or (pos + n < length and n % _DIRECT_ALIGN):
                    raise ShortReadError(
                        f"{path}: short read, object ends before byte {start + pos + n}"
                    )
                pos += n
            return True
        finally:
            os.close(fd)

    def stat(self, key: str) -> int:
        return self._regular_stat(self._path(key)).st_size

    def list(self, prefix: str) -> Iterator[str]:
        base = self.root / check_prefix(prefix) if prefix else self.root
        try:
            self._check_dirs(base)
        except NotRegularFileError:
            return  # what a link leads to is not this root's
        if not base.is_dir():
            return
        for dirpath, dirnames, filenames in os.walk(base):  # never descends into a link
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                if not name.startswith(".") and not os.path.islink(os.path.join(dirpath, name)):
                    yield name if rel == "." else f"{rel}/{name}"

    def list_temporaries(self) -> Iterator[str]:
        """Leftover temporary files of interrupted writes (for the collector)."""
        if not self.root.is_dir():
            return
        for dirpath, _dirs, filenames in os.walk(self.root):  # never descends into a link
            for name in filenames:
                path = os.path.join(dirpath, name)
                if name.startswith(".") and ".tmp-" in name and not os.path.islink(path):
                    yield str(Path(dirpath) / name)

    def delete(self, key: str) -> None:
        """Remove ``key``. A snapshot's file (marker, manifest, report) is gone durably when
        this returns: its directory is fsynced, and so is the parent of each directory removed
        once empty, so that a marker's removal can never be undone by a power cut after the
        objects it referenced are swept. The sync happens also when the file was already
        absent (an earlier attempt may have stopped before it). An object's removal is not
        synced (a removal a cut undoes leaves garbage for the next collection, never a broken
        snapshot); syncing would cost a journal commit per object."""
        path = self._path(key)
        _unlink_quiet(path)
        if not key.startswith("snapshots/"):
            return  # object directories stay: a concurrent put may be about to use them
        parent = path.parent
        if self.fsync:
            self._fsync_nearest(parent)
        # Remove the snapshot's directory once it is empty.
        while parent != self.root and self.root in parent.parents:
            try:
                parent.rmdir()
            except OSError:
                break
            with self._lock:
                self._durable_dirs.discard(parent)
            parent = parent.parent
            if self.fsync:
                _fsync_dir(parent)

    def _fsync_nearest(self, directory: Path) -> None:
        """Fsync ``directory``, or where it is missing its nearest existing ancestor inside the
        root (whose entries then hold the removal)."""
        while not directory.is_dir() and directory != self.root and self.root in directory.parents:
            directory = directory.parent
        if directory.is_dir():
            _fsync_dir(directory)


def _split_at(bufs: list[memoryview], count: int) -> tuple[list[memoryview], list[memoryview]]:
    first: list[memoryview] = []
    for i, b in enumerate(bufs):
        if count <= len(b):
            return [*first, b[:count]], [b[count:], *bufs[i + 1 :]]
        first.append(b)
        count -= len(b)
    return first, []


def _read_all(fd: int, buffers: Sequence[memoryview], pos: int, path: str | Path) -> int:
    """Fill ``buffers`` with the bytes of ``fd`` from ``pos`` on; the position after them."""
    pending = [b for b in buffers if len(b)]
    first = 0
    while first < len(pending):
        batch = pending[first : first + _IOV_MAX]
        if _HAS_PREADV:
            n = os.preadv(fd, batch, pos)
        else:
            chunk = os.pread(fd, len(batch[0]), pos)
            n = len(chunk)
            batch[0][:n] = chunk
        if n == 0:
            raise ShortReadError(f"{path}: short read, object ends before byte {pos}")
        pos += n
        if n == sum(map(len, batch)):  # the usual case: no loop over a batch's buffers
            first += len(batch)
            continue
        while n and n >= len(pending[first]):  # a call may stop short: resume where it did
            n -= len(pending[first])
            first += 1
        if n:
            pending[first] = pending[first][n:]
    return pos


def _write_all(fd: int, bufs: list[memoryview]) -> None:
    for b in bufs:
        view = b
        while len(view):
            n = os.write(fd, view[: 1 << 30])
            view = view[n:]


_FSYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP})
"""What a file system that cannot fsync a directory answers: its names are as durable as it
makes them, and nothing better can be done."""


def _fsync_dir(data: Path) -> None:
    """Make the names in directory ``data`` durable. Every failure but "not supported" is
    raised: an EIO, ENOSPC or EROFS here means a rename or removal may not survive a power cut,
    so the put or delete that needed it has not happened durably and must not report success.
    The error is never retried as transient: after a failed fsync the kernel may have dropped
    what it could not write, and a second fsync would succeed without it."""
    try:
        fd = os.open(data, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as e:
        raise _sync_error(data, e, "open") from e
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _FSYNC_UNSUPPORTED:
            raise _sync_error(data, e, "fsync") from e
    finally:
        os.close(fd)


def _sync_error(data: Path, error: OSError, what: str) -> TrainsnapError:
    return TrainsnapError(
        f"cannot make the entries of directory {data} durable ({what} failed: "
        f"{error.strerror or error}); what was just written or removed there may not survive a "
        "power cut. Check the device and the file system (dmesg), then save again.",
        path=str(data),
    )


def _unlink_quiet(pending: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(pending)


def _address(buffer: memoryview) -> int:
    """Where a writable buffer's bytes start in memory."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CachestatResult(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


_CACHESTAT_NR = {"x86_64": 451, "aarch64": 451, "arm64": 451}
"""``cachestat(2)`` (Linux 6.5) where its number is known; elsewhere no direct reads."""


def _cachestat_call() -> Callable[[int, int, int], int | None] | None:
    number = _CACHESTAT_NR.get(platform.machine())
    if not sys.platform.startswith("linux") or number is None:
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    works = [True]

    def cached_pages(fd: int, start: int, length: int) -> int | None:
        """Pages of ``[start, start + length)`` of ``fd`` in the page cache; None where the
        kernel cannot tell (then the caller reads through the cache)."""
        if not works[0]:
            return None
        where, result = _CachestatRange(start, length), _CachestatResult()
        if syscall(number, fd, ctypes.byref(where), ctypes.byref(result), 0) != 0:
            if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP):
                works[0] = False  # an older kernel, or a sandbox that forbids the call
            return None
        return int(result.nr_cache)

    return cached_pages


_cachestat = _cachestat_call()
