"""Bounded retries with backoff for transient storage errors.

Every operation of the protocol is idempotent by construction -- an object's name is its
content, so writing it twice writes the same bytes; a marker or manifest rewritten is the same
document; a delete of a deleted key succeeds -- so a transient failure (a timeout, a reset
connection, a throttled request) is retried with exponential backoff and jitter, a bounded
number of times within a bounded time. Anything else (a missing key, a full disk, a permission,
a short read) is not transient and is raised at once: a save that cannot finish fails loudly
and in bounded time; it never hangs and never commits.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from trainsnap.errors import TrainsnapError
from trainsnap.storage.base import (
    Buffer,
    ShortReadError,
    Steps,
    Storage,
    StoreError,
    StoreRefusedError,
    read_steps,
    read_uncached,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT_ERRNOS = {
    errno.EAGAIN,
    errno.EINTR,
    errno.ETIMEDOUT,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ECONNREFUSED,
    errno.EPIPE,
    errno.EBUSY,
    errno.EIO,
    errno.EREMOTEIO,  # s3fs: HTTP 500 InternalError
}


class StoreUnavailableError(StoreError):
    """A storage operation that kept failing transiently (timeouts, 503s, reset connections)
    until the retry budget was spent: names the store, the operation and its key, how many
    attempts over how long, and the last answer. An ``OSError`` still, for code that handles
    storage failures; a :class:`~trainsnap.errors.TrainsnapError` for the user."""

    def __init__(self, url: str, what: str, attempts: int, seconds: float, last: BaseException):
        message = (
            f"{what} on {url} failed {attempts} time(s) over {seconds:.1f} s, last with "
            f"{type(last).__name__}: {str(last)[:300]}; the store is unavailable or throttling. "
            "Check it and try again (TRAINSNAP_STORE_RETRY_SECONDS gives retries more time)"
        )
        number = getattr(last, "errno", None)
        super().__init__(message, errno=number, key=what.partition(" ")[2] or None, path=url)


def is_transient(error: BaseException) -> bool:
    if isinstance(error, StoreUnavailableError | StoreRefusedError):
        return False  # already a verdict: a budget spent, an answer refused
    if isinstance(error, TrainsnapError) and not isinstance(error, StoreError):
        return False
    if isinstance(error, FileNotFoundError | FileExistsError | PermissionError | ShortReadError):
        return False
    if isinstance(error, TimeoutError | ConnectionError):
        return True
    if isinstance(error, OSError):
        if error.errno in _TRANSIENT_ERRNOS:
            return True
        text = str(error).lower()
        words = ("timeout", "timed out", "throttl", "slow down", "slowdown", "503")
        return any(w in text for w in words)
    return False


class RetryingStorage:
    """Wraps a backend; retries transient failures of every operation."""

    def __init__(
        self,
        inner: Storage,
        *,
        attempts: int = 5,
        base_delay: float = 0.05,
        max_delay: float = 2.0,
        deadline: float | None = None,
    ) -> None:
        """``deadline``: seconds after which a failing operation is not tried again
        (``TRAINSNAP_STORE_RETRY_SECONDS``, else 60)."""
        self.inner = inner
        self.url = inner.url
        self.readinto_is_zero_copy = inner.readinto_is_zero_copy
        self.attempts, self.base_delay, self.max_delay = attempts, base_delay, max_delay
        if deadline is None:
            deadline = float(os.environ.get("TRAINSNAP_STORE_RETRY_SECONDS") or 60.0)
        self.deadline = deadline
        self.retries = 0
        """Retries made so far (for tests and reports)."""

    def __repr__(self) -> str:
        return f"RetryingStorage({self.inner!r})"

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # capabilities such as list_temporaries

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        start = time.monotonic()
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except Exception as e:
                spent = time.monotonic() - start
                if not is_transient(e):
                    raise
                if attempt == self.attempts or spent > self.deadline:
                    raise StoreUnavailableError(self.url, what, attempt, spent, e) from e
                delay = min(self.max_delay, self.base_delay * 2 ** (attempt - 1))
                delay *= 0.5 + random.random()
                self.retries += 1
                log.info(
                    "%s on %s failed (%s); retry %d in %.2fs", what, self.url, e, attempt, delay
                )
                time.sleep(delay)
        raise AssertionError("unreachable")

    def put(self, key: str, data: Buffer | Sequence[Buffer]) -> None:
        self._call(f"put {key}", lambda: self.inner.put(key, data))

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        return self._call(f"get {key}", lambda: self.inner.get(key, start, end))

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        self._call(f"read {key}", lambda: self.inner.read_into(key, start, out))

    def read_steps(self, key: str, start: int, steps: Steps, done: Callable[[int], None]) -> None:
        """A retried read fills every step again (``done`` sees each step again)."""
        self._call(f"read {key}", lambda: read_steps(self.inner, key, start, steps, done))

    def read_uncached(self, key: str, start: int, out: memoryview, length: int) -> bool:
        return self._call(f"read {key}", lambda: read_uncached(self.inner, key, start, out, length))

    def stat(self, key: str) -> int:
        return self._call(f"stat {key}", lambda: self.inner.stat(key))

    def list(self, prefix: str) -> Iterator[str]:
        return iter(self._call(f"list {prefix}", lambda: list(self.inner.list(prefix))))

    def delete(self, key: str) -> None:
        self._call(f"delete {key}", lambda: self.inner.delete(key))

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        """A retried create may find the key made by its own earlier, unanswered attempt: the
        key then holds exactly our bytes, and that counts as success."""
        first = [True]

        def attempt() -> bool:
            if self.inner.put_if_absent(key, data):
                return True
            if first[0]:
                return False
            return bytes(self.inner.get(key)) == bytes(memoryview(data).cast("B"))

        def wrapped() -> bool:
            try:
                return attempt()
            finally:
                first[0] = False

        return self._call(f"create {key}", wrapped)

    def mtime(self, key: str) -> float:
        return self._call(f"mtime {key}", lambda: self.inner.mtime(key))

    def refresh(self, key: str, data: Buffer | Sequence[Buffer]) -> None:
        self._call(f"refresh {key}", lambda: self.inner.refresh(key, data))
