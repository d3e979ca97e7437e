"""A root on any fsspec file system: ``memory://`` for tests, ``s3://`` through s3fs.

On object stores a single PUT (or a completed multipart upload) makes an object visible whole,
which is the atomicity ``put`` promises; the listing cache is off so that a listing reflects
what is stored now.

A server is not trusted to be honest or quick (``s3://``; other stores keep fsspec's own
reads): every request has a deadline that covers its whole body (:class:`Limits`); a read asks
for a byte range and refuses a body longer than it asked for, and a whole-object read asks for
at most :attr:`Limits.whole_read` + 1 bytes (or the size a ``stat`` of the key just answered,
+ 1); a listing stops with an error past :attr:`Limits.list_keys` keys or
:attr:`Limits.list_pages` pages. The client's own retries are off (:func:`client_options`):
:class:`~trainsnap.storage.retry.RetryingStorage` is the one retry budget.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

from trainsnap.storage.base import (
    Buffer,
    ShortReadError,
    StoreError,
    StoreRefusedError,
    as_buffers,
    check_key,
    check_prefix,
)

log = logging.getLogger(__name__)

REFRESH_AFTER = 300.0
"""Seconds after which a reused object is rewritten to refresh its modification time."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request to an object store may cost; ``TRAINSNAP_STORE_<NAME>`` overrides
    ``<name>`` (read when a root is opened)."""

    request_seconds: float = 20.0
    """Seconds any request may take, its whole body included, before the bytes of a read
    count: a server that drips a body a byte at a time cannot hold a reader longer."""

    min_rate: float = float(1 << 20)
    """Bytes per second a read's body must at least arrive at: a read of ``n`` bytes may take
    ``request_seconds + n / min_rate``."""

    whole_read: int = 1 << 30
    """Most bytes a whole-object read (no range) accepts: it asks for this many + 1."""

    list_keys: int = 4_000_000
    """Most keys one listing returns before it is refused (a server that never ends one)."""

    list_pages: int = 40_000
    """Most pages one listing reads (S3 answers at most 1,000 keys a page)."""

    @classmethod
    def from_env(cls) -> Limits:
        found: dict[str, Any] = {}
        for field in fields(cls):
            raw = os.environ.get(f"TRAINSNAP_STORE_{field.name.upper()}")
            if raw:
                kind = float if field.type in ("float", float) else int
                found[field.name] = kind(raw)
        return cls(**found)

    def seconds_for(self, nbytes: int) -> float:
        return self.request_seconds + nbytes / self.min_rate


def client_options(options: dict[str, Any]) -> dict[str, Any]:
    """s3fs options with the client's own retries off (botocore's and s3fs's; trainsnap's
    :class:`~trainsnap.storage.retry.RetryingStorage` retries, so that the attempts do not
    multiply) and its timeouts within :class:`Limits`, unless the caller set them."""
    limits = Limits.from_env()
    out = dict(options)
    config = dict(out.pop("config_kwargs", None) or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    config.setdefault("connect_timeout", limits.request_seconds)
    config.setdefault("read_timeout", limits.request_seconds)
    out["config_kwargs"] = config
    return out


CLIENT_RETRIES = 1
"""Attempts s3fs makes of one call (its attribute ``retries``): one, trainsnap retries."""


_SIZES_SEEN = 256
"""Sizes of recently stat-ed keys kept as the bound of a whole read of them."""


class FsspecStorage:
    readinto_is_zero_copy = False

    def __init__(self, fs: Any, root: str, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self.limits = Limits.from_env()
        self._s3 = hasattr(fs, "_call_s3") and hasattr(fs, "split_path")
        """s3fs: reads and listings go through the bounded requests of this module."""
        self._sizes: OrderedDict[str, int] = OrderedDict()
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
            if self._s3:
                self._sync("pipe_file", path, payload, nbytes=len(payload), **self._part_options())
            else:
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
            if self._s3:
                data = self._s3_get(key, path, start, end)
            else:
                # A whole read sends no Range: S3 refuses "bytes=0-" on an empty object (416).
                data = self.fs.cat_file(path, start=start or None, end=end)
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

    def _s3_get(self, key: str, path: str, start: int, end: int | None) -> bytes:
        """One ranged GET, its body read a MiB at a time and never beyond what was asked: a
        whole read asks for the size a stat just answered (or :attr:`Limits.whole_read`) + 1
        bytes and refuses the object when more arrive."""
        bucket, name, _ = self.fs.split_path(path)
        if end is None:
            known = self._sizes.pop(key, None)
            cap = self.limits.whole_read if known is None else known
            want = cap + 1
        else:
            known, cap = None, end - start
            want = cap
        request = {"Bucket": bucket, "Key": name, "Range": f"bytes={start}-{start + want - 1}"}
        try:
            data = self._run(self._bounded_body(request, want, cap, f"{self.url}/{key}"))
        except Exception as e:
            if end is None and start == 0 and _status(e) == 416:
                return b""  # S3 refuses any range of an empty object
            raise
        if data is None or len(data) > cap:
            said = f" (its stat answered {known} bytes)" if known is not None else ""
            raise StoreRefusedError(
                f"{self.url}/{key}: the store sent more than the {cap} bytes a read of it may "
                f"take{said}; it is not an object trainsnap wrote, or the store is not honest",
                key=key,
                path=self.url,
            )
        out: bytes = data
        return out

    async def _bounded_body(
        self, request: dict[str, Any], want: int, refuse_past: int, where: str
    ) -> bytes | None:
        """The body of a GET, at most ``want`` bytes (the rest is never read), or None when more
        than ``refuse_past`` arrive; within
        :attr:`Limits.request_seconds` plus a second per :attr:`Limits.min_rate` bytes read."""
        import asyncio

        loop = asyncio.get_running_loop()
        began = loop.time()
        limits = self.limits
        response = await asyncio.wait_for(
            self.fs._call_s3("get_object", **request), limits.request_seconds
        )
        body = response["Body"]
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        first = request["Range"][6:].partition("-")[0]
        answered = str(response.get("ContentRange") or "")
        if (status == 200 and first != "0") or (
            status == 206 and not answered.startswith(f"bytes {first}-")
        ):
            body.close()  # not the bytes asked for
            raise StoreRefusedError(
                f"{where}: the store answered the range {request['Range']!r} with {status} "
                f"{answered!r}: other bytes than those asked for",
                path=self.url,
            )
        chunks, total = [], 0
        try:
            while total < want:
                left = limits.seconds_for(total) - (loop.time() - began)
                try:
                    chunk = await asyncio.wait_for(body.read(min(1 << 20, want - total)), left)
                except TimeoutError:
                    raise TimeoutError(
                        f"{where}: the store sent {total} bytes in {loop.time() - began:.1f} s; "
                        f"a read may take {limits.request_seconds:g} s plus a second per "
                        f"{limits.min_rate / (1 << 20):g} MiB"
                    ) from None
                if not chunk:
                    break
                total += len(chunk)
                if total > refuse_past:  # refused before anything is joined
                    return None
                chunks.append(chunk)
        finally:
            body.close()
        return b"".join(chunks)

    def _run(self, coroutine: Any) -> Any:
        import fsspec.asyn

        async def run() -> Any:
            try:
                return True, await coroutine
            except Exception as e:  # raised here, as it is: sync() would rename a timeout
                return False, e

        done, result = fsspec.asyn.sync(self.fs.loop, run)
        if not done:
            raise result
        return result

    def _sync(self, method: str, *args: Any, nbytes: int = 0, **kwargs: Any) -> Any:
        """An s3fs method within the deadline of a request of ``nbytes``."""
        return getattr(self.fs, method)(*args, timeout=self.limits.seconds_for(nbytes), **kwargs)

    def _s3_list(self, base: str) -> Iterator[str]:
        """Keys under ``base``, a page of at most 1,000 at a time, each page within a request's
        deadline; :class:`StoreRefusedError` past :attr:`Limits.list_keys` keys or
        :attr:`Limits.list_pages` pages (a listing that never ends)."""
        import asyncio

        bucket, _, prefix = base.partition("/")
        strip = self._strip_prefix().partition("/")[2]
        limits = self.limits
        token, pages, keys = None, 0, 0
        while True:
            request: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": 1000}
            if token:
                request["ContinuationToken"] = token
            call = self.fs._call_s3("list_objects_v2", **request)
            try:
                page = self._run(asyncio.wait_for(call, limits.request_seconds))
            except FileNotFoundError:
                return
            except TimeoutError:
                raise TimeoutError(
                    f"list {self.url}/{base[len(self.root) + 1 :]}: page {pages + 1} got no "
                    f"answer within {limits.request_seconds:g} s"
                ) from None
            except Exception as e:
                if _is_builtin(e):
                    raise
                raise _as_builtin(e, f"list {self.url}/{base[len(self.root) + 1 :]}") from e
            pages += 1
            for item in page.get("Contents", []):
                keys += 1
                name = str(item.get("Key", ""))
                if name.startswith(strip) and not name.endswith("/") and name != strip:
                    yield name[len(strip) :]
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")
            if not token or pages >= limits.list_pages or keys >= limits.list_keys:
                why = "no token to go on" if not token else f"{pages} pages, {keys} keys"
                raise StoreRefusedError(
                    f"list {self.url}/{base[len(self.root) + 1 :]}: the store's listing does "
                    f"not end ({why}; a listing may have at most {limits.list_keys} keys in "
                    f"{limits.list_pages} pages: TRAINSNAP_STORE_LIST_KEYS raises it)",
                    path=self.url,
                )

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
            info = self._sync("info", path) if self._s3 else self.fs.info(path)
        except Exception as e:
            if not _is_builtin(e):
                raise _as_builtin(e, f"stat {self.url}/{key}") from e
            raise
        if info.get("type") == "directory":
            raise FileNotFoundError(f"{self.url}/{key}")
        size = int(info["size"])
        if self._s3:
            self._sizes[key] = size
            while len(self._sizes) > _SIZES_SEEN:
                self._sizes.popitem(last=False)
        return size

    def list(self, prefix: str) -> Iterator[str]:
        """Keys of objects under ``prefix``. A "folder" is never a key: neither a zero-byte
        ``dir/`` object (what consoles and some tools create), nor the ``dir/`` entry some
        servers (SeaweedFS) keep listing after every object under it was deleted -- yielding it
        would make a deleted snapshot look like an interrupted one."""
        base = f"{self.root}/{check_prefix(prefix)}" if prefix else f"{self.root}/"
        if self._s3:
            yield from self._s3_list(base)
            return
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
        try:
            if self._s3:
                self._sync("rm_file", path)
            else:
                self.fs.rm_file(path)
        except FileNotFoundError:
            return
        except Exception as e:
            if not _is_builtin(e):
                raise _as_builtin(e, f"delete {self.url}/{key}") from e
            raise

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
            payload = bytes(memoryview(data).cast("B"))
            if self._s3:
                self._sync("pipe_file", path, payload, nbytes=len(payload), mode="create")
            else:
                self.fs.pipe_file(path, payload, mode="create")
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
        path = self._path(key)
        try:
            info = self._sync("info", path) if self._s3 else self.fs.info(path)
        except Exception as e:
            if not _is_builtin(e):
                raise _as_builtin(e, f"mtime {self.url}/{key}") from e
            raise
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
    """Whether ``error`` is an ``OSError`` of a builtin type that says what it is (or
    trainsnap's own); a plain ``OSError`` becomes a :class:`StoreError` naming the store."""
    if type(error) is OSError:
        return False
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
    message = f"{what} failed: {type(error).__name__}: {error}"
    if kind is OSError:
        if _ended_early(error):  # a body cut short: the connection, not the object
            return ConnectionError(f"{what} failed: the body ended early: {error}")
        return StoreError(message, errno=getattr(error, "errno", None))
    return kind(message)


def _ended_early(error: BaseException) -> bool:
    names = ("PayloadError", "IncompleteRead", "ResponseStreamingError", "ContentLengthError")
    current: BaseException | None = error
    for _ in range(8):
        if current is None:
            return False
        if any(n in type(current).__name__ for n in names):
            return True
        current = current.__cause__ or current.__context__
    return False


def _status(error: BaseException) -> int | None:
    """The HTTP status of the answer ``error`` (or an error it was raised from) carries."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(status, int):
                return status
        current = current.__cause__ or current.__context__
    return None


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
