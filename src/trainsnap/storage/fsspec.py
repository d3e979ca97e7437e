"""A root on any fsspec file system: ``memory://`` for tests, ``s3://`` through s3fs.

On object stores a single PUT (or a completed multipart upload) makes an object visible whole,
which is the atomicity ``put`` promises; the listing cache is off so that a listing reflects
what is stored now.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from .base import Buffer, ShortReadError, as_buffers, check_key, check_prefix


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
        try:
            self.fs.pipe_file(self._path(key), payload)
        except OSError:
            raise
        except Exception as e:  # botocore and friends: keep the cause, give callers an OSError
            raise OSError(f"put {self.url}/{key} failed: {type(e).__name__}: {e}") from e

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        try:
            data: bytes = self.fs.cat_file(self._path(key), start=start, end=end)
        except OSError:
            raise
        except Exception as e:
            raise OSError(f"get {self.url}/{key} failed: {type(e).__name__}: {e}") from e
        if end is not None and len(data) != end - start:
            raise ShortReadError(
                f"{self.url}/{key}: short read ({len(data)} of {end - start} bytes at {start})"
            )
        return data

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        out[:] = self.get(key, start, start + len(out))

    def stat(self, key: str) -> int:
        try:
            info = self.fs.info(self._path(key))
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
        return self.fs._strip_protocol(self.root).rstrip("/") + "/"

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass
