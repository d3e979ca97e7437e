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
import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from trainsnap.storage.base import (
    Buffer,
    ShortReadError,
    Steps,
    Storage,
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
}


def is_transient(error: BaseException) -> bool:
    if isinstance(error, FileNotFoundError | FileExistsError | PermissionError | ShortReadError):
        return False
    if isinstance(error, TimeoutError | ConnectionError):
        return True
    if isinstance(error, OSError):
        if error.errno in _TRANSIENT_ERRNOS:
            return True
        text = str(error).lower()
        return any(w in text for w in ("timeout", "timed out", "throttl", "slow down", "503"))
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
        deadline: float = 60.0,
    ) -> None:
        self.inner = inner
        self.url = inner.url
        self.readinto_is_zero_copy = inner.readinto_is_zero_copy
        self.attempts, self.base_delay, self.max_delay = attempts, base_delay, max_delay
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
                late = time.monotonic() - start > self.deadline
                if not is_transient(e) or attempt == self.attempts or late:
                    raise
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
