"""A root on any fsspec file system: ``memory://`` for tests, ``s3://`` through s3fs.

On object stores a single PUT (or a completed multipart upload) makes an object visible whole,
which is the atomicity ``put`` promises; the listing cache is off so that a listing reflects
what is stored now.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

from trainsnap.storage.base import Buffer, ShortReadError, as_buffers, check_key, check_prefix

log = logging.getLogger(__name__)

REFRESH_AFTER = 300.0
"""Seconds after which a reused object is rewritten to refresh its modification time."""


class FsspecStorage:
    readinto_is_zero_copy = False

    def __init__(self, fs: Any, root: str, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self.part_size: int | None = None
        """Bytes per part of a multipart upload (s3fs: an object of two parts or more is
        uploaded in parts; gcsfs: in the chunks of a resumable upload; adlfs: in staged blocks);
        None leaves the file system's default (50 MiB on s3fs and gcsfs; on adlfs one Put Blob
        up to 64 MiB, 4 MiB blocks above)."""

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def put(self, key: str, data: Buffer | Sequence[Buffer]) -> None:
        bufs = as_buffers(data)
        payload = bytes(bufs[0]) if len(bufs) == 1 else b"".join(bufs)
        path = self._path(key)  # outside the try: a bad key stays InvalidArgumentError
        try:
            self.fs.pipe_file(path, payload, **self._part_options())
        except Exception as e:  # botocore and friends: keep the cause, give callers an OSError
            if not _is_builtin(e):
                raise _as_builtin(e, f"put {self.url}/{key}") from e
            raise

    def _part_options(self) -> dict[str, int]:
        """The keyword arguments of ``pipe_file`` that apply :attr:`part_size`."""
        if self.part_size is None:
            return {}
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        if "s3" in protocols or "gs" in protocols:  # s3fs: multipart; gcsfs: resumable upload
            return {"chunksize": self.part_size}
        # adlfs: the Azure SDK takes block sizes from its client's configuration, not per call
        # (an unknown keyword would reach the HTTP session and fail the put).
        config = getattr(getattr(self.fs, "service_client", None), "_config", None)
        if config is not None:
            config.max_single_put_size = config.max_block_size = self.part_size
        return {}

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        path = self._path(key)
        if end is not None and end == start:
            # s3fs would send the invalid range "bytes=5-4" and get the whole object back.
            self.stat(key)  # a missing key is still FileNotFoundError
            return b""
        try:
            # A whole read sends no Range: S3 refuses "bytes=0-" on an empty object (416).
            data: bytes = self.fs.cat_file(path, start=start or None, end=end)
        except FileNotFoundError:
            raise
        except Exception as e:
            # S3 and Azure answer 416 to a range that starts at or past the end of the object
            # (s3fs makes an OSError of it, adlfs leaves the SDK's HttpResponseError).
            if end is not None and self._size_below(key, end):
                raise self._short(key, start, end, 0) from e
            if not _is_builtin(e):
                raise _as_builtin(e, f"get {self.url}/{key}") from e
            raise
        if end is not None and len(data) != end - start:
            raise self._short(key, start, end, len(data))
        return data

    def _size_below(self, key: str, end: int) -> bool:
        """Whether ``key`` is shorter than ``end`` bytes (False when that cannot be told)."""
        try:
            return self.stat(key) < end
        except OSError:
            return False

    def _short(self, key: str, start: int, end: int, got: int) -> ShortReadError:
        return ShortReadError(
            f"{self.url}/{key}: short read ({got} of {end - start} bytes at {start})"
        )

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        out[:] = self.get(key, start, start + len(out))

    def stat(self, key: str) -> int:
        path = self._path(key)
        try:
            info = self.fs.info(path)
        except Exception as e:
            if not _is_builtin(e):
                raise _as_builtin(e, f"stat {self.url}/{key}") from e
            raise
        if info.get("type") == "directory":
            raise FileNotFoundError(f"{self.url}/{key}")
        return int(info["size"])

    def list(self, prefix: str) -> Iterator[str]:
        """Keys of objects under ``prefix``. A "folder" is never a key: neither a zero-byte
        ``dir/`` object (what consoles and some tools create), nor the ``dir/`` entry some
        servers (SeaweedFS) keep listing after every object under it was deleted -- yielding it
        would make a deleted snapshot look like an interrupted one."""
        base = f"{self.root}/{check_prefix(prefix)}" if prefix else f"{self.root}/"
        self.fs.invalidate_cache(self.root)
        try:
            found = self.fs.find(base.rstrip("/"), detail=True)
        except FileNotFoundError:
            return
        strip = self._strip_prefix()
        for p, info in found.items():
            if info.get("type") == "directory" or p.endswith("/") or not p.startswith(strip):
                continue
            key = p[len(strip) :]
            if key:
                yield key

    def _strip_prefix(self) -> str:
        stripped: str = self.fs._strip_protocol(self.root)
        return stripped.rstrip("/") + "/"

    def delete(self, key: str) -> None:
        path = self._path(key)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        """Create ``key`` only if absent (``If-None-Match: *`` on S3); False when it existed.

        A refusal is read from the answer itself (412 ``PreconditionFailed``, whatever error
        the client library made of it: s3fs turns a 412 whose body lacks the field it looks for
        into ``OSError(EINVAL)``). Any other failure is ambiguous -- the request may or may not
        have created the key -- and is settled by asking for the key: present means False
        (a win is never assumed: the key may be another creator's), absent means the error is
        raised, as an ``OSError``. O(1) requests."""
        path = self._path(key)
        try:
            self.fs.pipe_file(path, bytes(memoryview(data).cast("B")), mode="create")
        except FileExistsError:
            return False
        except Exception as e:
            if _precondition_failed(e):
                return False
            return self._settle_create(key, e)
        return True

    def _settle_create(self, key: str, error: Exception) -> bool:
        try:
            self.stat(key)
        except FileNotFoundError:
            if _is_builtin(error):
                raise error from None
            raise _as_builtin(error, f"put_if_absent {self.url}/{key}") from error
        log.warning(
            "create of %s/%s failed (%r) but the key exists: counted as not created",
            self.url,
            key,
            error,
        )
        return False

    def mtime(self, key: str) -> float:
        """When ``key`` was last written. A file system that reports no time known here counts
        the object as written now: the collector then keeps it (a leak) rather than taking an
        object a save in flight may be reusing for an old one. One HEAD."""
        info = self.fs.info(self._path(key))
        # s3fs: LastModified; adlfs: last_modified; gcsfs: mtime; memory: created.
        for field in ("LastModified", "last_modified", "mtime", "created"):
            value = info.get(field)
            if value is None:
                continue
            if hasattr(value, "timestamp"):
                return float(value.timestamp())
            return float(value)
        return time.time()

    def refresh(self, key: str, data: Buffer | Sequence[Buffer]) -> None:
        """Object stores cannot touch an object: write it again (same name, same bytes), unless
        it was written recently enough for any collector's grace period."""
        if time.time() - self.mtime(key) > REFRESH_AFTER:
            self.put(key, data)


def _is_builtin(error: BaseException) -> bool:
    """Whether ``error`` is an ``OSError`` of a builtin type (or trainsnap's own)."""
    return isinstance(error, OSError) and type(error).__module__.split(".")[0] in (
        "builtins",
        "trainsnap",
    )


def _as_builtin(error: BaseException, what: str) -> OSError:
    """A new ``OSError`` of the nearest builtin class of ``error`` (aiohttp's connection
    errors, for one, subclass ``OSError``; plain ``OSError`` for errors that are none), naming
    ``what`` failed and why, to be raised from ``error``: callers catch builtins only."""
    kind = next(
        (
            c
            for c in type(error).__mro__
            if c.__module__ == "builtins" and isinstance(c, type) and issubclass(c, OSError)
        ),
        OSError,
    )
    return kind(f"{what} failed: {type(error).__name__}: {error}")


def _precondition_failed(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is the server's answer that a
    precondition did not hold: HTTP 412, or the ``PreconditionFailed`` error code."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "PreconditionFailed" or status == 412:
                return True
        for field in ("status", "code", "status_code"):  # gcsfs HttpError, azure's errors
            if getattr(current, field, None) == 412:
                return True
        current = current.__cause__ or current.__context__
    return False
