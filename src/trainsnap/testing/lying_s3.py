"""An S3 server on loopback that lies, for tests that a reader stays bounded in bytes and time
whatever a store answers.

:class:`LyingS3` serves one bucket from memory on 127.0.0.1 (a free port, a thread of this
process), speaking as much of S3 as s3fs uses: HEAD, GET (with ``Range``), PUT (plain or
``aws-chunked``, ``If-None-Match: *``), DELETE and ListObjectsV2. It is honest until :attr:`lie`
is set to one of :data:`LIES`:

* ``oversized``: a GET ignores its range and streams :data:`HUGE` bytes, while HEAD answers
  the true (small) size;
* ``drip``: a GET's body arrives a byte per :attr:`LyingS3.drip_seconds`;
* ``truncated``: a GET declares the whole length, sends half, and closes the connection;
* ``endless``: a listing is truncated forever, each page with a fresh token and 1,000 keys;
* ``storm``: every request is answered ``503 SlowDown``;
* ``bomb``: a listing is an XML entity bomb (entities nesting ten deep, ten times each).

``lie_on`` limits GET lies to keys holding that text (``"COMMITTED"``: markers only).

    with LyingS3() as s3:
        ts.save(state, s3.url("run"), step=1, storage_options=s3.options)
        s3.lie = "oversized"
        ts.list_snapshots(s3.url("run"), storage_options=s3.options)  # a TrainsnapError
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
import urllib.parse
import uuid
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Final
from xml.sax.saxutils import escape

from trainsnap.testing.s3 import FAKE_CREDENTIALS

BUCKET: Final = "lying"
LIES: Final = ("oversized", "drip", "truncated", "endless", "storm", "bomb")
HUGE: Final = 3 << 29
"""Bytes an ``oversized`` GET streams (1.5 GiB, generated a MiB at a time)."""
_MTIME: Final = "2026-01-01T00:00:00.000Z"


class LyingS3:
    """An in-memory S3 bucket on loopback that answers honestly until told to lie."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.lie: str | None = None
        self.lie_on = ""
        self.drip_seconds = 0.5
        self.requests = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        port = self._server.server_address[1]
        return f"http://127.0.0.1:{port}"

    @property
    def options(self) -> dict[str, Any]:
        """``storage_options`` that reach this server with fake credentials."""
        return {
            "endpoint_url": self.endpoint,
            "key": FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "secret": FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"region_name": FAKE_CREDENTIALS["AWS_DEFAULT_REGION"]},
        }

    def url(self, prefix: str) -> str:
        return f"s3://{BUCKET}/{prefix}"

    def put_tree(self, directory: Path, prefix: str) -> None:
        """Every file under ``directory`` as an object under ``prefix``."""
        for path in sorted(directory.rglob("*")):
            if path.is_file():
                self.objects[f"{prefix}/{path.relative_to(directory).as_posix()}"] = (
                    path.read_bytes()
                )

    def __enter__(self) -> LyingS3:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(store: LyingS3) -> type[BaseHTTPRequestHandler]:
    class Handler(_Handler):
        server_store = store

    return Handler


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_store: LyingS3
    _content_range = ""
    """The Content-Range of the 206 being answered."""

    def log_message(self, format: str, *args: Any) -> None:
        return None

    # -- dispatch ----------------------------------------------------------------------------

    def _route(self) -> tuple[str, dict[str, str]]:
        parsed = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(parsed.query, keep_blank_values=True))
        path = urllib.parse.unquote(parsed.path).lstrip("/")
        bucket, _, key = path.partition("/")
        if bucket != BUCKET:
            return "", query
        return key, query

    def _begin(self) -> tuple[str, dict[str, str]] | None:
        store = self.server_store
        with store._lock:
            store.requests += 1
        if store.lie == "storm":
            self._body_of_request()
            self._error(503, "SlowDown", "Please reduce your request rate.")
            return None
        return self._route()

    def do_HEAD(self) -> None:
        route = self._begin()
        if route is None:
            return
        data = self.server_store.objects.get(route[0])
        if data is None:
            self._reply(404, b"", head=True)
            return
        self._reply(200, b"", head=True, length=len(data), etag=_etag(data))

    def do_GET(self) -> None:
        route = self._begin()
        if route is None:
            return
        key, query = route
        if not key:
            self._list(query)
            return
        store = self.server_store
        data = store.objects.get(key)
        if data is None:
            self._error(404, "NoSuchKey", "The specified key does not exist.")
            return
        lying = store.lie in ("oversized", "drip", "truncated") and store.lie_on in key
        if lying and store.lie == "oversized":
            self._stream_zeros()
            return
        start, end = _range(self.headers.get("Range"), len(data))
        if start >= len(data) and data:
            self._error(416, "InvalidRange", "The requested range is not satisfiable")
            return
        part = data[start:end]
        status = 206 if self.headers.get("Range") else 200
        self._content_range = f"bytes {start}-{end - 1}/{len(data)}" if status == 206 else ""
        if lying and store.lie == "drip":
            self._drip(status, part)
        elif lying and store.lie == "truncated":
            self._reply(status, part[: len(part) // 2], length=len(part), close=True)
        else:
            self._reply(status, part, etag=_etag(data))

    def do_PUT(self) -> None:
        route = self._begin()
        if route is None:
            return
        key = route[0]
        body = self._body_of_request()
        store = self.server_store
        with store._lock:
            if self.headers.get("If-None-Match") == "*" and key in store.objects:
                self._error(412, "PreconditionFailed", "At least one precondition failed")
                return
            store.objects[key] = body
        self._reply(200, b"", etag=_etag(body))

    def do_DELETE(self) -> None:
        route = self._begin()
        if route is None:
            return
        self.server_store.objects.pop(route[0], None)
        self._reply(204, b"")

    def do_POST(self) -> None:
        if self._begin() is not None:
            self._body_of_request()
            self._error(501, "NotImplemented", "not served by this test server")

    # -- answers -----------------------------------------------------------------------------

    def _list(self, query: dict[str, str]) -> None:
        store = self.server_store
        prefix = query.get("prefix", "")
        if store.lie == "bomb":
            self._reply(200, _BOMB, content_type="application/xml")
            return
        if store.lie == "endless":
            keys = [(f"{prefix}{uuid.uuid4().hex}", 1) for _ in range(1000)]
            self._reply(200, _listing(prefix, keys, str(uuid.uuid4())), content_type="text/xml")
            return
        keys = sorted((k, len(v)) for k, v in list(store.objects.items()) if k.startswith(prefix))
        after = query.get("continuation-token") or query.get("start-after") or ""
        keys = [item for item in keys if item[0] > after]
        limit = min(int(query.get("max-keys") or 1000), 1000)
        page, more = keys[:limit], len(keys) > limit
        token = page[-1][0] if more else None
        self._reply(200, _listing(prefix, page, token), content_type="application/xml")

    def _stream_zeros(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(HUGE))
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        chunk = bytes(1 << 20)
        try:
            for _ in range(HUGE >> 20):
                self.wfile.write(chunk)
        except OSError:
            pass  # the reader stopped reading: what it should do
        self.close_connection = True

    def _drip(self, status: int, part: bytes) -> None:
        self.send_response(status)
        if status == 206:
            self.send_header("Content-Range", self._content_range)
        self.send_header("Content-Length", str(len(part)))
        self.end_headers()
        try:
            for i in range(len(part)):
                self.wfile.write(part[i : i + 1])
                self.wfile.flush()
                time.sleep(self.server_store.drip_seconds)
        except OSError:
            pass
        self.close_connection = True

    def _error(self, status: int, code: str, message: str) -> None:
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>'
            f"<Error><Code>{code}</Code><Message>{message}</Message></Error>"
        ).encode()
        self._reply(status, body, content_type="application/xml")

    def _reply(
        self,
        status: int,
        body: bytes,
        *,
        head: bool = False,
        length: int | None = None,
        etag: str | None = None,
        content_type: str = "application/octet-stream",
        close: bool = False,
    ) -> None:
        self.send_response(status)
        if status == 206 and self._content_range:
            self.send_header("Content-Range", self._content_range)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.send_header("Content-Type", content_type)
        self.send_header("Last-Modified", formatdate(usegmt=True))
        if etag:
            self.send_header("ETag", etag)
        if close:
            self.send_header("Connection", "close")
        self.end_headers()
        if not head and body:
            with contextlib.suppress(OSError):  # the reader hung up
                self.wfile.write(body)
        if close:
            self.close_connection = True

    def _body_of_request(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        encoding = self.headers.get("Content-Encoding", "")
        payload = self.headers.get("x-amz-content-sha256", "")
        if "aws-chunked" in encoding or payload.startswith("STREAMING"):
            return _unchunk(raw)
        return raw


def _range(header: str | None, size: int) -> tuple[int, int]:
    """[start, end) of a ``bytes=a-b`` range (the whole object without one)."""
    if not header or not header.startswith("bytes="):
        return 0, size
    first, _, last = header[6:].partition("-")
    start = int(first or 0)
    end = size if not last else min(size, int(last) + 1)
    return start, end


def _unchunk(raw: bytes) -> bytes:
    """The payload of an ``aws-chunked`` body: ``<hex size>[;ext]\\r\\n<bytes>\\r\\n``..."""
    out, at = bytearray(), 0
    while at < len(raw):
        line_end = raw.index(b"\r\n", at)
        size = int(raw[at:line_end].split(b";")[0], 16)
        if size == 0:
            break
        out += raw[line_end + 2 : line_end + 2 + size]
        at = line_end + 2 + size + 2
    return bytes(out)


def _etag(data: bytes) -> str:
    return f'"{hashlib.md5(data, usedforsecurity=False).hexdigest()}"'


def _listing(prefix: str, keys: list[tuple[str, int]], token: str | None) -> bytes:
    contents = "".join(
        f"<Contents><Key>{escape(key)}</Key><LastModified>{_MTIME}</LastModified>"
        f'<ETag>"0"</ETag><Size>{size}</Size><StorageClass>STANDARD</StorageClass></Contents>'
        for key, size in keys
    )
    more = f"<NextContinuationToken>{escape(token)}</NextContinuationToken>" if token else ""
    return (
        '<?xml version="1.0" encoding="UTF-8"?>'
        '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        f"<Name>{BUCKET}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{len(keys)}</KeyCount>"
        f"<MaxKeys>1000</MaxKeys><IsTruncated>{'true' if token else 'false'}</IsTruncated>"
        f"{more}{contents}</ListBucketResult>"
    ).encode()


def _bomb() -> bytes:
    entities = ['<!ENTITY e0 "lollollollollollollollollollol">']
    for level in range(1, 10):
        entities.append(f'<!ENTITY e{level} "{f"&e{level - 1};" * 10}">')
    return (
        '<?xml version="1.0"?><!DOCTYPE ListBucketResult [' + "".join(entities) + "]>"
        '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        f"<Name>{BUCKET}</Name><Prefix>&e9;</Prefix><IsTruncated>false</IsTruncated>"
        "</ListBucketResult>"
    ).encode()


_BOMB: Final = _bomb()

__all__ = ["BUCKET", "HUGE", "LIES", "LyingS3"]
