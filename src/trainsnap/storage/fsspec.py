"""A root on any fsspec file system: ``memory://`` for tests, ``s3://`` through s3fs.

On object stores a single PUT (or a completed multipart upload) makes an object visible whole,
which is the atomicity ``put`` promises; the listing cache is off so that a listing reflects
what is stored now.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

from trainsnap.storage.base import Buffer, ShortReadError, as_buffers, check_key, check_prefix

REFRESH_AFTER = 300.0
"""Seconds after which a reused object is rewritten to refresh its modification time."""


class FsspecStorage:
    readinto_is_zero_copy = False

    def __init__(self, fs: Any, root: str, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def put(self, key: str, data: Buffer | Sequence[Buffer]) -> None:
        bufs = as_buffers(data)
        payload = bytes(bufs[0]) if len(bufs) == 1 else b"".join(bufs)
        path = self._path(key)  # outside the try: a bad key stays InvalidArgumentError
        try:
            self.fs.pipe_file(path, payload)
        except OSError:
            raise
        except Exception as e:  # botocore and friends: keep the cause, give callers an OSError
            raise OSError(f"put {self.url}/{key} failed: {type(e).__name__}: {e}") from e

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
        except OSError as e:
            # S3 also answers 416 to a range that starts at or past the end of the object.
            if end is not None and self.stat(key) < end:
                raise self._short(key, start, end, 0) from e
            raise
        except Exception as e:
            raise OSError(f"get {self.url}/{key} failed: {type(e).__name__}: {e}") from e
        if end is not None and len(data) != end - start:
            raise self._short(key, start, end, len(data))
        return data

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
        except OSError:
            raise
        except Exception as e:
            raise OSError(f"stat {self.url}/{key} failed: {type(e).__name__}: {e}") from e
        if info.get("type") == "directory":
            raise FileNotFoundError(f"{self.url}/{key}")
        return int(info["size"])

    def list(self, prefix: str) -> Iterator[str]:
        base = f"{self.root}/{check_prefix(prefix)}" if prefix else f"{self.root}/"
        self.fs.invalidate_cache(self.root)
        try:
            found = self.fs.find(base.rstrip("/"))
        except FileNotFoundError:
            return
        strip = self._strip_prefix()
        for p in found:
            if p.startswith(strip):
                yield p[len(strip) :]

    def _strip_prefix(self) -> str:
        stripped: str = self.fs._strip_protocol(self.root)
        return stripped.rstrip("/") + "/"

    def delete(self, key: str) -> None:
        path = self._path(key)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        path = self._path(key)
        try:
            self.fs.pipe_file(path, bytes(memoryview(data).cast("B")), mode="create")
        except FileExistsError:
            return False
        except OSError:
            raise
        except Exception as e:
            if "PreconditionFailed" in repr(e) or "412" in str(e):
                return False
            raise OSError(f"put_if_absent {self.url}/{key} failed: {e}") from e
        return True

    def mtime(self, key: str) -> float:
        info = self.fs.info(self._path(key))
        for field in ("LastModified", "mtime", "created"):
            value = info.get(field)
            if value is None:
                continue
            if hasattr(value, "timestamp"):
                return float(value.timestamp())
            return float(value)
        return 0.0

    def refresh(self, key: str, data: Buffer | Sequence[Buffer]) -> None:
        """Object stores cannot touch an object: write it again (same name, same bytes), unless
        it was written recently enough for any collector's grace period."""
        if time.time() - self.mtime(key) > REFRESH_AFTER:
            self.put(key, data)
